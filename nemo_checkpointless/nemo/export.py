"""Export one step of an `engine=nemo` run's persistent checkpoint as a Hugging Face Llama directory.

`export_hf(run_dir, out, step)` writes `out/config.json` and `out/model.safetensors`, which
`transformers.LlamaForCausalLM.from_pretrained(out)` loads. Only the model parameters are exported (no optimizer
state, no RNG). Plain torch, safetensors and JSON: neither NeMo nor megatron-core is imported, so it runs without
the [nemo] extra.

What it reads: the run's saved config (`RUN_DIR/config.yaml`: the model's sizes, `rope_theta`, `norm_eps`,
`n_kv_heads`, `tie_embeddings`, `rope_scale_factor`, the parallel layout, `checkpoint.dir`) and shard 0 of the
checkpoint step (`state.checkpoint.CheckpointStore`, verified against its side file; no pickle). Every shard of a
data-parallel NeMo checkpoint holds the full parameters (`MegatronParticipant.boundary_state`), so shard 0 is enough.

The mapping from megatron-core's names (`model.0.[module.]*<megatron name>`; local or Transformer Engine layer
spec) to Hugging Face Llama's:

- `embedding.word_embeddings.weight` -> `model.embed_tokens.weight`, `output_layer.weight` -> `lm_head.weight`,
  both cut to `model.vocab_size` rows (megatron pads the vocabulary to a multiple of 128 x TP);
- `decoder.layers.N.self_attention.linear_qkv.weight` holds, for each query group, that group's query heads, then
  its key head, then its value head: split into `q_proj`, `k_proj`, `v_proj`;
- `decoder.layers.N.mlp.linear_fc1.weight` is gate then up (SwiGLU): split into `gate_proj`, `up_proj`;
- `linear_proj` -> `o_proj`, `linear_fc2` -> `down_proj`, `input_layernorm` (or TE's
  `linear_qkv.layer_norm_weight`) -> `input_layernorm`, `pre_mlp_layernorm` (or `linear_fc1.layer_norm_weight`)
  -> `post_attention_layernorm`, `decoder.final_layernorm` -> `model.norm`.

Both use rotate-half RoPE, so q and k rows need no permutation. Refused, with a `ConfigError`: runs of the
plain-Lightning engine, runs with `parallel.tp` or `parallel.pp` > 1 (their checkpoint holds one file per TP/PP
slice, `checkpoint_slot`; merging the slices into one model is not implemented), and a checkpoint holding a
parameter a Llama has no place for (biases, QK norms).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from nemo_checkpointless.config import RUN_CONFIG, Config, ModelConfig, load_run_config
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.state.checkpoint import CheckpointError, CheckpointStore

__all__ = ["FORMATS", "ExportResult", "export_hf", "hf_config", "hf_llama_params", "megatron_params"]

FORMATS = ("hf",)
# Megatron's Llama 3.1 RoPE scaling as the NeMo worker builds it (`Llama31Config`, old_context_len=8192).
_LLAMA31_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ExportResult:
    step: int
    out: Path
    num_params: int  # elements, after cutting the padded vocabulary
    dtype: str


# ------------------------------------------------------------------------------------------------ reading
def _run_config(run_dir: Path) -> Config:
    if not (run_dir / RUN_CONFIG).is_file():
        raise ConfigError("--run-dir", run_dir, f"holds no {RUN_CONFIG} (the config checkpointless-train saves)",
                          "pass the run.dir of a checkpointless-train run")
    try:
        return load_run_config(run_dir)
    except ConfigError as e:
        raise ConfigError("--run-dir", run_dir, f"its {RUN_CONFIG} is not valid ({e})",
                          "pass the run.dir of a checkpointless-train run of this version") from e
    except Exception as e:  # a YAML or schema error from OmegaConf
        raise ConfigError("--run-dir", run_dir, f"its {RUN_CONFIG} is unreadable ({type(e).__name__}: {e})",
                          "pass the run.dir of a checkpointless-train run") from e


def _check_exportable(cfg: Config, run_dir: Path) -> None:
    if cfg.engine != "nemo":
        raise ConfigError("--run-dir", run_dir, f"is a run of engine={cfg.engine}; the Hugging Face export reads "
                          "the NeMo / megatron-core checkpoint (engine=nemo)", "export a run of engine=nemo")
    if getattr(cfg, "script", None):  # a user's own script: model.* in the config need not describe its model
        raise ConfigError("--run-dir", run_dir, f"is a run of a user's script ({cfg.script}); its model is the "
                          "script's, not the one model.* in the run's config describes",
                          "export a run of the package's NeMo worker (no script=)")
    p = cfg.parallel
    if p.tp > 1 or p.pp > 1:
        raise ConfigError("--run-dir", run_dir, f"was trained with parallel.tp={p.tp}, parallel.pp={p.pp}: its "
                          "checkpoint holds one file per TP/PP slice, and this export does not merge slices",
                          "export a run with parallel.tp=1 and parallel.pp=1")


def _resolve_step(store: CheckpointStore, step: int | None, run_dir: Path) -> int:
    """`step`, if the checkpoint has it listed; else (None) the newest step whose every shard verifies."""
    listed = store.steps()
    if not listed:
        raise ConfigError("--run-dir", run_dir, f"has no checkpoint under {store.dir}",
                          "train with checkpoint.every_n_steps=N (N >= 1) first")
    if step is None:
        newest = store.latest(listed[-1])
        if newest == 0:
            raise ConfigError("--run-dir", run_dir, f"has no checkpoint that verifies under {store.dir} "
                              f"(steps {', '.join(map(str, listed))} are truncated or corrupt)",
                              "train again with checkpoint.every_n_steps=N")
        return newest
    if step not in listed:
        raise ConfigError("--step", step, f"is not a checkpoint step of this run (it has {_listing(listed)})",
                          "pick one of those, or leave --step out for the newest")
    return step


def _listing(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 10 else f"{steps[0]} ... {steps[-1]} ({len(steps)} steps)"


def megatron_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model parameters of one shard, by megatron-core's own names (`model.0.module.module.decoder...` ->
    `decoder...`). Raises ValueError for a checkpoint of more than one model chunk (virtual pipeline stages)."""
    out: dict[str, torch.Tensor] = {}
    chunks = set()
    for name, t in tensors.items():
        if not name.startswith("model."):
            continue
        _, chunk, rest = name.split(".", 2)
        chunks.add(chunk)
        while rest.startswith("module."):  # megatron's DDP and Float16Module wrappers
            rest = rest[len("module."):]
        out[rest] = t
    if len(chunks) > 1:
        raise ValueError(f"the checkpoint holds {len(chunks)} model chunks (virtual pipeline stages)")
    return out


