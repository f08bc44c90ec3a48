"""The main job end to end: bad input stops at start-up with one message; equal seeds give equal digests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_checkpointless.cli.train import main


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.max_stepz=5"], ["trainer.max_stepz=5", "no such key under trainer",
                                   "did you mean trainer.max_steps"]),
        (["recipe=tiny_lama_cpu"], ["recipe=tiny_lama_cpu", "no such recipe", "did you mean recipe=tiny_llama_cpu"]),
        (["replication.num_instances=3"], ["replication.num_instances=3", "must divide the data-parallel size 4",
                                           "1, 2 or 4"]),
        (["trainer.max_steps=abc"], ["trainer.max_steps=abc", "integer"]),
        (["trainer.max_steps=0"], ["trainer.max_steps=0", "must be >= 1"]),
        (["data.path=/nonexistent/corpus"], ["data.path=/nonexistent/corpus", "checkpointless-tokenize"]),
        (["'fault.plan=[{kind:kill,rank:9,step:3}]'".strip("'")], ["fault.plan[0].rank=9", "0..3"]),
        (["replication.spares=-1"], ["replication.spares=-1", "must be >= 0"]),
        (["trainer.max_steps"], ["trainer.max_steps", "key=value"]),
        (["model.n_kv_heads=3"], ["model.n_kv_heads=3", "must divide model.n_heads=4"]),
    ],
)
def test_bad_input_is_one_clear_message(overrides: list[str], expected: list[str], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*overrides, f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "logs").exists(), "no worker may start on bad input"


def test_help_and_cfg(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "tiny_llama_cpu" in capsys.readouterr().out
    assert main(["--cfg", "replication.num_instances=4", "seed=7"]) == 0
    out = capsys.readouterr().out
    assert "num_instances: 4" in out and "seed: 7" in out


def _run(tmp: Path, data_cache: str, *overrides: str) -> dict[str, object]:
    run_dir = tmp / "-".join(o.replace("=", "_") for o in overrides) if overrides else tmp / "default"
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", "trainer.max_steps=12", "trainer.progress_bar=false",
           f"data.cache_dir={data_cache}", f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["recoveries"] == []
    assert set(summary["pids"]) == {"0", "1", "2", "3"}
    return summary


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_same_seed_same_state_whatever_the_replication(tmp_path: Path, data_cache: str) -> None:
    first = _run(tmp_path, data_cache, "seed=11")
    again = _run(tmp_path / "again", data_cache, "seed=11")
    one_instance = _run(tmp_path, data_cache, "seed=11", "replication.num_instances=1")
    other_seed = _run(tmp_path, data_cache, "seed=12")
    assert first["state_sha256"] == again["state_sha256"]
    assert first["data_sha256"] == again["data_sha256"]
    # Sharding the optimizer state 4 ways instead of 2 changes nothing bitwise.
    assert first["state_sha256"] == one_instance["state_sha256"]
    assert first["data_sha256"] == one_instance["data_sha256"]
    assert other_seed["state_sha256"] != first["state_sha256"]
    assert other_seed["data_sha256"] != first["data_sha256"]
    for key in ("wall_s", "steps_per_s", "state_sha256", "data_sha256", "final_step", "recoveries", "pids"):
        assert key in first


def test_a_rank_that_fails_before_training_stops_the_job_at_once_naming_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A set-up error (here: a preloaded module whose patch makes rank 3 fail as it seeds its model) is not a fault a
    replacement survives: the launcher stops at the first failure instead of replacing the rank
    launcher.max_restarts times. (The module is imported and installed once, in the rank template every rank is
    forked from: what fails is the rank's own set-up.)"""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "broken_on_rank3.py").write_text(
        "import os\nimport torch\n\n\ndef install():\n    seed = torch.manual_seed\n\n"
        "    def manual_seed(*args, **kwargs):\n        if os.environ.get('RANK') == '3':\n"
        "            raise RuntimeError('rank 3 cannot start: boom')\n        return seed(*args, **kwargs)\n\n"
        "    torch.manual_seed = manual_seed\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))
    run_dir = tmp_path / "run"
    code = main([f"run.dir={run_dir}", "trainer.max_steps=2", "launcher.preload=[broken_on_rank3]",
                 "launcher.max_restarts=5", "trainer.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "rank(s) [3] failed before training (exit code 1)" in err, err
    assert "RuntimeError: rank 3 cannot start: boom" in err and "rank_3.0.log" in err, err
    assert sorted(p.name for p in (run_dir / "logs").glob("rank_3.*")) == ["rank_3.0.log"], "replaced anyway"
