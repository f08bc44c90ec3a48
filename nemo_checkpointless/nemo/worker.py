"""A rank (or hot spare) of an `engine=nemo` job: `python -m nemo_checkpointless.nemo.worker`, started by the
launcher (`checkpointless-train recipe=tiny_llama_nemo ...`).

It trains the recipe's Llama with NeMo 2 (`llm.GPTModel`, `nl.Trainer`, `CheckpointlessMegatronStrategy`:
Megatron's distributed optimizer with `replication.num_instances` instances) on our token data
(`nemo.data.PlannedDataModule`), and recovers in process (`nemo.restart`):

- every generation's `fit` runs on a default group made from the launcher's store (prefix `nemo/gen<g>/`) whose
  collective timeout is `launcher.collective_timeout_s`;
- a failure makes every survivor leave `fit` in its own process (`FaultWatch` ends the collectives stuck on gloo
  as soon as the launcher declares it). A survivor whose collective timed out with no failure declared reports a
  hang, and the launcher's watchdog finds the hung rank and kills it. The survivor then runs
  `RecoveryEngine.recover` (sending its state if it is a replacement's source) and enters `fit` again with its
  own boundary state, kept in memory;
- a hot spare handed a rank runs `RecoveryEngine.join` and enters `fit` with the state it received p2p;
- when no live replica can help, every rank enters `fit` again from the newest persistent checkpoint
  (`checkpoint.every_n_steps`; without one, the seeded initial state). `launcher.on_failure=restart_all` starts
  every rank from it.

Rank 0 writes RUN_DIR/worker_summary.json: the final step, `state_sha256` (every rank's parameters and optimizer
shard, in rank order: equal runs give equal hashes for the same layout) and `data_sha256` (the global batches,
defined as on the Lightning path, so the two engines agree on it for the same data settings). Each rank publishes
the hash of what it trained on at every step under `data/<step>/<rank>` in the launcher's store.

Modules in `launcher.preload` are imported first (and their `install()` called, if they have one), before NeMo or
megatron-core: on a CPU machine, the test suite's CPU shim (`PYTHONPATH=tests`, `launcher.preload=[nemo_shim]`).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nemo_checkpointless.config import Config, load_run_config
from nemo_checkpointless.protocol import (
    TRAIN_START_KEY,
    mark_process_training,
    spare_ready_key,
    wait_for_assignment,
)
from nemo_checkpointless.restart.faults import InjectedFault, fire_faults
from nemo_checkpointless.restart.groups import (
    Membership,
    PeerFailure,
    alive_key,
    connect_store,
    fault_generation,
    hang_key,
)
from nemo_checkpointless.restart.recovery import RecoveryEngine, RecoveryStamps, RestartFromCheckpoint
from nemo_checkpointless.restart.template import warm_up_at_idle_priority
from nemo_checkpointless.restart.worker_env import ENV_PREFIX, SPARE_ID_ENV, preload, run_worker
from nemo_checkpointless.state.checkpoint import CheckpointStore
from nemo_checkpointless.state.hashing import DataDigest, state_digest

WORKER_SUMMARY = "worker_summary.json"
State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def data_key(step: int, rank: int) -> str:
    return f"data/{step}/{rank}"


# ------------------------------------------------------------------------------------------------- building
def build_model(cfg: Config) -> Any:
    """The recipe's Llama as NeMo's `llm.GPTModel`, with Megatron's distributed optimizer (AdamW, warm-up then
    cosine to `optim.min_lr`) and our recording data step. On CPU: fp32, no fusions, megatron's local layer spec."""
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.llama import Llama3Config
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    from nemo_checkpointless.nemo.data import recording_data_step

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
        fp16=False, data_step_fn=recording_data_step, **options)
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