# ---------------------------------------------------------------------------------------------- converting
def hf_llama_params(params: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron-core GPT (Llama) parameters -> Hugging Face `LlamaForCausalLM` state dict (see the module doc).
    Raises ValueError naming a parameter that is missing, of an unexpected shape, or has no Llama counterpart."""
    left = dict(params)
    head_dim, groups = m.d_model // m.n_heads, m.n_kv_heads
    per_group = m.n_heads // groups

    def take(name: str, *alias: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        for n in (name, *alias):
            if n in left:
                t = left.pop(n)
                if shape is not None and tuple(t.shape) != shape:
                    raise ValueError(f"{n} has shape {list(t.shape)}, model.* in the run's config gives "
                                     f"{list(shape)}")
                return t
        raise ValueError(f"the checkpoint has no {name}")

    def vocab(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.dim() != 2 or t.shape[0] < m.vocab_size or t.shape[1] != m.d_model:
            raise ValueError(f"{name} has shape {list(t.shape)}, expected [>= {m.vocab_size}, {m.d_model}]")
        return t[: m.vocab_size]

    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = vocab(take("embedding.word_embeddings.weight"), "the embedding")
    for i in range(m.n_layers):
        pre, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = take(pre + "self_attention.linear_qkv.weight", shape=((m.n_heads + 2 * groups) * head_dim, m.d_model))
        qkv = qkv.view(groups, per_group + 2, head_dim, m.d_model)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, m.d_model)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, m.d_model)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, m.d_model)
        out[hf + "self_attn.o_proj.weight"] = take(pre + "self_attention.linear_proj.weight",
                                                   shape=(m.d_model, m.n_heads * head_dim))
        gate, up = take(pre + "mlp.linear_fc1.weight", shape=(2 * m.ffn_hidden, m.d_model)).chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = take(pre + "mlp.linear_fc2.weight", shape=(m.d_model, m.ffn_hidden))
        out[hf + "input_layernorm.weight"] = take(pre + "input_layernorm.weight",
                                                  pre + "self_attention.linear_qkv.layer_norm_weight",
                                                  shape=(m.d_model,))
        out[hf + "post_attention_layernorm.weight"] = take(pre + "pre_mlp_layernorm.weight",
                                                           pre + "mlp.linear_fc1.layer_norm_weight",
                                                           shape=(m.d_model,))
    out["model.norm.weight"] = take("decoder.final_layernorm.weight", shape=(m.d_model,))
    if not m.tie_embeddings:  # tied: Hugging Face ties lm_head to the embedding itself (tie_word_embeddings)
        out["lm_head.weight"] = vocab(take("output_layer.weight"), "the output layer")
    if left:
        extra = sorted(left)
        raise ValueError(f"the checkpoint holds {len(extra)} parameter(s) a Hugging Face Llama has no place for, "
                         f"e.g. {extra[:3]}")
    # Own storage per tensor: safetensors refuses tensors that share memory (q, k, v are views of one).
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_config(cfg: Config, dtype: torch.dtype) -> dict[str, Any]:
    """`config.json` of the Hugging Face Llama the run trained (the NeMo worker's `Llama3Config` / `Llama31Config`
    arguments, from the run's config)."""
    m = cfg.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.d_model // m.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        # The worker passes rotary_base=int(model.rope_theta) to megatron: the model trained with that.
        "rope_theta": float(int(m.rope_theta)),
        "rope_scaling": {**_LLAMA31_ROPE, "factor": m.rope_scale_factor} if m.rope_scale_factor else None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "torch_dtype": _DTYPES.get(dtype, str(dtype).removeprefix("torch.")),
        "use_cache": True,
    }


# ------------------------------------------------------------------------------------------------ writing
def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--out", out, "exists and is not an empty directory",
                          "name a new directory (the export never overwrites files)")


