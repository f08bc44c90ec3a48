"""Tests for nemo_checkpointless.topology: hand-checked layouts, validation messages, properties, Megatron parity."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.topology import (
    ParallelDims,
    RecoveryPlan,
    context_parallel_groups,
    data_parallel_groups,
    pipeline_parallel_groups,
    plan_recovery,
    rank_info,
    replica_groups,
    shard_groups,
    tensor_parallel_groups,
)

NAMES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
PROPS = settings(max_examples=200, deadline=None)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---------------------------------------------------------------------------------------------------------------
# Hand-checked layouts
# ---------------------------------------------------------------------------------------------------------------


def test_four_ranks_two_instances() -> None:
    dims = ParallelDims(world_size=4, num_instances=2)
    assert dims.dp == 4 and dims.shard_size == 2
    assert shard_groups(dims) == [(0, 1), (2, 3)]
    assert replica_groups(dims) == [(0, 2), (1, 3)]
    info = rank_info(dims, 1)
    assert (info.dp_rank, info.instance, info.shard_index) == (1, 0, 1)
    assert info.shard_group == (0, 1) and info.replica_peers == (1, 3)
    assert rank_info(dims, 2).instance == 1 and rank_info(dims, 2).shard_index == 0


def test_world16_tp2_pp2_two_instances() -> None:
    # rank = tp + 2*dp + 8*pp with dp = 4
    dims = ParallelDims(world_size=16, tp=2, pp=2, num_instances=2)
    assert dims.dp == 4
    assert tensor_parallel_groups(dims) == [(2 * i, 2 * i + 1) for i in range(8)]
    assert pipeline_parallel_groups(dims) == [(i, i + 8) for i in range(8)]
    assert data_parallel_groups(dims) == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert shard_groups(dims) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert replica_groups(dims) == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    info = rank_info(dims, 13)
    assert (info.tp_rank, info.dp_rank, info.pp_rank, info.cp_rank) == (1, 2, 1, 0)
    assert (info.instance, info.shard_index, info.shard_group, info.replica_peers) == (1, 0, (13, 15), (9, 13))


def test_context_parallel_folds_into_the_sharding_group() -> None:
    # rank = cp + 2*dp, dp = 4: the dp-cp group is all 8 ranks
    dims = ParallelDims(world_size=8, cp=2, num_instances=2)
    assert data_parallel_groups(dims, with_context_parallel=True) == [tuple(range(8))]
    assert data_parallel_groups(dims) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert context_parallel_groups(dims) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shard_groups(dims) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert replica_groups(dims) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    info = rank_info(dims, 5)
    assert (info.cp_rank, info.dp_rank, info.instance, info.shard_index) == (1, 2, 1, 1)


def test_tp_cp_four_instances() -> None:
    dims = ParallelDims(world_size=16, tp=2, cp=2, num_instances=4)
    assert dims.dp_cp == 8 and dims.shard_size == 2
    assert rank_info(dims, 0).shard_group == (0, 2)
    assert rank_info(dims, 0).replica_peers == (0, 4, 8, 12)
    assert rank_info(dims, 7).replica_peers == (3, 7, 11, 15)


def test_expert_rank_is_carved_out_of_dp() -> None:
    dims = ParallelDims(world_size=8, ep=2)
    assert [rank_info(dims, r).ep_rank for r in range(8)] == [0, 1] * 4
    dims = ParallelDims(world_size=16, tp=2, ep=4)
    assert [rank_info(dims, r).ep_rank for r in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3] * 2


def test_tp_first_order_gives_consecutive_tensor_peers() -> None:
    dims = ParallelDims(world_size=24, tp=4, pp=3)
    assert tensor_parallel_groups(dims)[0] == (0, 1, 2, 3)
    dims = ParallelDims(world_size=8, tp=2, order="dp-cp-ep-tp-pp")
    assert tensor_parallel_groups(dims) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert data_parallel_groups(dims)[0] == (0, 1, 2, 3)


# ---------------------------------------------------------------------------------------------------------------
# plan_recovery, hand-checked
# ---------------------------------------------------------------------------------------------------------------


def test_recovery_from_the_other_instance() -> None:
    dims = ParallelDims(world_size=4, num_instances=2)
    assert plan_recovery(dims, [0]) == RecoveryPlan(True, {0: 2}, (), plan_recovery(dims, [0]).reason)
    plan = plan_recovery(dims, [3, 0])
    assert plan.recoverable and plan.sources == {0: 2, 3: 1} and plan.lost_shards == ()


def test_recovery_lost_when_both_replicas_fail() -> None:
    plan = plan_recovery(ParallelDims(world_size=4, num_instances=2), [1, 3])
    assert not plan.recoverable and plan.sources == {} and plan.lost_shards == (1, 3)
    assert plan.reason == "both replicas of shard (tp=0, pp=0, shard=1) are lost: ranks 1 and 3"


def test_recovery_excluded_source() -> None:
    dims = ParallelDims(world_size=4, num_instances=2)
    plan = plan_recovery(dims, [1], exclude=[3])
    assert not plan.recoverable and plan.lost_shards == (1,)
    assert "rank 1 failed" in plan.reason and "rank 3 excluded" in plan.reason
    assert plan_recovery(dims, [1], exclude=[0, 2]).sources == {1: 3}


def test_recovery_without_replicas() -> None:
    plan = plan_recovery(ParallelDims(world_size=4), [2])
    assert not plan.recoverable and plan.lost_shards == (2,)
    assert "no replica" in plan.reason and "num_instances=1" in plan.reason


def test_recovery_nothing_failed() -> None:
    plan = plan_recovery(ParallelDims(world_size=4), [], exclude=[1])
    assert plan.recoverable and plan.sources == {} and plan.lost_shards == ()


def test_recovery_spreads_load_and_is_deterministic() -> None:
    dims = ParallelDims(world_size=4, num_instances=4)  # one shard, four replicas 0..3
    assert plan_recovery(dims, [0]).sources == {0: 1}  # next instance
    assert plan_recovery(dims, [3]).sources == {3: 0}  # cyclic
    assert plan_recovery(dims, [0, 1]).sources == {0: 2, 1: 3}  # second failure takes the idle peer
    assert plan_recovery(dims, [1, 0]) == plan_recovery(dims, {0, 1})


@pytest.mark.parametrize("failed, exclude", [([4], []), ([-1], []), ([0], [4]), (["0"], [])])
def test_recovery_rejects_bad_ranks(failed: list[Any], exclude: list[Any]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        plan_recovery(ParallelDims(world_size=4, num_instances=2), failed, exclude)


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_rank_info_rejects_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        rank_info(ParallelDims(world_size=8), rank)


# ---------------------------------------------------------------------------------------------------------------
# Validation messages
# ---------------------------------------------------------------------------------------------------------------


def test_num_instances_message_exact() -> None:
    with pytest.raises(ConfigError) as exc:
        ParallelDims(world_size=4, num_instances=3)
    assert str(exc.value) == "replication.num_instances=3: must divide the data-parallel size 4; choose 1, 2 or 4"
    assert exc.value.key == "replication.num_instances" and exc.value.value == 3
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, key, value, expected",
    [
        (dict(world_size=12, tp=8), "world_size", 12, ["tp*cp*pp = 8", "8, 16 or 24", "1, 2, 3, 4, 6 or 12"]),
        (dict(world_size=8, ep=3), "parallel.ep", 3, ["data-parallel size 8", "choose 1, 2, 4 or 8"]),
        (dict(world_size=16, tp=2, ep=3), "parallel.ep", 3, ["data-parallel size 8", "choose 1, 2, 4 or 8"]),
        (dict(world_size=16, cp=2, num_instances=3), "replication.num_instances", 3, ["16", "1, 2, 4, 8 or 16"]),
        (dict(world_size=8, ep=2, num_instances=8), "replication.num_instances", 8, ["4", "choose 1, 2 or 4"]),
        (dict(world_size=8, order="tp-dp-pp"), "parallel.order", "tp-dp-pp", ["tp, cp, ep, dp, pp", DEFAULT_ORDER]),
        (dict(world_size=8, order="tp-cp-ep-dp-dp"), "parallel.order", "tp-cp-ep-dp-dp", [DEFAULT_ORDER]),
        (dict(world_size=8, order="tp-cp-ep-dp-pp-xp"), "parallel.order", "tp-cp-ep-dp-pp-xp", [DEFAULT_ORDER]),
        (dict(world_size=8, order="tp,cp,ep,dp,pp"), "parallel.order", "tp,cp,ep,dp,pp", [DEFAULT_ORDER]),
        # Orders megatron-core's initialize_model_parallel would reject or wire inconsistently.
        (dict(world_size=8, cp=2, pp=2, order="tp-cp-pp-ep-dp"), "parallel.order", "tp-cp-pp-ep-dp", ["pp last"]),
        (
            dict(world_size=8, ep=2, num_instances=2, order="tp-dp-cp-ep-pp"),
            "parallel.order",
            "tp-dp-cp-ep-pp",
            ["num_instances=2", DEFAULT_ORDER],
        ),
    ],
)
def test_validation_messages(kwargs: dict[str, Any], key: str, value: Any, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        ParallelDims(**kwargs)
    msg = str(exc.value)
    assert exc.value.key == key and exc.value.value == value
    assert msg.startswith(f"{key}={value}: ")
    for text in expected:
        assert text in msg


@pytest.mark.parametrize(
    "field, key",
    [
        ("world_size", "world_size"),
        ("tp", "parallel.tp"),
        ("cp", "parallel.cp"),
        ("ep", "parallel.ep"),
        ("pp", "parallel.pp"),
        ("num_instances", "replication.num_instances"),
    ],
)
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_sizes_must_be_positive_integers(field: str, key: str, bad: Any) -> None:
    kwargs: dict[str, Any] = {"world_size": 8, field: bad}
    with pytest.raises(ConfigError) as exc:
        ParallelDims(**kwargs)
    assert exc.value.key == key and str(exc.value).startswith(f"{key}={bad}: must be an integer >= 1")


# ---------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn, max_world: int = 64) -> ParallelDims:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    cp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.integers(1, max(1, max_world // (tp * cp * pp))))
    ep = draw(st.sampled_from(divisors(dp)))
    n = draw(st.sampled_from(divisors(dp * cp // ep)))
    order = "-".join(draw(st.permutations(NAMES)))
    world = tp * cp * pp * dp
    try:
        return ParallelDims(world, tp=tp, cp=cp, ep=ep, pp=pp, num_instances=n, order=order)
    except ConfigError as e:  # an order Megatron rejects for this shape: the default order is always fine
        assert e.key == "parallel.order"
        return ParallelDims(world, tp=tp, cp=cp, ep=ep, pp=pp, num_instances=n)


@PROPS
@given(layouts())
def test_every_rank_in_exactly_one_shard_group_and_one_replica_group(dims: ParallelDims) -> None:
    for groups, size in ((shard_groups(dims), dims.shard_size), (replica_groups(dims), dims.num_instances)):
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        assert all(len(g) == size and list(g) == sorted(g) for g in groups)
        assert groups == sorted(groups)


@PROPS
@given(layouts())
def test_shard_groups_partition_each_dp_cp_group(dims: ParallelDims) -> None:
    shards = shard_groups(dims)
    for group in data_parallel_groups(dims, with_context_parallel=True):
        inside = [s for s in shards if set(s) & set(group)]
        assert all(set(s) <= set(group) for s in inside)
        assert len(inside) == dims.num_instances
        assert sorted(r for s in inside for r in s) == list(group)
        positions = {(rank_info(dims, r).instance, rank_info(dims, r).shard_index) for r in group}
        assert positions == set(itertools.product(range(dims.num_instances), range(dims.shard_size)))


@PROPS
@given(layouts())
def test_rank_info_is_consistent(dims: ParallelDims) -> None:
    shards, replicas = set(shard_groups(dims)), set(replica_groups(dims))
    coords = set()
    for r in range(dims.world_size):
        info = rank_info(dims, r)
        assert info.rank == r
        coords.add((info.tp_rank, info.cp_rank, info.dp_rank, info.pp_rank))
        assert 0 <= info.ep_rank < dims.ep and 0 <= info.instance < dims.num_instances
        assert r in info.shard_group and info.shard_group in shards
        assert r in info.replica_peers and info.replica_peers in replicas
        assert len(info.replica_peers) == dims.num_instances and list(info.replica_peers) == sorted(info.replica_peers)
        peers = [rank_info(dims, p) for p in info.replica_peers]
        key = (info.tp_rank, info.pp_rank, info.shard_index)
        assert {(p.tp_rank, p.pp_rank, p.shard_index) for p in peers} == {key}
        assert sorted(p.instance for p in peers) == list(range(dims.num_instances))
        assert info.shard_group.index(r) == info.shard_index
    assert len(coords) == dims.world_size


@PROPS
@given(layouts())
def test_checkpoint_slots_name_each_state_of_an_instance_once(dims: ParallelDims) -> None:
    """Every instance's ranks hold the checkpoint slots 0..checkpoint_slots-1 once each (one file per TP/PP slice
    and shard: no two ranks that write the checkpoint share a file), and replica peers hold the same slot."""
    for instance in range(dims.num_instances):
        slots = [rank_info(dims, r).checkpoint_slot for r in range(dims.world_size)
                 if rank_info(dims, r).instance == instance]
        assert sorted(slots) == list(range(dims.checkpoint_slots))
    for r in range(dims.world_size):
        info = rank_info(dims, r)
        assert {rank_info(dims, p).checkpoint_slot for p in info.replica_peers} == {info.checkpoint_slot}


@PROPS
@given(layouts())
def test_group_sizes(dims: ParallelDims) -> None:
    for groups, size in (
        (tensor_parallel_groups(dims), dims.tp),
        (pipeline_parallel_groups(dims), dims.pp),
        (data_parallel_groups(dims), dims.dp),
        (context_parallel_groups(dims), dims.cp),
    ):
        assert len(groups) * size == dims.world_size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
    if dims.order.startswith("tp"):
        assert tensor_parallel_groups(dims)[0] == tuple(range(dims.tp))


@PROPS
@given(st.data())
def test_plan_recovery_properties(data: st.DataObject) -> None:
    dims = data.draw(layouts(max_world=32))
    ranks = st.sets(st.integers(0, dims.world_size - 1), max_size=dims.world_size)
    failed, exclude = data.draw(ranks), data.draw(ranks)
    plan = plan_recovery(dims, failed, exclude)
    usable = {r: [p for p in rank_info(dims, r).replica_peers if p not in failed | exclude] for r in failed}
    assert plan.recoverable == all(usable.values())
    assert plan.lost_shards == tuple(sorted(r for r in failed if not usable[r]))
    if plan.recoverable:
        assert set(plan.sources) == failed
        for r, src in plan.sources.items():
            assert src in usable[r] and src != r
    else:
        assert plan.sources == {} and plan.reason
    if dims.num_instances == 1 and failed:
        assert not plan.recoverable
    assert plan == plan_recovery(dims, sorted(failed, reverse=True), sorted(exclude))


# ---------------------------------------------------------------------------------------------------------------
# Parity with megatron-core's RankGenerator
# ---------------------------------------------------------------------------------------------------------------


def _megatron_rank_generator() -> Any:
    """RankGenerator from the installed megatron-core source, without importing megatron.core (which pulls in torch
    and takes seconds): the class and its helper are pure, so their definitions are lifted from the file."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "parallel_state.py"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    wanted = {"RankGenerator", "generate_masked_orthogonal_rank_groups"}
    tree = ast.parse(path.read_text())
    body: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name in wanted]
    if {getattr(n, "name", None) for n in body} != wanted:
        pytest.skip("megatron-core's parallel_state no longer defines RankGenerator as expected")
    namespace: dict[str, Any] = {}
    exec("from typing import List, Optional\n", namespace)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["RankGenerator"]