def build_data(cfg: Config, tokens: Any, store: dist.Store, rank: int, run_dir: Path, store_port: int) -> Any:
    """Our token data as NeMo's data module; with `data.loader=mmap` through the job's shared-memory cache."""
    from nemo_checkpointless.data.job import job_loader
    from nemo_checkpointless.nemo.data import PlannedDataModule

    dims = cfg.dims()

    def loader(dataset: Any, plan: Any, end_step: int) -> Any:
        return job_loader(cfg, store, rank=rank, dims=dims, run_dir=str(run_dir), store_port=store_port,
                          dataset=dataset, plan=plan, end_step=end_step, name=f"[rank {rank}]")

    return PlannedDataModule(tokens, seq_len=cfg.data.seq_len, micro_batch_size=cfg.data.micro_batch_size,
                             dp_size=dims.dp, global_batch_size=global_batch_size(cfg), seed=cfg.seed,
                             shuffle=cfg.data.shuffle, max_steps=cfg.trainer.max_steps,
                             attention_mask=cfg.trainer.accelerator == "cpu",
                             loader=loader if cfg.data.loader == "mmap" else None)


def global_batch_size(cfg: Config) -> int:
    """Megatron's: micro-batch x data-parallel size (context-parallel ranks share a micro-batch) x accumulation."""
    return cfg.data.micro_batch_size * cfg.dims().dp * cfg.trainer.accumulate_grad_batches


# ------------------------------------------------------------------------------------------- the callback
class _StepHooks:
    """Per step: fault injection, the data record, recovery timing stamps; at the end: the digests. Built as a
    Lightning callback by `_callback()` (so this module imports without Lightning being loaded first)."""

    def __init__(self, cfg: Config, rank: int, world: int, run_dir: Path, engine: RecoveryEngine,
                 stamps: RecoveryStamps) -> None:
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, run_dir
        self.engine, self.stamps = engine, stamps
        self.reentry: dict[str, float] = {}  # times of the phases of re-entering `fit` after a recovery

    @property
    def store(self) -> dist.Store:
        return self.engine.store

    def batch_start(self, step: int) -> None:
        """`step` is 1-based, as `fault.plan` counts."""
        if mark_process_training(self.store) and self.rank == 0 and not self.store.check([TRAIN_START_KEY]):
            self.store.set(TRAIN_START_KEY, json.dumps(time.time()))

        def corrupt() -> None:
            self.engine.corrupt_next_send = True

        fire_faults(self.cfg.fault.plan, self.rank, step, self.store, corrupt)

    def batch_end(self, completed_steps: int) -> None:
        from nemo_checkpointless.nemo.data import take_step_digest

        if self.reentry:  # the first step after a recovery: where the time to re-enter `fit` went
            t = self.reentry
            print(f"[rank {self.rank}] back in fit: model + trainer {t['built'] - t['recovered']:.2f} s, fit "
                  f"set-up {t['train_start'] - t['built']:.2f} s (of which groups {t.get('groups', 0.0):.2f} s), "
                  f"first step {time.time() - t['train_start']:.2f} s", flush=True)
            self.reentry = {}

        digest = take_step_digest()
        if digest is not None:
            self.store.set(data_key(completed_steps, self.rank), digest.hex())
        self.stamps.stamp(completed_steps)

    def train_end(self, strategy: Any, completed_steps: int) -> None:
        part = strategy.participant
        part.at_step_boundary(completed_steps)
        tensors, _ = part.boundary_state()
        params = state_digest({k: v for k, v in tensors.items() if k.startswith("model.")}, {})
        shard = state_digest({k: v for k, v in tensors.items() if k.startswith("opt")}, {})
        self.store.set(f"final/{completed_steps}/{self.rank}", f"{params}:{shard}")
        record = {"rank": self.rank, "pid": os.getpid(), "step": completed_steps, "params_sha256": params,
                  "shard_sha256": shard,
                  "rng_sha256": state_digest({k: v for k, v in tensors.items() if k.startswith("rng.")}, {})}
        (self.run_dir / f"nemo_rank{self.rank}.json").write_text(json.dumps(record, indent=1))
        if self.rank != 0:
            return
        wait = datetime.timedelta(seconds=self.cfg.launcher.collective_timeout_s + 60)
        finals = [f"final/{completed_steps}/{r}" for r in range(self.world)]
        steps = [data_key(s, r) for s in range(1, completed_steps + 1) for r in range(self.world)]
        self.store.wait(finals + steps, wait)
        state = hashlib.sha256("|".join(self.store.get(k).decode() for k in finals).encode()).hexdigest()
        data = DataDigest()
        for s in range(1, completed_steps + 1):
            data.update([bytes.fromhex(self.store.get(data_key(s, r)).decode()) for r in range(self.world)])
        summary = {"final_step": completed_steps, "state_sha256": state, "data_sha256": data.hexdigest,
                   "data_steps": data.steps, "train_end_t": time.time()}
        tmp = self.run_dir / f".{WORKER_SUMMARY}.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.run_dir / WORKER_SUMMARY)