def _write_dir(out: Path, files: dict[str, bytes], tensors: dict[str, torch.Tensor]) -> None:
    """Write the export into a private temporary directory beside `out`, then rename it to `out`: a reader never
    sees a half-written export, and a failed export leaves nothing at `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # mode 0700
    try:
        for name, data in files.items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        weights = tmp / "model.safetensors"
        safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
        weights.chmod(0o600)
        if out.exists():
            out.rmdir()  # empty (checked before), and renaming onto it needs it gone
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(run_dir: str | os.PathLike[str], out: str | os.PathLike[str], step: int | None = None) -> ExportResult:
    """Export checkpoint step `step` (default: the newest that verifies) of the run at `run_dir` to `out` as a
    Hugging Face Llama directory. One process, no collective; the run may still be training (a step is read only
    once its files are complete). Raises `ConfigError` (the argument, the rule, the fix) for a run, step or
    output directory it cannot export."""
    run_dir, out = Path(run_dir), Path(out)
    _check_out(out)
    cfg = _run_config(run_dir)
    _check_exportable(cfg, run_dir)
    store = CheckpointStore(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.dims().checkpoint_slots)
    asked = step
    step = _resolve_step(store, step, run_dir)
    try:
        tensors, _ = store.load_shard(step, 0)
        params = hf_llama_params(megatron_params(tensors), cfg.model)
    except CheckpointError as e:  # only a step named by --step gets here unverified
        others = [s for s in store.steps() if s != step]
        raise ConfigError("--step" if asked is not None else "--run-dir", step if asked is not None else run_dir,
                          f"the checkpoint of step {step} does not verify ({e})",
                          f"pick another step ({_listing(others)})" if others else "train again with "
                          "checkpoint.every_n_steps=N") from e
    except ValueError as e:
        raise ConfigError("--run-dir", run_dir, f"its checkpoint of step {step} is not a Llama this export knows "
                          f"({e})", "export a run of the NeMo engine's Llama recipes") from e
    dtypes = {t.dtype for t in params.values()}
    if len(dtypes) != 1:
        raise ConfigError("--run-dir", run_dir, f"its checkpoint mixes parameter dtypes {sorted(map(str, dtypes))}",
                          "export a run whose parameters share one dtype")
    dtype = dtypes.pop()
    config = json.dumps(hf_config(cfg, dtype), indent=2, sort_keys=True).encode() + b"\n"
    _write_dir(out, {"config.json": config}, params)
    return ExportResult(step, out, sum(t.numel() for t in params.values()), _DTYPES.get(dtype, str(dtype)))
