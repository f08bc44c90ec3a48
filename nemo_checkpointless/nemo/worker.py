"""A rank (or hot spare) of an `engine=nemo` job: `python -m nemo_checkpointless.nemo.worker`, started by the
launcher (`checkpointless-train recipe=tiny_llama_nemo ...`).

It is written as a NeMo user's script would be, on the package's public pieces: the recipe's Llama as NeMo 2's
`llm.GPTModel`, `nl.Trainer` with `CheckpointlessMegatronStrategy` (Megatron's distributed optimizer with
`replication.num_instances` instances) and `CheckpointlessCallback`, and our token data as a NeMo data module
(`nemo.data.PlannedDataModule`; with `data.loader=mmap` through the job's shared-memory cache). `trainer.fit` is
called once: the strategy's launcher recovers in process and enters `fit` again after a failure (`nemo.restart`),
and a hot spare waits inside `fit` for the rank it replaces. `launcher.on_failure=restart_all` starts every rank
from the newest persistent checkpoint.

What only this worker does: the config (`run.dir/config.yaml`), `launcher.preload` (imported first, and its
`install()` called, before NeMo or megatron-core: on a CPU machine, the test suite's CPU shim, `PYTHONPATH=tests`,
`launcher.preload=[nemo_shim]`) and the hot spare's warm-up (`warm_up`, and `spare_template` for the launcher's
forked spares).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from nemo_checkpointless.config import Config, load_run_config
from nemo_checkpointless.restart.template import warm_up_again_on_this_thread, warm_up_at_idle_priority
from nemo_checkpointless.restart.worker_env import ENV_PREFIX, SPARE_ID_ENV, freeze_heap, preload, run_worker


# ------------------------------------------------------------------------------------------------- building
def build_model(cfg: Config) -> Any:
    """The recipe's Llama as NeMo's `llm.GPTModel`, with Megatron's distributed optimizer (AdamW, warm-up then
    cosine to `optim.min_lr`). On CPU: fp32, no fusions, megatron's local layer spec."""
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.llama import Llama3Config
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    m, o, cpu = cfg.model, cfg.optim, cfg.trainer.accelerator == "cpu"
    bf16 = cfg.trainer.precision == "bf16-mixed"
    options: dict[str, Any] = {}
    if cpu:
        from nemo.collections.llm.gpt.model.base import local_layer_spec

        options = dict(use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                       persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                       bias_activation_fusion=False, transformer_layer_spec=local_layer_spec)
    # Megatron DDP does not broadcast the initial parameters: every rank must build the same ones.
    torch.manual_seed(cfg.seed)
    if m.rope_scale_factor:  # Llama 3.1 / 3.2: RoPE frequencies scaled beyond the original 8K context
        from nemo.collections.llm.gpt.model.llama import Llama31Config

        options.update(scale_factor=m.rope_scale_factor, old_context_len=8192)
        make: Any = Llama31Config
    else:
        make = Llama3Config
    config = make(
        num_layers=m.n_layers, hidden_size=m.d_model, ffn_hidden_size=m.ffn_hidden, num_attention_heads=m.n_heads,
        num_query_groups=m.n_kv_heads, seq_length=cfg.data.seq_len, rotary_base=int(m.rope_theta),
        layernorm_epsilon=m.norm_eps, share_embeddings_and_output_weights=m.tie_embeddings,
        init_method_std=m.init_std, hidden_dropout=m.dropout, attention_dropout=m.dropout,
        make_vocab_size_divisible_by=128, params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16,
        fp16=False, **options)
    optim = nl.MegatronOptimizerModule(
        config=OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                               adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.grad_clip,
                               use_distributed_optimizer=True, bf16=bf16, fp16=False,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32),
        lr_scheduler=CosineAnnealingScheduler(max_steps=cfg.trainer.max_steps, warmup_steps=o.warmup_steps,
                                              constant_steps=0, min_lr=o.min_lr))
    return llm.GPTModel(config, tokenizer=_Vocabulary(m.vocab_size), optim=optim)


