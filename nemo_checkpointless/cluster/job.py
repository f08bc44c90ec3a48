"""What both cluster targets share: the agents' command line, the job's name, the environment the ranks need and
the size of the shared memory the data cache takes on a node.

A cluster job is one `checkpointless-store` (the job's store, on its own) and one agent per node: trainer.num_nodes
training nodes plus replication.spare_nodes spare nodes, every one running the same `checkpointless-train` command
with its own `launcher.node_rank` (0 .. num_nodes + spare_nodes - 1; ranks >= num_nodes are the spare nodes).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from nemo_checkpointless.config import Config
from nemo_checkpointless.errors import ConfigError

STORE_PORT = 29400  # the job's store (`checkpointless-store --port`), torchrun's c10d rendezvous port
IMAGE_ENV = "NCL_IMAGE"  # the container image of the k8s pods (not a config key: config.py holds the job only)
DEFAULT_IMAGE = "nvcr.io/nvidia/nemo:25.09"
GIB = 1 << 30
MIB = 1 << 20

# Keys the launch files set for every agent themselves; a user's value for them is dropped from the agents' command.
_SET_BY_FILES = ("launcher.target", "launcher.node_rank", "launcher.rdzv_endpoint", "launcher.rdzv_backend")


def override_key(override: str) -> str:
    """The key of a command-line override as written (`+a.b=1`, `++a.b=1`, `~a.b` -> `a.b`)."""
    return override.lstrip("+~").split("=", 1)[0]


def check_cluster_config(cfg: Config, overrides: list[str]) -> None:
    """Refuse what cannot be the same on every node: one node's rank, address or store (ConfigError)."""
    lc, target = cfg.launcher, cfg.launcher.target
    per_node = "SLURM_NODEID" if target == "slurm" else "PET_NODE_RANK"
    if lc.node_rank != 0:
        raise ConfigError("launcher.node_rank", lc.node_rank, f"is set for each node by the launch files "
                          f"(from {per_node}) with launcher.target={target}", "drop launcher.node_rank")
    if lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", lc.rdzv_endpoint, f"launcher.target={target} runs the job's own "
                          "checkpointless-store and points every agent at it", "drop launcher.rdzv_endpoint")
    if lc.rdzv_backend != "external" and any(override_key(o) == "launcher.rdzv_backend" for o in overrides):
        raise ConfigError("launcher.rdzv_backend", lc.rdzv_backend, f"launcher.target={target} runs the store "
                          "apart from the training nodes (external)", "drop launcher.rdzv_backend")
    if lc.local_addr:
        raise ConfigError("launcher.local_addr", lc.local_addr, "is one node's own address, and every node of a "
                          f"launcher.target={target} job runs the same command",
                          "leave it unset: each agent uses the address its route to the store leaves from")


def num_agents(cfg: Config) -> int:
    """Nodes of the job, one agent each: the training nodes and the spare nodes."""
    return cfg.trainer.num_nodes + cfg.replication.spare_nodes


def job_name(cfg: Config) -> str:
    """A DNS-1035 label from the run dir's last part (`runs/llama3_70b` -> `llama3-70b`), short enough that the
    pods' and services' names built on it (`NAME-worker-123`, `NAME-store`) stay within 63 characters."""
    base = os.path.basename(os.path.normpath(cfg.run.dir)) or cfg.recipe_name
    name = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"ncl-{name}".rstrip("-")
    limit = 63 - len(f"-worker-{num_agents(cfg)}")
    return name[:limit].rstrip("-")


def agent_args(cfg: Config, overrides: list[str], node_rank: str, store: str) -> list[str]:
    """The arguments of every agent's `checkpointless-train`: the recipe, the user's overrides as given (less the
    keys the files set), then this node's rank (`node_rank`: a variable the node expands) and the store."""
    recipe = next((o.split("=", 1)[1] for o in overrides if override_key(o) == "recipe" and "=" in o),
                  cfg.recipe_name)
    kept = [o for o in overrides if override_key(o) not in (*_SET_BY_FILES, "recipe")]
    return [f"recipe={recipe}", *kept, "launcher.target=local", f"launcher.node_rank={node_rank}",
            f"launcher.rdzv_endpoint={store}", "launcher.rdzv_backend=external"]


