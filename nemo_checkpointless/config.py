"""Typed configuration: one dataclass per component, each validated in `__post_init__`.

The dataclasses are registered as Hydra structured configs (`register_configs`), so a misspelt key or a value of
the wrong type fails when the config is composed, before any process starts. Every check raises `ConfigError`
with the key as the user writes it on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_checkpointless.errors import ConfigError

FAULT_KINDS = ("kill", "exception", "corrupt", "hang", "spin", "stall", "gil", "grow", "bitflip", "segfault",
               "abort", "sigterm", "oom", "exit0", "slow", "nan", "nan_batch", "corrupt_restore")
BITFLIP_TARGETS = ("shard", "param")  # fault kind bitflip: the optimizer shard's first state tensor, or a parameter
# fault kind kill: at the step's start (no target), or `gather`: after the step's gradient all-reduce, as the rank
# enters its optimizer instance's parameter all-gather (its instance partners are left a step behind the others)
KILL_TARGETS = ("gather",)
FAULT_TARGETS = {"bitflip": BITFLIP_TARGETS, "kill": KILL_TARGETS}
NAN_POLICIES = ("stop", "skip")
ENGINES = ("lightning", "nemo")
PRECISIONS = ("32-true", "bf16-mixed")


def _positive(key: str, value: int | float, fix: str = "use a value >= 1") -> None:
    if value < 1:
        raise ConfigError(key, value, "must be >= 1", fix)


def _non_negative(key: str, value: int | float) -> None:
    if value < 0:
        raise ConfigError(key, value, "must be >= 0", "use 0 to disable, or a positive value")


@dataclass
class ModelConfig:
    """A Llama-class decoder (see `nemo_checkpointless.models.LlamaConfig`)."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Hidden and attention dropout (engine=nemo only; the plain-Lightning model has none).
    dropout: float = 0.0
    # Llama 3.1 / 3.2 RoPE frequency scaling factor (8 / 32; 0: none). engine=nemo only (NeMo's Llama31Config).
    rope_scale_factor: float = 0.0

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            _positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError("model.d_model", self.d_model,
                              f"must be an even multiple of model.n_heads={self.n_heads}",
                              "change model.d_model or model.n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads,
                              f"must divide model.n_heads={self.n_heads} (grouped-query attention)",
                              "choose a divisor of model.n_heads")
        if not 0 <= self.dropout < 1:
            raise ConfigError("model.dropout", self.dropout, "must lie in [0, 1)", "use e.g. 0.0 or 0.1")
        if self.rope_scale_factor < 0:
            raise ConfigError("model.rope_scale_factor", self.rope_scale_factor, "must be >= 0",
                              "use 0 (no scaling), 8 (Llama 3.1) or 32 (Llama 3.2)")

    def llama_config(self) -> Any:
        """The model's own frozen config (`models.LlamaConfig`; dropout and RoPE scaling belong to the NeMo engine)."""
        from nemo_checkpointless.models import LlamaConfig

        return LlamaConfig(**{k: v for k, v in vars(self).items() if k not in ("dropout", "rope_scale_factor")})