class _Vocabulary:
    """What `llm.GPTModel` reads of a tokenizer when it is given token ids: the vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


def build_data(cfg: Config, tokens: Any, run_dir: Path, store_port: int) -> Any:
    """Our token data as NeMo's data module; with `data.loader=mmap` through the job's shared-memory cache (the
    loader is built when `fit` sets the module up: a spare learns its rank there)."""
    from nemo_checkpointless.data.job import job_loader
    from nemo_checkpointless.nemo.data import PlannedDataModule

    dims = cfg.dims()

    def loader(session: Any, dataset: Any, plan: Any, end_step: int) -> Any:
        rank = session.env.rank
        return job_loader(cfg, session.store, rank=rank, dims=dims, run_dir=str(run_dir), store_port=store_port,
                          dataset=dataset, plan=plan, end_step=end_step)

    return PlannedDataModule(tokens, seq_len=cfg.data.seq_len, micro_batch_size=cfg.data.micro_batch_size,
                             dp_size=dims.dp, global_batch_size=global_batch_size(cfg), seed=cfg.seed,
                             shuffle=cfg.data.shuffle, max_steps=cfg.trainer.max_steps,
                             attention_mask=cfg.trainer.accelerator == "cpu",
                             loader=loader if cfg.data.loader == "mmap" else None)


def global_batch_size(cfg: Config) -> int:
    """Megatron's: micro-batch x data-parallel size (context-parallel ranks share a micro-batch) x accumulation."""
    return cfg.data.micro_batch_size * cfg.dims().dp * cfg.trainer.accumulate_grad_batches


def build_strategy(cfg: Config, run_dir: Path) -> Any:
    import torch

    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

    # Megatron's pipeline sends activations in this dtype (it refuses pp > 1 without one).
    pipeline_dtype = (torch.bfloat16 if cfg.trainer.precision == "bf16-mixed" else torch.float32) \
        if cfg.parallel.pp > 1 else None
    return CheckpointlessMegatronStrategy(
        num_instances=cfg.replication.num_instances, global_batch_size=global_batch_size(cfg),
        pipeline_dtype=pipeline_dtype,
        tensor_model_parallel_size=cfg.parallel.tp, pipeline_model_parallel_size=cfg.parallel.pp,
        context_parallel_size=cfg.parallel.cp, sequence_parallel=cfg.parallel.sequence_parallel and
        cfg.parallel.tp > 1, ckpt_async_save=False, pg_timeout_s=cfg.launcher.collective_timeout_s,
        checkpoint_every_n_steps=cfg.checkpoint.every_n_steps,
        checkpoint_dir=cfg.checkpoint.dir or str(run_dir / "checkpoints"), verify_checksum=cfg.replication.checksum)


def build_trainer(cfg: Config, run_dir: Path, strategy: Any) -> Any:
    from nemo import lightning as nl

    from nemo_checkpointless.nemo.callback import CheckpointlessCallback

    plugins = [nl.MegatronMixedPrecision(precision="bf16-mixed")] if cfg.trainer.precision == "bf16-mixed" else []
    callback = CheckpointlessCallback(run_dir=run_dir, fault_plan=cfg.fault.plan,
                                      summary_timeout_s=cfg.launcher.collective_timeout_s + 60)
    return nl.Trainer(accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
                      num_nodes=cfg.trainer.num_nodes, max_steps=cfg.trainer.max_steps, strategy=strategy,
                      plugins=plugins, logger=False, enable_checkpointing=False, limit_val_batches=0,
                      num_sanity_val_steps=0, enable_progress_bar=False, callbacks=[callback],
                      log_every_n_steps=cfg.trainer.log_every_n_steps)


