"""Memory per GPU of a Llama-class recipe under Megatron's layout and distributed optimizer with N instances.

Pure arithmetic on a `Config`; no torch, no process. The formulas (and why) are in `docs/planning.md`:

    P_r        parameters on the most loaded rank (last pipeline stage; linear layers and the vocab-parallel
               embedding / output layer split over tp; norms replicated; vocab padded to a multiple of 128 x tp)
    params     = P_r x param_bytes                      (bf16-mixed: 2 B; 32-true: 4 B)
    grads      = P_r x grad_bytes                       (fp32 main grads: 4 B)
    optimizer  = P_r x optim_bytes / S, S = dp*cp / N    (bf16-mixed: fp32 master + Adam m, v = 12 B; 32-true: 8 B)
    extra(N)   = optimizer(N) - optimizer(1) = P_r x optim_bytes x (N - 1) / (dp*cp)

`S` is the shard group: the ranks of one optimizer instance within a dp-cp group (Megatron's
`num_distributed_optimizer_instances` = N cuts the dp-cp group into N contiguous chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nemo_checkpointless.config import Config, ModelConfig

GIB = 1 << 30

# Bytes per parameter: (param, grad, optimizer state before sharding). Megatron's table "memory per parameter
# with the distributed optimizer": bf16 params + fp32 grads = 6 + 12/d; fp32 params + fp32 grads = 8 + 8/d.
BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"bf16-mixed": (2, 4, 12), "32-true": (4, 4, 8)}
# Activation element size; logits also keep an fp32 copy for the cross-entropy backward.
ACT_BYTES: dict[str, int] = {"bf16-mixed": 2, "32-true": 4}

VOCAB_DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by (NeMo's Llama configs use 128)


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary to a multiple of `divisible_by x tp` (vocab-parallel embedding)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def layer_linear_params(m: ModelConfig) -> int:
    """Weights of one block's linear layers: q, k, v, o (grouped-query attention) and SwiGLU gate, up, down."""
    head_dim = m.d_model // m.n_heads
    attn = m.d_model * (m.n_heads * head_dim) * 2 + m.d_model * (m.n_kv_heads * head_dim) * 2
    return attn + 3 * m.d_model * m.ffn_hidden


def total_params(m: ModelConfig) -> int:
    """The published parameter count: embedding + blocks (+2 norms each) + final norm + output layer (unless tied);
    unpadded vocabulary. Equals `LlamaModel(cfg).num_parameters()`."""
    embed = m.vocab_size * m.d_model
    return embed + m.n_layers * (layer_linear_params(m) + 2 * m.d_model) + m.d_model + (0 if m.tie_embeddings
                                                                                          else embed)


def params_per_gpu(m: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on the most loaded rank. With pp > 1 that is the last stage: its blocks, the final norm and the
    output layer (with tied embeddings Megatron keeps a copy of the word embedding there)."""
    block = layer_linear_params(m) // tp + 2 * m.d_model
    vocab = padded_vocab(m.vocab_size, tp) * m.d_model // tp
    layers = m.n_layers // pp
    if pp == 1:
        return vocab + layers * block + m.d_model + (0 if m.tie_embeddings else vocab)
    first = vocab + layers * block
    last = layers * block + m.d_model + vocab
    return max(first, last)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU. `activations` is an estimate (see `activation_bytes`); the rest is exact arithmetic."""

    precision: str
    params_per_gpu: int
    dp: int
    dp_cp: int
    num_instances: int
    shard_group: int
    params: int
    grads: int
    optimizer: int
    optimizer_one_instance: int
    activations: int

    @property
    def replication_extra(self) -> int:
        return self.optimizer - self.optimizer_one_instance

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.static + self.activations

    def fits(self, gpu_gib: float, reserve_gib: float) -> bool:
        return self.total <= (gpu_gib - reserve_gib) * GIB

    @property
    def state_received_bytes(self) -> int:
        """What a replacement receives from a replica: params + its optimizer shard (master params, m, v)."""
        return self.params + self.optimizer


def activation_bytes(cfg: Config) -> int:
    """Estimate of the activations held at the peak of a step on the most loaded rank.

    Per block and micro-batch, elements kept for the backward (flash attention: no s x s matrix; no
    recomputation; no dropout): the two norm inputs and the two norm outputs (4h), q and the attention output
    (2h), k and v (2 x kv_heads x head_dim), the SwiGLU gate, up, activation and down-projection input (4f);
    each times s/cp tokens x b. Sequence parallelism divides all of it by tp; without it only the tp-split terms.
    1F1B: the first stage keeps pp micro-batches of L/pp blocks = L blocks' worth. Plus the logits of one
    micro-batch (s/cp x b x V/tp, bf16 + an fp32 copy), counted on the same rank to stay an upper bound.
    Interleaved (virtual) pipelines hold (1 + (pp-1)/(pp*v)) times more; not modelled.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    act = ACT_BYTES[t.precision]
    head_dim = m.d_model // m.n_heads
    tokens = cfg.data.seq_len // p.cp * cfg.data.micro_batch_size
    split = 2 * m.d_model + 2 * m.n_kv_heads * head_dim + 4 * m.ffn_hidden  # divided by tp
    norms = 4 * m.d_model  # divided by tp only with sequence parallelism
    per_token = (norms + split) / p.tp if (p.sequence_parallel and p.tp > 1) else norms + split / p.tp
    blocks = per_token * tokens * act * m.n_layers
    logits = tokens * padded_vocab(m.vocab_size, p.tp) / p.tp * (act + 4)
    return int(blocks + logits)


def plan_memory(cfg: Config) -> MemoryPlan:
    """The memory table of `cfg` at its cluster size (`trainer.num_nodes x trainer.devices`)."""
    dims = cfg.dims()
    precision = cfg.trainer.precision
    pb, gb, ob = BYTES_PER_PARAM[precision]
    pr = params_per_gpu(cfg.model, cfg.parallel.tp, cfg.parallel.pp)
    n = cfg.replication.num_instances
    shard = dims.dp_cp // n
    return MemoryPlan(
        precision=precision, params_per_gpu=pr, dp=dims.dp, dp_cp=dims.dp_cp, num_instances=n, shard_group=shard,
        params=pr * pb, grads=pr * gb,
        # Megatron pads each bucket to a multiple of the shard count; the padding (< S elements) is ignored.
        optimizer=math.ceil(pr * ob / shard), optimizer_one_instance=math.ceil(pr * ob / dims.dp_cp),
        activations=activation_bytes(cfg))
