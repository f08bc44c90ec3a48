"""Export one step of an `engine=nemo` run's persistent checkpoint as a Hugging Face Llama directory.

`export_hf(run_dir, out, step)` writes `out/config.json` and `out/model.safetensors`, which
`transformers.LlamaForCausalLM.from_pretrained(out)` loads. Only the model parameters are exported (no optimizer
state, no RNG). Plain torch, safetensors and JSON: neither NeMo nor megatron-core is imported, so it runs without
the [nemo] extra.

What it reads: the run's saved config (`RUN_DIR/config.yaml`: the model's sizes, `rope_theta`, `norm_eps`,
`n_kv_heads`, `tie_embeddings`, `rope_scale_factor`, the parallel layout, `checkpoint.dir`) and, of the checkpoint
step, one file per TP/PP slice (`state.checkpoint.CheckpointStore`, each verified against its side file; no
pickle): the checkpoint has one file per `checkpoint_slot`, `(pp_rank * tp + tp_rank) * shard_size + shard_index`
(`topology.rank_info`), and every data-parallel shard of a slice holds that slice's full parameters
(`MegatronParticipant.boundary_state`), so shard_index 0 of each slice is enough. Each file's meta must name the
slice its slot stands for (`tp_rank`, `pp_rank`, `shard_index` 0).

`merge_slices` joins the slices into the full model, by megatron-core's names for TP = PP = 1 (megatron-core 0.15's
GPTModel, local or Transformer Engine layer spec):

- PP: each stage numbers its layers from 0 (`decoder.layers.<local>`); megatron's even split puts global layer
  `pp_rank * n_layers / pp + local` there (the NeMo worker sets no `num_layers_in_first/last_pipeline_stage`;
  a stage holding another number of layers, i.e. an uneven split, is refused). The embedding is on the first
  stage, `decoder.final_layernorm` and `output_layer` on the last; with tied embeddings the last stage holds its
  own copy of the embedding as `output_layer.weight`, which a TP = PP = 1 model does not have: dropped.
- TP: column-parallel weights are split along dim 0 (`embedding.word_embeddings`, `output_layer`: vocab-parallel,
  rows in TP-rank order; `linear_qkv`: each rank holds whole query groups, its groups' query heads, key and value
  interleaved per group as in the TP = 1 layout, so the slices concatenate), except `linear_fc1`, where each rank
  holds [its gate rows; its up rows]: the gate halves and the up halves are concatenated separately. Row-parallel
  weights (`linear_proj`, `linear_fc2`) are split along dim 1. Norm weights are replicated (TP rank 0's is taken,
  the others must agree).

`hf_llama_params` then maps the merged model to Hugging Face Llama's names:

- `embedding.word_embeddings.weight` -> `model.embed_tokens.weight`, `output_layer.weight` -> `lm_head.weight`,
  both cut to `model.vocab_size` rows (megatron pads the vocabulary to a multiple of 128 x TP);
- `decoder.layers.N.self_attention.linear_qkv.weight` holds, for each query group, that group's query heads, then
  its key head, then its value head: split into `q_proj`, `k_proj`, `v_proj`;
- `decoder.layers.N.mlp.linear_fc1.weight` is gate then up (SwiGLU): split into `gate_proj`, `up_proj`;
- `linear_proj` -> `o_proj`, `linear_fc2` -> `down_proj`, `input_layernorm` (or TE's
  `linear_qkv.layer_norm_weight`) -> `input_layernorm`, `pre_mlp_layernorm` (or `linear_fc1.layer_norm_weight`)
  -> `post_attention_layernorm`, `decoder.final_layernorm` -> `model.norm`.

Both use rotate-half RoPE, so q and k rows need no permutation. Refused, with a `ConfigError`: runs of the
plain-Lightning engine, a checkpoint whose files do not match the run's layout (a slot file missing, or holding
another slice), virtual pipeline stages, uneven pipeline splits, and a checkpoint holding a parameter a Llama has
no place for (biases, QK norms), or one with no known TP split.
"""

from __future__ import annotations

import json
import os
import re
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
from nemo_checkpointless.topology import ParallelDims

__all__ = ["FORMATS", "ExportResult", "LayoutError", "export_hf", "hf_config", "hf_llama_params", "megatron_params",
           "merge_slices", "read_slices"]

