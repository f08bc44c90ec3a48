"""What a rank holds at a step boundary, and canonical hashes of it."""

from nemo_checkpointless.state.hashing import DataDigest, batch_hash, state_digest

__all__ = ["DataDigest", "batch_hash", "state_digest"]