def rank_env(cfg: Config) -> dict[str, str]:
    """Environment every node's agent (and so its ranks) gets: the launcher's thread count, and for the NeMo engine
    on GPUs what NeMo's own launchers set (`TORCH_NCCL_AVOID_RECORD_STREAMS`; with TP or CP,
    `CUDA_DEVICE_MAX_CONNECTIONS=1`, which Megatron's communication overlap needs on pre-Blackwell GPUs)."""
    threads = str(cfg.launcher.threads_per_rank)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if cfg.engine == "nemo" and cfg.trainer.accelerator == "gpu":
        env["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
        if cfg.parallel.tp > 1 or cfg.parallel.cp > 1:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def image() -> str:
    """The pods' container image: $NCL_IMAGE, else the NeMo image (which must have this package installed)."""
    value = os.environ.get(IMAGE_ENV)
    if value is None:
        return DEFAULT_IMAGE
    if not value.strip() or any(c.isspace() for c in value):
        raise ConfigError(IMAGE_ENV, repr(value), "must name a container image",
                          f"set e.g. {IMAGE_ENV}=registry.example.com/team/nemo-ncl:1.0, or unset it for "
                          f"{DEFAULT_IMAGE}")
    return value


# ------------------------------------------------------------------------------------------------- shared memory
CACHE_ALIGN = 64  # `.bin` tensors are 64-byte aligned
INDEX_BYTES = 4096  # a batch's `.json` (job, version, sample ids, sha256, layout), rounded up
IN_FLIGHT = 2  # the batch being written, and a temporary a dead writer left behind
TOKEN_BYTES = 8  # token ids are cached as int64
RESERVE_BASE = GIB  # NCCL's shared-memory transport and torch's shared tensors (DataLoader workers), per node
RESERVE_PER_RANK = 256 * MIB


@dataclass(frozen=True)
class ShmSize:
    """Shared memory one node needs: the data cache (tier 2) of its ranks, with headroom, plus a reserve.

    batch   = align64(data.micro_batch_size x (data.seq_len + 1) x 8 B) + 4 KiB index
    cache   = trainer.devices x (data.prefetch + data.lookback + 2) x batch
              (one writer per batch group, at most one group per rank; + 2: the batch being written and a
              temporary left by a dead writer; data.loader=plain: 0)
    limit   = ceil_GiB(2 x cache + 1 GiB + 256 MiB x trainer.devices)
              (x 2: headroom: a full cache only costs direct reads, but where Kubernetes does not size a memory
              emptyDir's tmpfs to its sizeLimit, a pod over it is evicted; the reserve: NCCL's shared-memory
              transport and torch's shared tensors)
    """

    batch_bytes: int
    cache_bytes: int
    reserve_bytes: int

    @property
    def cache_limit_bytes(self) -> int:
        """The cache alone with its headroom, in whole GiB (for a cache_root that is not /dev/shm)."""
        return max(1, math.ceil(2 * self.cache_bytes / GIB)) * GIB

    @property
    def limit_bytes(self) -> int:
        """/dev/shm with the cache in it."""
        return math.ceil((2 * self.cache_bytes + self.reserve_bytes) / GIB) * GIB

    @property
    def reserve_limit_bytes(self) -> int:
        """/dev/shm when the cache lives elsewhere (data.cache_root outside /dev/shm)."""
        return math.ceil(self.reserve_bytes / GIB) * GIB

    def formula(self, cfg: Config) -> str:
        """The sizes with their figures, for the files' comments."""
        d, n = cfg.data, cfg.trainer.devices
        cache = (f"cache = {n} ranks x (prefetch {d.prefetch} + lookback {d.lookback} + 2) x batch "
                 f"{self.batch_bytes} B = {self.cache_bytes} B, batch = align64(micro {d.micro_batch_size} x "
                 f"(seq_len {d.seq_len} + 1) x 8 B) + 4 KiB" if d.loader == "mmap" else "cache = 0 (data.loader=plain)")
        if cache_in_shm(cfg):
            return f"/dev/shm = ceil_GiB(2 x cache + 1 GiB + 256 MiB x {n} ranks) = {gib(self.limit_bytes)}; {cache}"
        return (f"/dev/shm = ceil_GiB(1 GiB + 256 MiB x {n} ranks) = {gib(self.reserve_limit_bytes)}; "
                f"data.cache_root={cache_root(cfg)} = ceil_GiB(2 x cache) = {gib(self.cache_limit_bytes)}; {cache}")


def shm_size(cfg: Config) -> ShmSize:
    d, devices = cfg.data, cfg.trainer.devices
    raw = d.micro_batch_size * (d.seq_len + 1) * TOKEN_BYTES
    batch = -(-raw // CACHE_ALIGN) * CACHE_ALIGN + INDEX_BYTES
    cache = devices * (d.prefetch + d.lookback + IN_FLIGHT) * batch if d.loader == "mmap" else 0
    return ShmSize(batch_bytes=batch, cache_bytes=cache, reserve_bytes=RESERVE_BASE + RESERVE_PER_RANK * devices)


def cache_root(cfg: Config) -> str:
    """Where the data cache lives on a node (data.cache_root, default /dev/shm)."""
    return cfg.data.cache_root or "/dev/shm"


def cache_in_shm(cfg: Config) -> bool:
    root = os.path.normpath(cache_root(cfg))
    return root == "/dev/shm" or root.startswith("/dev/shm/")


def comment(text: str) -> str:
    """`text` as `#` comment lines of at most 120 characters (YAML and bash alike)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, 118, initial_indent="# ", subsequent_indent="#   ")) + "\n"


def gib(n: int) -> str:
    """A whole number of GiB as a Kubernetes quantity (`3Gi`)."""
    return f"{n // GIB}Gi"
