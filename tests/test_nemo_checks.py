"""The NeMo path's checks before anything starts (`nemo.checks`), each one clear message in a NeMo user's terms:
an unsupported or missing NeMo / megatron-core, the replication knob under either name, and a layout that does
not fit the world. No NeMo needed (the module imports neither), except for the last test: the strategy that
applies them, under NeMo's own trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import child_env

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.nemo.checks import check_versions, in_nemo_terms, installed_versions, replication_knob
from nemo_checkpointless.topology import ParallelDims

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("nemo, megatron, key", [
    ("2.6.1", "0.15.3", "nemo_toolkit"), ("3.0.0", "0.15.3", "nemo_toolkit"), (None, "0.15.3", "nemo_toolkit"),
    ("2.7.3", "0.16.0", "megatron-core"), ("2.7.3", None, "megatron-core"), ("main", "0.15.3", "nemo_toolkit")])
def test_unsupported_versions_name_the_package_the_version_and_the_install(nemo: str | None, megatron: str | None,
                                                                           key: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_versions(nemo, megatron)
    assert e.value.key == key and "pip install 'nemo-checkpointless[nemo]'" in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{key}=")


def test_supported_versions_pass() -> None:
    check_versions("2.7.3", "0.15.3")
    check_versions("2.7.0rc1", "0.15.0")
    assert len(installed_versions()) == 2


def test_the_replication_knob_under_either_name() -> None:
    assert replication_knob(None, None) == ("num_instances", 1)
    assert replication_knob(2, None) == ("num_instances", 2)
    assert replication_knob(None, 2) == ("num_distributed_optimizer_instances", 2)
    assert replication_knob(2, 2) == ("num_instances", 2)
    with pytest.raises(ConfigError, match=r"^num_distributed_optimizer_instances=3: is the same knob as "
                                          r"num_instances=2, and they differ; pass only one of them$"):
        replication_knob(2, 3)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"^num_distributed_optimizer_instances=.*must be an integer >= 1"):
            replication_knob(None, bad)


def _nemo_error(instances_key: str, **dims: int) -> str:
    with pytest.raises(ConfigError) as e:
        try:
            ParallelDims(**dims)
        except ConfigError as error:
            raise in_nemo_terms(error, instances_key) from None
    return str(e.value)


def test_layout_errors_use_nemos_argument_names() -> None:
    # num_distributed_optimizer_instances that does not divide DP x CP (world 8, tp 2: dp 4)
    text = _nemo_error("num_distributed_optimizer_instances", world_size=8, tp=2, num_instances=3)
    assert text.startswith("num_distributed_optimizer_instances=3: must divide the data-parallel size 4"), text
    # with CP: DP x CP is the shard domain (world 8, cp 2: dp 4, dp*cp 8)
    text = _nemo_error("num_instances", world_size=8, cp=2, num_instances=3)
    assert text.startswith("num_instances=3: must divide the data-parallel size 8 (dp*cp = 4*2)"), text
    # TP x PP x CP that does not divide the world
    text = _nemo_error("num_instances", world_size=6, tp=4)
    assert text.startswith("world size (trainer devices x num_nodes)=6: must be a multiple of tp*cp*pp = 4"), text
    assert "tensor, context and pipeline parallel sizes" in text, text
    text = _nemo_error("num_instances", world_size=4, pp=0)
    assert text.startswith("pipeline_model_parallel_size=0: must be an integer >= 1"), text


@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_strategy_checks_before_any_process_group(tmp_path: Path) -> None:
    """`CheckpointlessMegatronStrategy` under NeMo's own `nl.Trainer` (4 CPU devices), in a child process."""
    cases = [{"num_distributed_optimizer_instances": 2}, {"num_instances": 2},
             {"num_distributed_optimizer_instances": 3}, {"tensor_model_parallel_size": 3},
             {"num_instances": 2, "num_distributed_optimizer_instances": 4},
             {"ddp": {"use_distributed_optimizer": True, "overlap_param_gather": True}}]
    env = child_env(tests_on_path=True)
    proc = subprocess.run([sys.executable, str(TESTS / "scripts" / "nemo_strategy_checks.py"),
                           *(json.dumps(c) for c in cases)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, check=False)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results[0] == results[1] == {"num_instances": 2, "megatron": 2, "dp": 4}
    assert results[2] == {"error": "num_distributed_optimizer_instances=3: must divide the data-parallel size 4; "
                                   "choose 1, 2 or 4"}
    assert results[3]["error"].startswith("world size (trainer devices x num_nodes)=4: must be a multiple of "
                                          "tp*cp*pp = 3"), results[3]
    assert results[4] == {"error": "num_distributed_optimizer_instances=4: is the same knob as num_instances=2, "
                                   "and they differ; pass only one of them"}
    # megatron's overlapped parameter all-gather: at a step boundary a rank would hold only its own shard's update
    assert results[5]["error"].startswith("ddp.overlap_param_gather=True: a replica sends its parameters at a step "
                                          "boundary"), results[5]
    assert "pass DistributedDataParallelConfig(overlap_param_gather=False, ...)" in results[5]["error"], results[5]
    # The knob left to checkpointless-run's --num-instances (2 on an even world): its error names the flag; the
    # script's own knob wins over it.
    cases = [{"tensor_model_parallel_size": 4}, {"num_distributed_optimizer_instances": 1,
                                                 "tensor_model_parallel_size": 4}]
    proc = subprocess.run([sys.executable, str(TESTS / "scripts" / "nemo_strategy_checks.py"),
                           *(json.dumps(c) for c in cases)], env={**env, "NCL_NUM_INSTANCES": "2"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, check=False)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results == [{"error": "checkpointless-run --num-instances=2: must divide the data-parallel size 1; "
                                 "choose 1"}, {"num_instances": 1, "megatron": 1, "dp": 1}]


@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_apply_makes_nemos_llama3_8b_recipe_checkpointless_and_validates_it(tmp_path: Path) -> None:
    """`apply(llm.llama3_8b.pretrain_recipe(...))` composes and validates with no process: NeMo's own recipe."""
    proc = subprocess.run([sys.executable, str(TESTS / "scripts" / "nemo_recipe_checks.py")],
                          env=child_env(tests_on_path=True), cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["strategy"] and all(out["kept"].values()) and len(out["kept"]) >= 8, out
    assert out["instances"] == [2, 2] and out["distributed_optimizer"] is True
    assert out["overlap_param_gather"] is False
    assert out["callbacks"] == [False, True] and out["callbacks_after_second_apply"] == 2
    assert out["data"] == [True, True, True], "the data module is wrapped once, in MmapDataModule"
    assert out["three_instances"] == ("num_distributed_optimizer_instances=3: must divide the data-parallel size 8 "
                                      "(dp*cp = 4*2); choose 1, 2, 4 or 8")
    assert out["tp3"].startswith("world size (trainer devices x num_nodes)=8: must be a multiple of tp*cp*pp = 6")
    assert out["not_a_recipe"].startswith("recipe.trainer=None: is missing")