FORMATS = ("hf",)
# Megatron's Llama 3.1 RoPE scaling as the NeMo worker builds it (`Llama31Config`, old_context_len=8192).
_LLAMA31_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_STEP_DIR = re.compile(r"^step_(\d{8})$")  # CheckpointStore's step directories
# Megatron-core's TP split of a transformer layer's weights, by the name's end (see the module doc).
_COLUMN = ("self_attention.linear_qkv.weight",)  # dim 0, slices in order
_GATED = ("mlp.linear_fc1.weight",)  # dim 0, [gate; up] per rank
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # dim 1
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class LayoutError(ValueError):
    """The checkpoint's files do not match the run's parallel layout (a file holds another slice)."""


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


def _resolve_step(store: CheckpointStore, step: int | None, run_dir: Path) -> int:
    """`step`, if the checkpoint has it listed; else (None) the newest step whose every shard verifies."""
    listed = store.steps()
    if not listed:
        incomplete = _incomplete(store)
        if incomplete:  # step directories, none with a file for every slot: another layout, or files lost
            last, missing = incomplete[-1]
            raise ConfigError("--run-dir", run_dir, f"has no complete checkpoint under {store.dir}: step {last} "
                              f"lacks {_names(missing)} of the {store.num_shards} slot files its layout "
                              f"(parallel.tp, parallel.pp, data-parallel shards) gives",
                              "export the run.dir whose config.yaml wrote this checkpoint, or train again with "
                              "checkpoint.every_n_steps=N")
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
        lacks = dict(_incomplete(store)).get(step)
        if lacks:
            raise ConfigError("--step", step, f"is an incomplete checkpoint (it lacks {_names(lacks)} of its "
                              f"{store.num_shards} slot files)", f"pick a complete step ({_listing(listed)})")
        raise ConfigError("--step", step, f"is not a checkpoint step of this run (it has {_listing(listed)})",
                          "pick one of those, or leave --step out for the newest")
    return step


def _incomplete(store: CheckpointStore) -> list[tuple[int, list[str]]]:
    """Step directories lacking a slot's file (or side file), oldest first, with the missing file names."""
    if not store.dir.is_dir():
        return []
    out = []
    for d in store.dir.iterdir():
        match = _STEP_DIR.match(d.name)
        if not match or not d.is_dir():
            continue
        missing = [name for slot in range(store.num_shards)
                   for name in (f"shard_{slot}.safetensors", f"shard_{slot}.json") if not (d / name).exists()]
        if missing:
            out.append((int(match.group(1)), missing))
    return sorted(out)


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} ... ({len(names)} files)"


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


def read_slices(store: CheckpointStore, step: int,
                dims: ParallelDims) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """The model parameters of every TP/PP slice of checkpoint `step`, by `(tp_rank, pp_rank)` and megatron's names:
    the file of each slice's shard 0 (slot `(pp_rank * tp + tp_rank) * shard_size`). Raises CheckpointError for a
    file that does not verify, LayoutError for one whose meta names another slice, ValueError (`megatron_params`)
    for more than one model chunk."""
    slices = {}
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            slot = (pp_rank * dims.tp + tp_rank) * dims.shard_size
            tensors, meta = store.load_shard(step, slot)
            held = {key: meta.get(key, 0) for key in ("tp_rank", "pp_rank", "shard_index")}
            if held != {"tp_rank": tp_rank, "pp_rank": pp_rank, "shard_index": 0}:
                raise LayoutError(f"shard_{slot}.safetensors of step {step} holds "
                                  f"{', '.join(f'{k}={v}' for k, v in held.items())}; with parallel.tp={dims.tp}, "
                                  f"parallel.pp={dims.pp} and {dims.shard_size} data-parallel shard(s) per slice, "
                                  f"slot {slot} is tp_rank={tp_rank}, pp_rank={pp_rank}, shard_index=0")
            slices[tp_rank, pp_rank] = megatron_params(tensors)
    return slices