_HOOKS: list[_StepHooks] = []  # NeMo deep-copies callbacks for its io config: the hooks (a store) live here


def _callback() -> Any:
    import lightning.pytorch as pl

    class StepHooks(pl.Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if torch.cuda.device_count() == 0:
                # NeMo seeds Megatron's model-parallel RNG tracker only when it sees a GPU (megatron_init).
                from megatron.core import tensor_parallel

                tensor_parallel.model_parallel_cuda_manual_seed(_HOOKS[0].cfg.seed)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            hooks = _HOOKS[0]
            if hooks.reentry:
                hooks.reentry["train_start"] = time.time()
                hooks.reentry["groups"] = getattr(trainer.strategy, "groups_s", 0.0)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            _HOOKS[0].batch_start(trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            _HOOKS[0].batch_end(trainer.global_step)
            loader = getattr(trainer.datamodule, "loader", None)
            first = getattr(loader, "first_batch", None)
            if first and first["step"] and not first.get("reported"):
                first["reported"] = True
                print(f"[rank {_HOOKS[0].rank}] data: first batch at step {first['step']} from the "
                      f"{first['source']} in {1e3 * first['s']:.2f} ms", flush=True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _HOOKS[0].train_end(trainer.strategy, trainer.global_step)

    return StepHooks()


# ------------------------------------------------------------------------------------------------ the rank
def warm_up(cfg: Config) -> None:
    """What a hot spare does before it says it is ready, so that its first step after a join costs what a
    survivor's does. Measured here (kill at step 20 of 30): without it `recover_s` was ~6.8 s, of which ~2.2 s went
    to the first build of NeMo's model and trainer (lazy imports) and ~2.4 s to compiling megatron's fused
    functions (`torch.compile`) in the first forward.

    1. Build what a rank builds before `fit` (model module, strategy, trainer) and drop it.
    2. On a private one-rank process group (never the job's), build the model and run one forward and backward on
       a dummy micro-batch of the job's shape, the backward through megatron's own `custom_backward` (as its
       schedule does: `torch.autograd.backward` would run it under another torch-function mode stack, and dynamo
       would compile again). Then destroy the group and megatron's state. Nothing is kept: the model is rebuilt,
       and params, optimizer state and RNG arrive from the replica. A failure here costs only the speed-up."""
    from nemo import lightning as nl

    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

    module = build_model(cfg)  # the Lightning module only: megatron's model is configured in `fit`
    strategy = CheckpointlessMegatronStrategy(num_instances=cfg.replication.num_instances,
                                              global_batch_size=global_batch_size(cfg), ckpt_async_save=False)
    nl.Trainer(accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
               max_steps=cfg.trainer.max_steps, strategy=strategy, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, callbacks=[_callback()])
    try:
        _warm_up_kernels(cfg, module)
    except Exception as e:  # never fatal: the first real step compiles instead
        print(f"spare warm-up: forward/backward failed ({type(e).__name__}: {e}); the first step after a join "
              "will compile", flush=True)


def _warm_up_kernels(cfg: Config, module: Any) -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel.schedules import custom_backward

    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        module.configure_model()
        mb, seq = cfg.data.micro_batch_size, cfg.data.seq_len
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        tokens = torch.zeros(mb, seq, dtype=torch.int64, device=device)
        positions = torch.arange(seq, device=device).unsqueeze(0).expand(mb, -1)
        mask = torch.ones(seq, seq, device=device).tril().view(1, 1, seq, seq) < 0.5
        loss = module.module(input_ids=tokens, position_ids=positions, attention_mask=mask, labels=tokens)
        custom_backward(loss.float().sum(), None)
    finally:
        from nemo_checkpointless.nemo.restart import drop_megatron_groups

        drop_megatron_groups()
        dist.destroy_process_group()


def _wait_for_fault(store: dist.Store, generation: int, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if fault_generation(store) >= generation:
            return True
        time.sleep(0.01)
    return False


def _timed_out(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def _checkpoint_state(engine: RecoveryEngine, step: int) -> State | None:
    from nemo_checkpointless.nemo.restart import ReceivedState

    received = ReceivedState()
    engine.load_checkpoint(received, step)
    return received.state


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
    cfg, tokens = _prepare(Path(os.environ[f"{ENV_PREFIX}RUN_DIR"]))
    warm_up(cfg)
    from tqdm import tqdm

    if getattr(tqdm, "monitor", None) is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None
    _freeze_heap()  # the warm-up's model and groups sit in reference cycles; their threads end when they go
    return lambda: run((cfg, tokens, True))


def _freeze_heap() -> None:
    """Collect, then keep what exists now (the imports, mostly) out of every later collection: the collection
    after a recovery then scans only what was made since (measured: 0.02-0.2 s instead of 1.0 s for the whole heap),
    and a spare forked from the template does not copy the template's pages by touching their objects."""
    gc.collect()
    gc.freeze()


def run(prepared: tuple[Config, Any, bool] | None = None) -> None:
    environ = os.environ
    host, port = environ[f"{ENV_PREFIX}STORE_HOST"], int(environ[f"{ENV_PREFIX}STORE_PORT"])
    run_dir = Path(environ[f"{ENV_PREFIX}RUN_DIR"])
    if prepared is None:
        cfg, tokens, warm = (*_prepare(run_dir), False)
        _freeze_heap()
    else:  # a spare forked from the template, which froze its heap before forking
        cfg, tokens, warm = prepared
    from nemo import lightning as nl

    from nemo_checkpointless.nemo.data import clear_recorded
    from nemo_checkpointless.nemo.restart import (
        FaultWatch,
        ReceivedState,
        abandon_default_group,
        own_boundary_state,
        release_fit,
    )
    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

    store = connect_store(host, port, cfg.launcher.start_timeout_s)
    world = cfg.trainer.world_size
    join_generation = restart_generation = 0
    if SPARE_ID_ENV in environ:
        spare_id = int(environ[SPARE_ID_ENV])
        if not warm:
            # A refill warms up at idle CPU priority (the preload again: the shim's mode is per thread).
            def preload_and_warm_up() -> None:
                preload(cfg)
                warm_up(cfg)

            warm_up_at_idle_priority(preload_and_warm_up)
        store.set(spare_ready_key(spare_id), "1")
        assignment = wait_for_assignment(store, spare_id)
        rank, join_generation = assignment.rank, assignment.generation
    else:
        rank = int(environ["RANK"])
        join_generation = int(environ.get(f"{ENV_PREFIX}JOIN_GENERATION", "0"))
        restart_generation = int(environ.get(f"{ENV_PREFIX}RESTART_GENERATION", "0"))
    local = rank % cfg.trainer.devices
    environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                   NODE_RANK=str(rank // cfg.trainer.devices))
    dims = cfg.dims()
    timeout = cfg.launcher.collective_timeout_s
    # The engine's collectives wait out a survivor still stuck in a NeMo collective until its timeout.
    membership = Membership(store, rank, world, host, 2 * timeout + 60)
    ckpt_dir = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    checkpoints = CheckpointStore(ckpt_dir, dims.shard_size) if cfg.checkpoint.every_n_steps else None
    engine = RecoveryEngine(membership, dims, checkpoints, verify_checksum=cfg.replication.checksum)
    stamps = RecoveryStamps(store, rank)
    hooks = _StepHooks(cfg, rank, world, run_dir, engine, stamps)
    _HOOKS.append(hooks)
    resume: State | None = None
    if join_generation:
        membership.generation = join_generation - 1
        received = ReceivedState()
        decision = engine.join(received, join_generation)
        resume = received.state
        stamps.track(membership.generation)
        hooks.reentry = {"recovered": time.time()}
        source = (f"a replica (p2p, {engine.bytes_received} bytes)" if decision.path == "p2p" else
                  "the checkpoint" if decision.step else "the seeded initial state")
        print(f"[rank {rank}] joined generation {membership.generation}: state of step {decision.step} from {source}",
              flush=True)
    elif restart_generation:  # launcher.on_failure=restart_all: every rank starts from the newest checkpoint
        membership.generation = restart_generation
        step = checkpoints.latest(cfg.trainer.max_steps) if checkpoints is not None else 0
        resume = _checkpoint_state(engine, step)
        stamps.track(restart_generation)
    while True:
        generation = membership.generation
        model, data = build_model(cfg), build_data(cfg, tokens, store, rank, run_dir, port)
        strategy = CheckpointlessMegatronStrategy(
            num_instances=cfg.replication.num_instances, global_batch_size=global_batch_size(cfg),
            tensor_model_parallel_size=cfg.parallel.tp, pipeline_model_parallel_size=cfg.parallel.pp,
            context_parallel_size=cfg.parallel.cp, sequence_parallel=cfg.parallel.sequence_parallel and
            cfg.parallel.tp > 1, ckpt_async_save=False, pg_timeout_s=timeout)
        strategy.use_generation(dist.PrefixStore(f"nemo/gen{generation}/", store), resume)
        strategy.use_checkpoints(checkpoints, cfg.checkpoint.every_n_steps)
        resume = None
        plugins = [nl.MegatronMixedPrecision(precision="bf16-mixed")] if cfg.trainer.precision == "bf16-mixed" else []
        trainer = nl.Trainer(accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices,
                             num_nodes=cfg.trainer.num_nodes, max_steps=cfg.trainer.max_steps, strategy=strategy,
                             plugins=plugins, logger=False, enable_checkpointing=False, limit_val_batches=0,
                             num_sanity_val_steps=0, enable_progress_bar=False, callbacks=[_callback()],
                             log_every_n_steps=cfg.trainer.log_every_n_steps)
        if hooks.reentry:
            hooks.reentry["built"] = time.time()
        watch = FaultWatch(store, generation, keep_ports={port})
        try:
            with watch:
                trainer.fit(model, datamodule=data)
            data.close()
            return
        except InjectedFault:
            raise
        except Exception as e:  # a peer failed (a gloo error, or the timeout of a collective it never joined)
            clear_recorded()
            data.close()  # stops its prefetch thread; the next fit's module adopts what the cache holds
            if fault_generation(store) < generation:
                # Nobody has died (yet): check in, and if a collective timed out, ask the launcher to find a hang.
                store.set(alive_key(generation, rank), json.dumps(time.time()))
                if _timed_out(e):
                    store.set(hang_key(generation), json.dumps({"rank": rank, "t": time.time()}))
            if not _wait_for_fault(store, generation, patience_s=2 * timeout + 10):
                raise
            t = time.time()
            part = strategy.participant
            if part is None:  # failed before the model existed: nothing of this fit to keep
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if watch.fired_t is not None:
                why += f" (fault watch closed {watch.closed} sockets)"
            print(f"[rank {rank}] left fit at step {part.completed_steps}: {why}", flush=True)
            resume = own_boundary_state(part)
            try:
                decision = engine.recover(part, PeerFailure(f"{type(e).__name__} in NeMo's fit"))
                how = f"p2p at step {decision.step}"
            except RestartFromCheckpoint as restart:
                resume = _checkpoint_state(engine, restart.decision.step)
                how = f"from the checkpoint of step {restart.decision.step} ({restart.decision.reason})"
            release_fit(strategy.model, strategy.optimizers)  # else that fit's model and groups are never freed
            del part, strategy, trainer, model, data
        # Here after a recovery only (a fit that returns ends the loop), and after the handler, so that the
        # exception's traceback (the failed fit's frames) is gone. That fit's objects sit in reference cycles
        # (Lightning's, NeMo's): collect them now, with their handles to the groups, rather than whenever the
        # collector's oldest generation next runs (a full collection here: the heap of the imports is frozen).
        t_gc = time.perf_counter()
        gc.collect()
        gc_s = time.perf_counter() - t_gc
        abandoned = abandon_default_group()
        stamps.track(membership.generation)
        hooks.reentry = {"recovered": time.time()}
        print(f"[rank {rank}] recovered {how} in {time.time() - t:.2f} s (generation {membership.generation}, "
              f"{abandoned} old groups abandoned, {gc_s:.2f} s to free the last fit); entering fit again", flush=True)


def main() -> NoReturn:
    warnings.filterwarnings("ignore")
    run_worker(run)


if __name__ == "__main__":
    main()