def _megatron_shapes() -> list[ParallelDims]:
    shapes = []
    orders = ["-".join(p) for p in itertools.permutations(NAMES)]
    for i, (world, tp, cp, ep, pp, n) in enumerate(
        itertools.product([8, 16, 24, 32, 64], [1, 2, 4], [1, 2], [1, 2, 4], [1, 2], [1, 2, 4])
    ):
        for order in (DEFAULT_ORDER, orders[(7 * i) % len(orders)]):
            with contextlib.suppress(ConfigError):
                shapes.append(ParallelDims(world, tp=tp, cp=cp, ep=ep, pp=pp, num_instances=n, order=order))
    return shapes


def test_groups_match_megatron_rank_generator() -> None:
    rank_generator = _megatron_rank_generator()
    shapes = _megatron_shapes()
    assert len(shapes) > 100
    for dims in shapes:
        dense = rank_generator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=dims.order)
        expert = rank_generator(tp=dims.tp, ep=dims.ep, dp=dims.expert_dp, pp=dims.pp, cp=1, order=dims.order)

        def as_tuples(groups: list[list[int]]) -> list[tuple[int, ...]]:
            return [tuple(g) for g in groups]

        assert data_parallel_groups(dims, with_context_parallel=True) == as_tuples(dense.get_ranks("dp-cp")), dims
        assert data_parallel_groups(dims) == as_tuples(dense.get_ranks("dp")), dims
        assert tensor_parallel_groups(dims) == as_tuples(dense.get_ranks("tp")), dims
        assert pipeline_parallel_groups(dims) == as_tuples(dense.get_ranks("pp")), dims
        assert context_parallel_groups(dims) == as_tuples(dense.get_ranks("cp")), dims
        # initialize_model_parallel: intra-partial groups are contiguous chunks of each dp-cp group ...
        size = dims.shard_size
        chunks = [tuple(g[i : i + size]) for g in dense.get_ranks("dp-cp") for i in range(0, len(g), size)]
        assert shard_groups(dims) == sorted(chunks), dims
        # ... and the inter-instance group is level 2 of create_hierarchical_groups over each expert-dp group.
        step = dims.expert_dp // dims.num_instances
        inter = [tuple(g[i::step]) for g in expert.get_ranks("dp") for i in range(step)]
        assert replica_groups(dims) == sorted(inter), dims
        for index, group in enumerate(expert.get_ranks("ep")):
            for ep_rank, r in enumerate(group):
                assert rank_info(dims, r).ep_rank == ep_rank, (dims, index)


def test_the_recipes_place_every_shards_replicas_on_two_nodes() -> None:
    """A whole-node loss keeps a live copy of every optimizer shard on each multi-node recipe's layout; a layout
    that does not (pipeline stages across nodes, so a data-parallel group inside one) is warned about."""
    from nemo_checkpointless.cli.compose import compose, recipe_names
    from nemo_checkpointless.launcher.nodes import placement_warning

    several = [n for n in recipe_names() if compose([f"recipe={n}"]).trainer.num_nodes > 1]
    assert {"llama3_70b", "llama3_405b", "llama3_8b"} <= set(several)
    for name in several:
        assert placement_warning(compose([f"recipe={name}"])) is None, name
    cfg = compose(["recipe=tiny_llama_nemo", "trainer.num_nodes=2", "trainer.devices=4", "parallel.pp=2"])
    warning = placement_warning(cfg)
    assert warning is not None and "ranks [0, 2]" in warning and "node 0" in warning, warning