def merge_slices(slices: dict[tuple[int, int], dict[str, torch.Tensor]], m: ModelConfig, tp: int,
                 pp: int) -> dict[str, torch.Tensor]:
    """Megatron-core TP/PP slices (by `(tp_rank, pp_rank)`, each by megatron's names) -> the full model by the
    names of a TP = PP = 1 megatron GPTModel (see the module doc; the vocabulary keeps its TP padding). Raises
    ValueError naming what does not fit: a missing slice, an uneven pipeline split, a parameter on the wrong stage,
    TP ranks that disagree on names, or a replicated one whose values differ, a name with no known TP split."""
    missing = [(t, p) for p in range(pp) for t in range(tp) if (t, p) not in slices]
    if missing:
        raise ValueError(f"no parameters for (tp_rank, pp_rank) {missing}")
    if m.n_layers % pp:
        raise ValueError(f"{m.n_layers} layers do not split evenly over {pp} pipeline stages")
    per_stage = m.n_layers // pp
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        ranks = [slices[t, stage] for t in range(tp)]
        names = set(ranks[0])
        for t, rank in enumerate(ranks[1:], 1):
            if set(rank) != names:
                odd = sorted(names ^ set(rank))
                raise ValueError(f"TP ranks 0 and {t} of pipeline stage {stage} hold different parameters, e.g. "
                                 f"{odd[:3]}")
        local = {int(match.group(1)) for n in names if (match := _LAYER.match(n))}
        if pp > 1 and local != set(range(per_stage)):  # (PP = 1: hf_llama_params names a missing layer)
            raise ValueError(f"pipeline stage {stage} holds layers {sorted(local)}; an even split of {m.n_layers} "
                             f"layers over {pp} stages gives it {per_stage} (local 0 ... {per_stage - 1}): uneven "
                             "splits (num_layers_in_first/last_pipeline_stage, pipeline layouts) are not merged")
        for name in sorted(names):
            parts = [rank[name] for rank in ranks]
            match = _LAYER.match(name)
            if match:
                layer, rest = int(match.group(1)), match.group(2)
                target = f"decoder.layers.{stage * per_stage + layer}.{rest}"
            else:
                rest = target = name
                first, last = name.startswith("embedding."), name in ("decoder.final_layernorm.weight",
                                                                      "output_layer.weight")
                if (first and stage != 0) or (last and stage != pp - 1):
                    raise ValueError(f"{name} is on pipeline stage {stage} of {pp}; megatron puts it on the "
                                     f"{'first' if first else 'last'}")
                if name == "output_layer.weight" and m.tie_embeddings and pp > 1:
                    continue  # the last stage's copy of the (tied) embedding
            out[target] = _join(name, rest, parts, stage)
    return out


def _join(name: str, rest: str, parts: list[torch.Tensor], stage: int) -> torch.Tensor:
    """One parameter from its TP slices (`rest`: its name without the layer prefix)."""
    if len(parts) == 1:
        return parts[0]
    if rest in _COLUMN or name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return torch.cat(parts, dim=0)
    if rest in _GATED:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if rest in _ROW:
        return torch.cat(parts, dim=1)
    if rest.endswith(("layernorm.weight", "layer_norm_weight")):  # replicated over TP
        for t, other in enumerate(parts[1:], 1):
            if other.shape != parts[0].shape or not torch.allclose(other, parts[0], rtol=1e-3, atol=1e-6):
                raise ValueError(f"{name} (replicated over TP) differs between TP ranks 0 and {t} of pipeline "
                                 f"stage {stage}")
        return parts[0]
    raise ValueError(f"{name}: no known tensor-parallel split (a Llama's GPTModel has none such)")


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
    dims = cfg.dims()
    store = CheckpointStore(cfg.checkpoint.dir or run_dir / "checkpoints", dims.checkpoint_slots)
    asked = step
    step = _resolve_step(store, step, run_dir)
    try:
        merged = merge_slices(read_slices(store, step, dims), cfg.model, dims.tp, dims.pp)
        params = hf_llama_params(merged, cfg.model)
    except CheckpointError as e:  # only a step named by --step gets here unverified
        others = [s for s in store.steps() if s != step]
        raise ConfigError("--step" if asked is not None else "--run-dir", step if asked is not None else run_dir,
                          f"the checkpoint of step {step} does not verify ({e})",
                          f"pick another step ({_listing(others)})" if others else "train again with "
                          "checkpoint.every_n_steps=N") from e
    except LayoutError as e:
        raise ConfigError("--run-dir", run_dir, f"its checkpoint does not match its config's layout ({e})",
                          "export the run.dir whose config.yaml wrote this checkpoint") from e
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
