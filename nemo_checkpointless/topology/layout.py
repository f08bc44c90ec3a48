"""Rank layout of a Megatron-style parallel job with replicated distributed-optimizer instances.

Ranks are laid out as in Megatron-core's ``RankGenerator``: a rank is a mixed-radix number over the
dimensions of ``order`` with the first one varying fastest. The dense grid drops ``ep``; the expert grid
drops ``cp`` and splits the data-parallel axis into ``ep`` x expert-dp. The distributed optimizer shards
over the dp-cp group; with ``num_instances`` = N that group (sorted by rank) is cut into N contiguous
chunks, one per instance, so ranks at the same position of different chunks hold the same shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nemo_checkpointless.errors import ConfigError

__all__ = [
    "ParallelDims",
    "RankInfo",
    "RecoveryPlan",
    "context_parallel_groups",
    "data_parallel_groups",
    "pipeline_parallel_groups",
    "plan_recovery",
    "rank_info",
    "replica_groups",
    "shard_groups",
    "tensor_parallel_groups",
]

_NAMES = ("tp", "cp", "ep", "dp", "pp")
_DEFAULT_ORDER = "tp-cp-ep-dp-pp"

Group = tuple[int, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: Sequence[int]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"``."""
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


class _Grid:
    """Mixed-radix rank grid; the first name varies fastest (Megatron's ``RankGenerator``)."""

    def __init__(self, names: Sequence[str], sizes: dict[str, int]) -> None:
        self.names = tuple(names)
        self.sizes = {n: sizes[n] for n in self.names}
        self.strides: dict[str, int] = {}
        stride = 1
        for n in self.names:
            self.strides[n] = stride
            stride *= self.sizes[n]
        self.world_size = stride

    def coords(self, rank: int) -> dict[str, int]:
        return {n: (rank // self.strides[n]) % self.sizes[n] for n in self.names}

    def rank(self, coords: dict[str, int]) -> int:
        return sum(coords[n] * self.strides[n] for n in self.names)

    def group(self, rank: int, vary: Sequence[str]) -> Group:
        """Ranks sharing every coordinate of ``rank`` except those in ``vary``, in increasing rank order."""
        vary = [n for n in self.names if n in vary]  # grid order = increasing rank order
        base = self.coords(rank)
        for n in vary:
            base[n] = 0
        start = self.rank(base)
        out = [start]
        for n in vary:
            out = [r + i * self.strides[n] for i in range(self.sizes[n]) for r in out]
        return tuple(out)

    def groups(self, vary: Sequence[str]) -> list[Group]:
        """All groups for ``vary``, sorted by first rank (which is Megatron's order too)."""
        seen: set[int] = set()
        result: list[Group] = []
        for rank in range(self.world_size):
            if rank not in seen:
                g = self.group(rank, vary)
                seen.update(g)
                result.append(g)
        return result


@dataclass(frozen=True)
class ParallelDims:
    """Parallel sizes of a job. ``dp = world_size // (tp*cp*pp)``; ``ep`` is carved out of ``dp``.

    ``num_instances`` is Megatron's ``num_distributed_optimizer_instances``: the number of full replicas
    of the distributed-optimizer state. Invalid values raise :class:`ConfigError` on construction.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    num_instances: int = 1
    order: str = _DEFAULT_ORDER

    def __post_init__(self) -> None:
        keys = {
            "world_size": "world_size",
            "tp": "parallel.tp",
            "cp": "parallel.cp",
            "ep": "parallel.ep",
            "pp": "parallel.pp",
            "num_instances": "replication.num_instances",
        }
        for attr, key in keys.items():
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(key, value, "must be an integer >= 1", f"set {key} to a positive integer")
        tokens = self.order.split("-") if isinstance(self.order, str) else []
        if sorted(tokens) != sorted(_NAMES):
            raise ConfigError(
                "parallel.order",
                self.order,
                "must name each of tp, cp, ep, dp, pp exactly once, joined by '-'",
                f"use e.g. {_DEFAULT_ORDER}",
            )
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise ConfigError(
                "world_size",
                self.world_size,
                f"must be a multiple of tp*cp*pp = {model} (tp={self.tp}, cp={self.cp}, pp={self.pp})",
                f"use a world size of {_choices([model * k for k in (1, 2, 3)])}, or choose tp, cp, pp whose "
                f"product is one of {_choices(_divisors(self.world_size))}",
            )
        dp = self.world_size // model
        if dp % self.ep:
            raise ConfigError(
                "parallel.ep",
                self.ep,
                f"must divide the data-parallel size {dp} (expert parallelism is carved out of data parallelism)",
                f"choose {_choices(_divisors(dp))}",
            )
        shard_domain = dp * self.cp // self.ep
        if shard_domain % self.num_instances:
            if self.ep > 1:
                what = f"expert data-parallel size {shard_domain} (dp*cp/ep = {dp}*{self.cp}/{self.ep})"
            elif self.cp > 1:
                what = f"data-parallel size {shard_domain} (dp*cp = {dp}*{self.cp})"
            else:
                what = f"data-parallel size {dp}"
            raise ConfigError(
                "replication.num_instances",
                self.num_instances,
                f"must divide the {what}",
                f"choose {_choices(_divisors(shard_domain))}",
            )
        self._check_megatron_order(dp)
        self._check_megatron_replicas()

    def _check_megatron_order(self, dp: int) -> None:
        """The two order constraints ``megatron.core.parallel_state.initialize_model_parallel`` asserts."""
        if self.pp == 1:
            return
        expert_dp = dp * self.cp // self.ep
        fix = f"put pp last, e.g. {_DEFAULT_ORDER}"
        if not self.order.endswith("pp") and expert_dp != dp:
            raise ConfigError(
                "parallel.order",
                self.order,
                f"pp must come last when the expert data-parallel size ({expert_dp}) differs from dp ({dp})",
                fix,
            )
        if _dense_grid(self).groups(["pp"]) != _expert_grid(self).groups(["pp"]):
            raise ConfigError(
                "parallel.order",
                self.order,
                "gives different pipeline groups to dense and expert layers (cp sits before pp)",
                fix,
            )

    def _check_megatron_replicas(self) -> None:
        """Megatron builds the inter-instance group (``get_inter_distributed_optimizer_instance_group``) from the
        expert layout; for some orders it does not pair the ranks holding the same dense optimizer shard."""
        if self.num_instances == 1:
            return
        size = self.expert_dp // self.num_instances
        expert = sorted(g[i::size] for g in _expert_grid(self).groups(["dp"]) for i in range(size))
        if expert != replica_groups(self):
            raise ConfigError(
                "parallel.order",
                self.order,
                f"with replication.num_instances={self.num_instances}, Megatron's inter-instance groups (built from "
                "the expert layout) would not pair ranks holding the same optimizer shard",
                f"use {_DEFAULT_ORDER}",
            )

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers (excluding cp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def dp_cp(self) -> int:
        """Size of the dp-cp group the distributed optimizer shards over."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert layers (``dp*cp/ep``, expert tp = tp)."""
        return self.dp_cp // self.ep

    @property
    def shard_size(self) -> int:
        """Ranks per distributed-optimizer instance within one dp-cp group (``dp_cp / num_instances``)."""
        return self.dp_cp // self.num_instances

    @property
    def checkpoint_slots(self) -> int:
        """Distinct states one optimizer instance holds (``tp * pp * shard_size``): a rank's TP/PP slice of the
        params with its optimizer shard. The persistent checkpoint has one file per slot."""
        return self.tp * self.pp * self.shard_size


def _dense_grid(dims: ParallelDims) -> _Grid:
    sizes = {"tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "pp": dims.pp}
    return _Grid([n for n in dims.order.split("-") if n != "ep"], sizes)


def _expert_grid(dims: ParallelDims) -> _Grid:
    sizes = {"tp": dims.tp, "ep": dims.ep, "dp": dims.expert_dp, "pp": dims.pp}
    return _Grid([n for n in dims.order.split("-") if n != "cp"], sizes)


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits. ``shard_group``: its instance's ranks in its dp-cp group (Megatron's intra-instance
    group); ``replica_peers``: the ranks holding the same optimizer shard, self included, sorted;
    ``checkpoint_slot``: which of the instance's ``checkpoint_slots`` states this rank holds (its TP/PP slice and
    shard: ``(pp_rank * tp + tp_rank) * shard_size + shard_index``), the same for all its replica peers."""

    rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    instance: int
    shard_index: int
    shard_group: Group
    replica_peers: Group
    checkpoint_slot: int


def _check_rank(dims: ParallelDims, rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank!r} is out of range for world_size {dims.world_size}")


def rank_info(dims: ParallelDims, rank: int) -> RankInfo:
    """Coordinates, instance and replica peers of ``rank``. Raises ValueError if out of range."""
    _check_rank(dims, rank)
    grid = _dense_grid(dims)
    c = grid.coords(rank)
    dp_cp = grid.group(rank, ["dp", "cp"])
    pos = dp_cp.index(rank)
    size = dims.shard_size
    instance, shard_index = divmod(pos, size)
    return RankInfo(
        rank=rank,
        tp_rank=c["tp"],
        cp_rank=c["cp"],
        dp_rank=c["dp"],
        pp_rank=c["pp"],
        ep_rank=_expert_grid(dims).coords(rank)["ep"],
        instance=instance,
        shard_index=shard_index,
        shard_group=dp_cp[instance * size : (instance + 1) * size],
        replica_peers=dp_cp[shard_index::size],
        checkpoint_slot=(c["pp"] * dims.tp + c["tp"]) * size + shard_index,
    )


def data_parallel_groups(dims: ParallelDims, with_context_parallel: bool = False) -> list[Group]:
    """Megatron's ``dp`` groups, or ``dp-cp`` groups (what the distributed optimizer shards over)."""
    return _dense_grid(dims).groups(["dp", "cp"] if with_context_parallel else ["dp"])


def tensor_parallel_groups(dims: ParallelDims) -> list[Group]:
    """Megatron's ``tp`` groups."""
    return _dense_grid(dims).groups(["tp"])


def context_parallel_groups(dims: ParallelDims) -> list[Group]:
    """Megatron's ``cp`` groups."""
    return _dense_grid(dims).groups(["cp"])


def pipeline_parallel_groups(dims: ParallelDims) -> list[Group]:
    """Megatron's ``pp`` groups."""
    return _dense_grid(dims).groups(["pp"])


def shard_groups(dims: ParallelDims) -> list[Group]:
    """All intra-instance groups (Megatron's intra-partial dp-cp groups), sorted."""
    size = dims.shard_size
    out = [g[i : i + size] for g in data_parallel_groups(dims, True) for i in range(0, len(g), size)]
    return sorted(out)


def replica_groups(dims: ParallelDims) -> list[Group]:
    """All groups of ranks holding the same optimizer shard (Megatron's inter-instance groups), sorted."""
    size = dims.shard_size
    return sorted(g[i::size] for g in data_parallel_groups(dims, True) for i in range(size))


@dataclass(frozen=True)
class RecoveryPlan:
    """Outcome of :func:`plan_recovery`. ``sources`` maps each failed rank to a live rank holding its shard
    (empty when not recoverable); ``lost_shards`` lists failed ranks with no live, usable replica peer."""

    recoverable: bool
    sources: dict[int, int] = field(default_factory=dict)
    lost_shards: tuple[int, ...] = ()
    reason: str = ""


def _ranks_phrase(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + _choices(ranks).replace(" or ", " and ")


def plan_recovery(dims: ParallelDims, failed: Iterable[int], exclude: Iterable[int] = ()) -> RecoveryPlan:
    """Pick, for every failed rank, a live replica peer to copy its optimizer shard from.

    ``exclude`` are survivors that must not serve as sources (e.g. their step disagrees). The choice is
    deterministic: failed ranks are served in rank order, each by the usable peer that has served the fewest
    so far, ties broken by the next instance after the failed rank's, cyclically. Raises ValueError for ranks
    out of range.
    """
    failed_list, exclude_list = list(failed), list(exclude)
    for r in failed_list + exclude_list:
        _check_rank(dims, r)
    failed_set, excluded = set(failed_list), set(exclude_list)
    if not failed_set:
        return RecoveryPlan(True, {}, (), "no rank failed")
    n = dims.num_instances
    infos = {r: rank_info(dims, r) for r in sorted(failed_set)}
    if n == 1:
        return RecoveryPlan(
            False,
            {},
            tuple(sorted(failed_set)),
            f"replication.num_instances=1: no replica of the optimizer state exists, so "
            f"{_ranks_phrase(sorted(failed_set))} cannot be restored from peers",
        )
    unusable = failed_set | excluded
    load: dict[int, int] = {}
    sources: dict[int, int] = {}
    lost: list[int] = []
    for r, info in infos.items():
        peers = [p for p in info.replica_peers if p not in unusable]
        if not peers:
            lost.append(r)
            continue
        # replica_peers[i] is in instance i, so the cyclic distance from r's instance is (i - instance) % n.
        src = min(peers, key=lambda p: (load.get(p, 0), (info.replica_peers.index(p) - info.instance) % n))
        load[src] = load.get(src, 0) + 1
        sources[r] = src
    if not lost:
        return RecoveryPlan(True, sources, (), f"every failed rank has a live replica peer ({len(sources)} to restore)")
    parts: list[str] = []
    seen: set[Group] = set()
    for r in lost:
        info = infos[r]
        if info.replica_peers in seen:
            continue
        seen.add(info.replica_peers)
        dead = [p for p in info.replica_peers if p in failed_set]
        skip = [p for p in info.replica_peers if p not in failed_set]
        which = "both replicas" if n == 2 else f"all {n} replicas"
        shard = f"shard (tp={info.tp_rank}, pp={info.pp_rank}, shard={info.shard_index})"
        if skip:
            parts.append(
                f"{which} of {shard} are unusable: {_ranks_phrase(dead)} failed, {_ranks_phrase(skip)} excluded"
            )
        else:
            parts.append(f"{which} of {shard} are lost: {_ranks_phrase(dead)}")
    more = f"; and {len(parts) - 3} more shards" if len(parts) > 3 else ""
    return RecoveryPlan(False, {}, tuple(lost), "; ".join(parts[:3]) + more)