@dataclass
class DataConfig:
    """Token data: `path` is a PREFIX of PREFIX.bin + PREFIX.idx; None means the embedded default corpus.

    `loader`: `mmap` (tier 2: a prefetch thread per batch group keeps the next `prefetch` batches and the last
    `lookback` ones in a private shared-memory cache under `cache_root`, default /dev/shm; a replacement rank reads
    the batch it must train on from there) or `plain` (a `DataLoader` that reads the dataset each step).
    `verify`: check before each step that the batch is the one the plan assigns to it (exactly once, no skip).
    `cache_dir` is where the embedded default corpus is built, not the batch cache.
    """

    path: str | None = None
    seq_len: int = 128
    micro_batch_size: int = 8
    shuffle: bool = True
    cache_dir: str | None = None
    default_corpus_bytes: int = 4_000_000
    loader: str = "mmap"
    prefetch: int = 16
    lookback: int = 4
    cache_root: str | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _positive("data.micro_batch_size", self.micro_batch_size)
        _positive("data.default_corpus_bytes", self.default_corpus_bytes)
        if self.loader not in ("mmap", "plain"):
            raise ConfigError("data.loader", self.loader, "must be mmap or plain",
                              "use mmap (shared-memory batch cache) or plain (read the dataset each step)")
        _non_negative("data.prefetch", self.prefetch)
        # Lightning fetches one batch ahead of the step it trains: the batch in flight is 1 behind the loader.
        _positive("data.lookback", self.lookback,
                  "use >= 1 so the batch in flight stays cached for a replacement (default 4)")
        if self.cache_root is not None and not self.cache_root.startswith("/"):
            raise ConfigError("data.cache_root", self.cache_root, "must be an absolute path",
                              "use e.g. /dev/shm, or leave it unset")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr`; `grad_clip` 0 disables clipping."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError("optim.lr", self.lr, "must be > 0", "use e.g. optim.lr=3e-4")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("optim.min_lr", self.min_lr, f"must lie in [0, optim.lr={self.lr}]", "lower it")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key}", getattr(self, key), "must lie in [0, 1)", "use e.g. 0.9")
        _non_negative("optim.weight_decay", self.weight_decay)
        _non_negative("optim.warmup_steps", self.warmup_steps)
        _non_negative("optim.grad_clip", self.grad_clip)


@dataclass
class TrainerConfig:
    """`devices` ranks per node (CPU processes on a CPU machine) x `num_nodes`."""

    devices: int = 4
    num_nodes: int = 1
    accelerator: str = "cpu"
    max_steps: int = 200
    log_every_n_steps: int = 10
    progress_bar: bool = True
    # Micro-batches per optimizer step: global batch = data.micro_batch_size x DP x accumulate_grad_batches.
    accumulate_grad_batches: int = 1
    # Lightning's names: 32-true (fp32 params, grads, Adam state) or bf16-mixed (Megatron: bf16 params,
    # fp32 main grads, fp32 master params + Adam state in the distributed optimizer).
    precision: str = "32-true"

    def __post_init__(self) -> None:
        _positive("trainer.devices", self.devices)
        _positive("trainer.num_nodes", self.num_nodes)
        _positive("trainer.max_steps", self.max_steps)
        _positive("trainer.log_every_n_steps", self.log_every_n_steps)
        _positive("trainer.accumulate_grad_batches", self.accumulate_grad_batches)
        if self.accelerator not in ("cpu", "gpu"):
            raise ConfigError("trainer.accelerator", self.accelerator, "must be cpu or gpu", "pick one of the two")
        if self.precision not in PRECISIONS:
            raise ConfigError("trainer.precision", self.precision, f"must be one of {', '.join(PRECISIONS)}",
                              "use 32-true on CPU, bf16-mixed for the NeMo recipes on GPUs")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


@dataclass
class ParallelConfig:
    """Model parallelism (Megatron names); the plain-Lightning path supports data parallelism only."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    # Megatron's sequence parallelism (shards norm/dropout activations over tp); only used when tp > 1.
    sequence_parallel: bool = False


@dataclass
class ReplicationConfig:
    """Tier 4: `num_instances` replicated copies of the sharded optimizer state (must divide the DP size)."""

    num_instances: int = 2
    spares: int = 0
    # Several nodes: whole nodes that hold only spares (`spare_nodes` x trainer.devices spare ranks), started as
    # agents with launcher.node_rank >= trainer.num_nodes; a lost node's ranks can move there together.
    spare_nodes: int = 0
    checksum: bool = True
    # No spare for a failed rank: go on with the whole optimizer instances (the same global batch, each of their
    # ranks also training a dropped rank's micro-batches), and grow back when spares are ready (topology.shrink).
    shrink: bool = False
    # With shrink: how long a fault waits for a spare that is still starting before the job shrinks (0: shrink at
    # once when no spare is ready).
    replacement_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("replication.num_instances", self.num_instances)
        if not isinstance(self.replacement_timeout_s, (int, float)) or self.replacement_timeout_s < 0:
            raise ConfigError("replication.replacement_timeout_s", self.replacement_timeout_s, "must be >= 0 seconds",
                              "use 0 (shrink at once when no spare is ready) or the seconds a starting spare may "
                              "take, e.g. 30")
        if self.shrink and self.num_instances == 1:
            raise ConfigError("replication.shrink", self.shrink,
                              "needs replication.num_instances >= 2: with one optimizer instance there is nothing "
                              "to shrink to", "set replication.num_instances=2, or replication.shrink=false")
        if self.spare_nodes < 0:
            raise ConfigError("replication.spare_nodes", self.spare_nodes, "must be >= 0", "use 0, 1, 2, ...")
        if self.spares < 0:
            raise ConfigError("replication.spares", self.spares, "must be >= 0", "use 0 for no hot spare, or 1, 2, ...")


@dataclass
class CheckpointConfig:
    """Persistent fallback checkpoint (`state.checkpoint.CheckpointStore`: safetensors files + JSON, no pickle),
    written by the first optimizer instance every `every_n_steps` steps (0: never; the fallback is then the seeded
    initial state); `dir` defaults to RUN_DIR/checkpoints."""

    every_n_steps: int = 0
    dir: str | None = None

    def __post_init__(self) -> None:
        _non_negative("checkpoint.every_n_steps", self.every_n_steps)


@dataclass
class FaultSpec:
    """One injected fault on `rank` when it starts step `step`: `kill` (SIGKILL), `exception` (raised in the step),
    `hang` (SIGSTOP: found by the collective timeout and the launcher's watchdog), `corrupt` (from then on, the
    next state this rank sends to a replacement has a flipped byte after its checksum was taken: the receiver must
    detect it and the job fall back to the checkpoint); `spin`, `stall`, `gil` (hangs of other kinds); `bitflip`
    (one bit of its optimizer shard flipped in memory); `segfault` (a segmentation fault in native code), `abort`
    (SIGABRT), `sigterm` (SIGTERM to itself), `oom` (runs out of memory under an address-space limit it sets),
    `exit0` (leaves with exit status 0 before its training ended: a fault, replaced like a crash); `slow` (from that
    step on, every step of the rank takes 0.2 s longer: a straggler, reported, never replaced); `nan` (one
    gradient element of the rank made NaN in that step, once: a transient fault), `nan_batch` (the same, every
    time the rank computes that step: a batch that gives NaN); `corrupt_restore` (the next state the rank restores,
    from a peer or the checkpoint, is damaged after its checksum passed; given twice, the next two); or `grow` (not
    a fault: a shrunk world grows back after that step, `replication.shrink`). `target`: for `bitflip`,
    `shard` (default: the rank's optimizer shard) or `param` (its copy of a parameter outside its shard); for `kill`,
    `gather` (killed after the step's gradient all-reduce, as it enters its instance's parameter all-gather)."""

    kind: str = "kill"
    rank: int = 0
    step: int = 1
    target: str = ""

    def as_dict(self) -> dict[str, Any]:
        """As the launcher passes it to the ranks (`NCL_FAULT_PLAN`): `target` only where one is given."""
        return {"kind": self.kind, "rank": self.rank, "step": self.step, **({"target": self.target} if self.target
                                                                             else {})}


@dataclass
class IntegrityConfig:
    """The cross-replica check (`restart.integrity`): every `every_n_steps` steps (0: never) and after every
    recovery, every copy of every optimizer shard and every rank's parameters are compared by digest; a copy in a
    minority is repaired p2p from the majority, copies with no majority (N = 2) roll the job back to the newest
    checkpoint at or before the last verified step. A rank found bad `fence_after` times is fenced and replaced."""

    every_n_steps: int = 50
    fence_after: int = 2
    # A non-finite gradient (`restart.integrity.NanGuard`) is attributed to the rank(s) it came from and the step
    # run again; if it comes back on the same batch: stop the job (naming the batch's samples), or skip the batch
    # (no update; the data moves on) with a record.
    nan_policy: str = "stop"

    def __post_init__(self) -> None:
        _non_negative("integrity.every_n_steps", self.every_n_steps)
        _positive("integrity.fence_after", self.fence_after)
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError("integrity.nan_policy", self.nan_policy, f"must be one of {', '.join(NAN_POLICIES)}",
                              "use stop (end the job, naming the batch) or skip (drop that batch, with a record)")


@dataclass
class FaultConfig:
    plan: list[FaultSpec] = field(default_factory=list)


@dataclass
class LauncherConfig:
    """Where the job's store and sockets bind (loopback on one machine) and how long a collective may block."""

    host: str = "127.0.0.1"
    collective_timeout_s: float = 30.0
    # The progress watchdog (launcher.watchdog): a rank whose progress beacon has not moved for this long, and that
    # is stopped, busy or idle behind the others, is declared hung and replaced. 0: max(5 s, 10 x p95 step time);
    # negative: off (the collective timeout alone finds hangs).
    hang_deadline_s: float = 0.0
    # The straggler report (launcher.stragglers): a rank whose own work per step (step start to gradient
    # reduction), median of its last `straggler_window` samples, is `straggler_factor` x the others' is reported
    # in the log and summary.json, never replaced. 0: off.
    straggler_factor: float = 1.5
    straggler_window: int = 20
    start_timeout_s: float = 300.0
    threads_per_rank: int = 1
    # Faults in a row whose recovery did not complete (complete: every rank finished a step after it). A job that
    # runs for weeks recovers any number of times; it stops only when recoveries keep failing.
    max_restarts: int = 10
    # recover: keep healthy ranks, replace the failed ones (this project). restart_all: kill every rank and
    # restart the whole job from the persistent checkpoint (what jobs do today; the benchmark's baseline).
    on_failure: str = "recover"
    # Python modules every rank and spare imports before anything else (a site patch, a profiler; for the NeMo
    # engine on CPU, the test suite's CPU shim: `PYTHONPATH=tests ... launcher.preload=[nemo_shim]`). Imported and
    # `install()`ed once, in the rank template the ranks are forked from, so module-level code sees no RANK.
    preload: list[str] = field(default_factory=list)
    # Several nodes: one agent (`checkpointless-run` / `checkpointless-train`) per node. `node_rank`: this node;
    # `rdzv_endpoint`: HOST:PORT of the job's store ("" on one node: the launcher hosts it on `host`);
    # `rdzv_backend`: who hosts that store (c10d: node 0's agent, as torchrun does, so losing node 0 ends the job;
    # external: a `checkpointless-store` that no training node runs); `local_addr`: this node's address for the
    # ranks' sockets ("": the address its route to the store leaves from); `node_lease_s`: an agent whose
    # heartbeat has not moved for this long is lost with its node, and its ranks are recovered elsewhere.
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    local_addr: str = ""
    node_lease_s: float = 2.0
    # Where checkpointless-train sends the job: local (this machine; with several nodes, the agent of
    # `node_rank`), k8s (writes a Kubeflow PyTorchJob manifest), slurm (writes an sbatch script).
    target: str = "local"
    # The ranks' DEBUG lines too (`restart.logs`: a re-entered fit's set-up times, where a replacement's first batch
    # came from); without it a rank says what a user must know: faults, recoveries, integrity verdicts, stops.
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.node_rank < 0:
            raise ConfigError("launcher.node_rank", self.node_rank, "must be >= 0", "use 0, 1, ... (one per node)")
        if self.rdzv_backend not in ("c10d", "external"):
            raise ConfigError("launcher.rdzv_backend", self.rdzv_backend, "must be c10d or external",
                              "use c10d (node 0's agent hosts the store) or external (a checkpointless-store)")
        if self.straggler_factor != 0 and not self.straggler_factor > 1:
            raise ConfigError("launcher.straggler_factor", self.straggler_factor, "must be > 1, or 0 (off)",
                              "use e.g. 1.5 (a rank 50 % slower than the others is reported)")
        if self.straggler_window < 2:
            raise ConfigError("launcher.straggler_window", self.straggler_window, "must be >= 2", "use e.g. 20")
        if not self.node_lease_s > 0:
            raise ConfigError("launcher.node_lease_s", self.node_lease_s, "must be > 0", "use e.g. 2")
        if self.target not in ("local", "k8s", "slurm"):
            raise ConfigError("launcher.target", self.target, "must be local, k8s or slurm",
                              "use local (this machine), k8s (a PyTorchJob manifest) or slurm (an sbatch script)")
        for i, name in enumerate(self.preload):
            if not all(part.isidentifier() for part in str(name).split(".")):
                raise ConfigError(f"launcher.preload[{i}]", name, "must be an importable module name",
                                  "use a dotted module name such as mypatch or site_pkg.patch (not a file path)")
        if not self.collective_timeout_s > 0:
            raise ConfigError("launcher.collective_timeout_s", self.collective_timeout_s, "must be > 0", "use e.g. 30")
        _positive("launcher.threads_per_rank", self.threads_per_rank)
        _non_negative("launcher.max_restarts", self.max_restarts)
        if self.on_failure not in ("recover", "restart_all"):
            raise ConfigError("launcher.on_failure", self.on_failure, "must be recover or restart_all",
                              "use recover (replace only failed ranks) or restart_all (the whole job)")


@dataclass
class RunConfig:
    dir: str = "runs/${recipe_name}"
    # Write RUN_DIR/timeline.png at the end: the steps over wall time, every fault and its recovery (matplotlib,
    # the [bench] extra).
    timeline: bool = False


@dataclass
class Config:
    """The whole job. `recipe_name` is set by the recipe file chosen with `recipe=NAME`."""

    recipe_name: str = "custom"
    # lightning: the built-in plain-Lightning path (CPU, data-parallel). nemo: NeMo 2 / megatron-core (TP, PP,
    # CP on GPUs; needs the [nemo] extra).
    engine: str = "lightning"
    seed: int = 1234
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    # A user's own training script to launch with the recipe's launch settings instead of the package's worker
    # (`checkpointless-train recipe=NAME script=train.py 'script_args=[--max-steps,8]'`): it gets the ranks, spares,
    # replication, layout, collective timeout, checkpoint cadence, fault plan, run dir and preload modules; it
    # builds its own model, data and optimizer, and runs its own number of steps.
    script: str | None = None
    script_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.script_args and self.script is None:
            raise ConfigError("script_args", "[" + ",".join(self.script_args) + "]",
                              "are the arguments of a script=PATH, and none is given",
                              "add script=path/to/train.py, or drop script_args")
        for i, arg in enumerate(self.script_args):
            if not isinstance(arg, str):
                raise ConfigError(f"script_args[{i}]", arg, "must be one argument (a string), not a list or a mapping",
                                  "quote it to pass it as written, e.g. 'script_args=[--layers,\"[1,2]\"]'")
        if self.run.timeline:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise ConfigError("run.timeline", True, "draws with matplotlib, which is not installed",
                                  "pip install '.[bench]' (or matplotlib), or drop run.timeline")
        if self.engine not in ENGINES:
            raise ConfigError("engine", self.engine, f"must be one of {', '.join(ENGINES)}",
                              "use lightning (plain PyTorch Lightning) or nemo (NeMo 2 / megatron-core)")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError("data.seq_len", self.data.seq_len,
                              f"must be <= model.max_seq_len={self.model.max_seq_len}",
                              "lower data.seq_len or raise model.max_seq_len")
        self.dims()
        self._check_model_split()
        if self.replication.shrink and self.engine != "lightning":
            raise ConfigError("replication.shrink", True, f"is built for engine=lightning; this recipe has "
                              f"engine={self.engine} (megatron's data-parallel groups do not shrink)",
                              "drop replication.shrink, or keep spares (replication.spares) for every fault")
        if self.replication.shrink and self.trainer.num_nodes > 1:
            raise ConfigError("replication.shrink", True,
                              f"runs on one node in this release; the job has trainer.num_nodes="
                              f"{self.trainer.num_nodes}", "drop replication.shrink, or keep spare nodes "
                              "(replication.spare_nodes)")
        world = self.trainer.world_size
        for i, spec in enumerate(self.fault.plan):
            if spec.kind not in FAULT_KINDS:
                raise ConfigError(f"fault.plan[{i}].kind", spec.kind, f"must be one of {', '.join(FAULT_KINDS)}",
                                  "fix the kind")
            if not 0 <= spec.rank < world:
                raise ConfigError(f"fault.plan[{i}].rank", spec.rank, f"must name a rank in 0..{world - 1}",
                                  f"the job has {world} ranks (trainer.devices x trainer.num_nodes)")
            targets = FAULT_TARGETS.get(spec.kind, ())
            if spec.target and spec.target not in targets:
                raise ConfigError(f"fault.plan[{i}].target", spec.target,
                                  f"must be one of {', '.join(targets)}" if targets else
                                  f"kind {spec.kind} takes none (bitflip: {', '.join(BITFLIP_TARGETS)}; kill: "
                                  f"{', '.join(KILL_TARGETS)})",
                                  "e.g. bitflip:1:9:param, kill:1:9:gather, or drop the target")
            # A user's script runs its own number of steps (trainer.max_steps is not passed to it).
            last = self.trainer.max_steps if self.script is None else None
            if not 1 <= spec.step <= (last or spec.step):
                raise ConfigError(f"fault.plan[{i}].step", spec.step,
                                  f"must be a step in 1..trainer.max_steps={last}" if last else "must be >= 1",
                                  "pick a step the run reaches")

    def dims(self) -> Any:
        """The parallel layout (`topology.ParallelDims`); validates divisibility rules, naming the cluster size."""
        import math

        from nemo_checkpointless.topology import ParallelDims

        t, p = self.trainer, self.parallel
        where = f"{t.num_nodes} node{'s' if t.num_nodes > 1 else ''} x {t.devices} devices"
        try:
            return ParallelDims(world_size=t.world_size, tp=p.tp, cp=p.cp, ep=p.ep, pp=p.pp,
                                num_instances=self.replication.num_instances, order=p.order)
        except ConfigError as e:
            if e.key == "world_size":
                model = p.tp * p.cp * p.pp
                step = model // math.gcd(model, t.devices)
                nodes = ", ".join(str(step * k) for k in (1, 2, 3))
                raise ConfigError("trainer.num_nodes", t.num_nodes,
                                  f"gives {where} = {t.world_size} ranks, not a multiple of tp*cp*pp = {model} "
                                  f"(tp={p.tp}, cp={p.cp}, pp={p.pp})",
                                  f"use trainer.num_nodes={nodes}, ... or change parallel.tp/cp/pp") from None
            if e.key == "replication.num_instances":
                raise ConfigError(e.key, e.value, f"{e.rule} at {where} with tp*cp*pp = {p.tp * p.cp * p.pp}",
                                  e.fix) from None
            raise

    def _check_model_split(self) -> None:
        """Megatron's rules for splitting the model over tp and pp (checked here so they fail before launch)."""
        m, p = self.model, self.parallel
        for key in ("n_heads", "n_kv_heads", "ffn_hidden"):
            if getattr(m, key) % p.tp:
                raise ConfigError(f"model.{key}", getattr(m, key), f"must be divisible by parallel.tp={p.tp}",
                                  "choose a parallel.tp that divides model.n_heads, model.n_kv_heads and "
                                  "model.ffn_hidden")
        if m.n_layers % p.pp:
            raise ConfigError("parallel.pp", p.pp, f"must divide model.n_layers={m.n_layers}",
                              f"choose a divisor of {m.n_layers}")
        if p.cp > 1 and self.data.seq_len % (2 * p.cp):
            raise ConfigError("data.seq_len", self.data.seq_len,
                              f"must be a multiple of 2 x parallel.cp = {2 * p.cp} (context parallelism)",
                              "change data.seq_len or parallel.cp")


def register_configs() -> None:
    """Register `Config` as Hydra's schema `base_config` (so unknown keys and wrong types fail at compose time)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


RUN_CONFIG = "config.yaml"


def to_object(node: Any) -> Config:
    """A composed OmegaConf node -> a validated `Config` (runs every `__post_init__`)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), node)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj


def save_run_config(cfg: Config, run_dir: Any) -> None:
    """Write the fully resolved config the workers will read (YAML, private to the user)."""
    import os
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(run_dir) / RUN_CONFIG
    # A name of this process's own: the agents of several nodes write the same shared run dir at once (the same
    # config); with one shared temporary name one of them renamed the other's file away and failed.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
    tmp.replace(path)


def load_run_config(run_dir: Any) -> Config:
    from pathlib import Path

    from omegaconf import OmegaConf

    return to_object(OmegaConf.load(Path(run_dir) / RUN_CONFIG))
