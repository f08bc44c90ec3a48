"""megatron-core's side of the engine: what any door that trains with megatron-core (NeMo 2 today; Megatron-Bridge
or Megatron-LM next) shares, importing megatron-core only (never NeMo or Lightning), each module on first use:

- `participant`: `MegatronParticipant`, the recovery engine's view of a rank's megatron state (its TP/PP slice of
  the parameters, its distributed-optimizer shard and state, RNG with Megatron's tracker, step, data record);
- `numerics`: megatron's gradient reduction and norm made independent of the number of optimizer instances;
- `digest`: the canonical digest of a job's state, however the optimizer state is sharded;
- `groups`: the default group and megatron's groups across generations (the fault watch, abandoning a failed
  generation's groups, freeing a failed setup).
- `data`: datasets indexed by the position Megatron's pretraining sampler reads (ours, and a user's through the
  shared-memory cache), and the per-step record of the micro-batches a step consumed;
- `export`: a checkpoint of megatron's TP/PP slices merged and written as a Hugging Face Llama directory.
"""
