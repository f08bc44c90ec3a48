"""Command-line entry points (Hydra apps): checkpointless-train, checkpointless-tokenize."""