# ------------------------------------------------------------------------------------------------ the rank
def warm_up(cfg: Config, run_dir: Path, again: bool = False) -> None:
    """What a hot spare does before it says it is ready, so that its first step after a join costs what a
    survivor's does. Measured here (kill at step 20 of 30): without it `recover_s` was ~6.8 s, of which ~2.2 s went
    to the first build of NeMo's model and trainer (lazy imports) and ~2.4 s to compiling megatron's fused
    functions (`torch.compile`) in the first forward.

    1. Build what a rank builds before `fit` (model module, strategy, trainer) and drop it.
    2. On a private one-rank process group (never the job's), build the model and run one forward and backward on
       a dummy micro-batch of the job's shape, the backward through megatron's own `custom_backward` (as its
       schedule does: `torch.autograd.backward` would run it under another torch-function mode stack, and dynamo
       would compile again). Then destroy the group and megatron's state. Nothing is kept: the model is rebuilt,
       and params, optimizer state and RNG arrive from the replica. A failure here costs only the speed-up.

    `again`: in a spare forked from the template that already warmed up (see `run`)."""
    module = build_model(cfg)  # the Lightning module only: megatron's model is configured in `fit`
    strategy = build_strategy(cfg, run_dir)
    build_trainer(cfg, run_dir, strategy)
    from nemo_checkpointless.nemo.restart import warm_up_kernels

    # The layout as the strategy holds it, as a user script's spare reads it (`InProcessLauncher.launch`).
    warm_up_kernels(module, cfg.data.micro_batch_size, cfg.data.seq_len, cfg.seed,
                    tp=int(strategy.tensor_model_parallel_size or 1),
                    sequence_parallel=bool(strategy.sequence_parallel), again=again)


def _prepare(run_dir: Path) -> tuple[Config, Any]:
    """The config and the tokens; the preload, then NeMo and megatron-core (a spare is warm once these are done)."""
    cfg = load_run_config(run_dir)
    torch.set_num_threads(cfg.launcher.threads_per_rank)
    preload(cfg)
    from nemo import lightning as nl  # noqa: F401  (the import is the warm-up)

    from nemo_checkpointless.data.indexed import IndexedTokens

    assert cfg.data.path is not None, "the launcher resolves data.path before starting workers"
    return cfg, IndexedTokens(cfg.data.path).tokens


def spare_template() -> Callable[[], None]:
    """For `restart.template`: the imports and `warm_up` (~9 s and ~5 s of CPU here), once; each spare forked from
    here runs the returned function. The warm-up's threads are ended first, for the fork: its private groups are
    destroyed (`warm_up` drops megatron's handles) and tqdm's monitor thread is stopped (tqdm starts another when
    it needs one)."""
    run_dir = Path(os.environ[f"{ENV_PREFIX}RUN_DIR"])
    cfg, tokens = _prepare(run_dir)
    warm_up(cfg, run_dir)
    from tqdm import tqdm

    if getattr(tqdm, "monitor", None) is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None
    freeze_heap()  # the warm-up's model and groups sit in reference cycles; their threads end when they go
    return lambda: run((cfg, tokens, True))


def run(prepared: tuple[Config, Any, bool] | None = None) -> None:
    """One rank (or spare) of the job: `trainer.fit` once; the strategy's launcher does the rest."""
    environ = os.environ
    run_dir = Path(environ[f"{ENV_PREFIX}RUN_DIR"])
    cfg, tokens, warm = (*_prepare(run_dir), False) if prepared is None else prepared
    if SPARE_ID_ENV in environ and warm:
        # Forked from the warm template: the warm-up once more, in this process, on the thread that will train. The
        # memory its allocator hands out is the template's pages until written, and a replacement's first step
        # copied them (copy-on-write faults: its forward took 0.11-0.13 s against 0.06 s in steady state, every
        # survivor waiting for it); written here, while the spare waits for a rank, they are its own. 0.4-0.6 s of
        # CPU per spare (docs/design.md).
        warm_up_again_on_this_thread(lambda: warm_up(cfg, run_dir, again=True))
    elif SPARE_ID_ENV in environ:
        # A refill warms up at idle CPU priority (the preload again: the shim's mode is per thread).
        def preload_and_warm_up() -> None:
            preload(cfg)
            warm_up(cfg, run_dir)

        warm_up_at_idle_priority(preload_and_warm_up)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    data = build_data(cfg, tokens, run_dir, int(environ[f"{ENV_PREFIX}STORE_PORT"]))
    trainer = build_trainer(cfg, run_dir, build_strategy(cfg, run_dir))
    trainer.fit(model, datamodule=data)


def main() -> NoReturn:
    # What megatron-core and torch say on every CPU machine (no GPU unified memory, no Transformer Engine or Apex,
    # NVML's old binding), once per process: noise to a user of this job. Anything else reaches the user.
    for message in (".*unified memory mempool.*", ".*Transformer Engine and Apex are not installed.*",
                    ".*pynvml package is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)
    run_worker(run)


if __name__ == "__main__":
    main()
