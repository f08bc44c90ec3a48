"""`checkpointless-train recipe=NAME script=PATH 'script_args=[...]'`: a user's own training script started with the
recipe's launch settings, exactly as `checkpointless-run` starts it.

- no process: `--cfg` shows the command every rank runs and the package's variables it gets (the recipe's ranks,
  spares, replication, TP/PP/CP layout, collective timeout, checkpoint cadence, fault plan, run dir, preload), the
  same as checkpointless-run's for the same settings; script arguments reach the script as written; bad input is
  one message each, exit 2, before any process starts;
- NeMo (child processes): `CheckpointlessMegatronStrategy()` built without a layout takes the recipe's, and one
  built with a different layout stops with one ConfigError naming both; then one real job: the tiny NeMo recipe
  with parallel.tp=2 runs a user's NeMo script (`tests/scripts/user_nemo.py` with its layout arguments left out)
  on 4 ranks + 1 spare, a kill at step 5 is recovered peer to peer, and the script's strategy ran with TP=2;
- Lightning (child processes): the default recipe runs a user's Lightning script through the same path, with a
  preload module imported (its `install()` called) in every process before the script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import child_env, finish_job

from nemo_checkpointless.cli import run as run_cli
from nemo_checkpointless.cli.compose import compose
from nemo_checkpointless.cli.train import main, script_environment, script_launch
from nemo_checkpointless.protocol import CP_ENV, NUM_INSTANCES_ENV, PP_ENV, TP_ENV

ROOT = Path(__file__).resolve().parent.parent
NEMO_SCRIPT = ROOT / "tests" / "scripts" / "user_nemo.py"
LIGHTNING_SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 400


def _cfg_view(capsys: pytest.CaptureFixture[str], *overrides: str) -> dict[str, Any]:
    assert main([*overrides, "--cfg"]) == 0
    view: dict[str, Any] = yaml.safe_load(capsys.readouterr().out)
    return view


# ---------------------------------------------------------------------------------------------------- no process
def test_cfg_shows_the_recipes_launch_settings_and_the_environment_the_script_gets(
        capsys: pytest.CaptureFixture[str]) -> None:
    view = _cfg_view(capsys, "recipe=llama3_8b", f"script={NEMO_SCRIPT}", "script_args=[--max-steps,8,--lr,3e-4]")
    assert view["command"] == [sys.executable, "-u", str(NEMO_SCRIPT), "--max-steps", "8", "--lr", "3e-4"]
    launch = view["launch"]
    assert (launch["trainer.devices"], launch["trainer.num_nodes"], launch["ranks"]) == (8, 2, 16)
    assert (launch["parallel.tp"], launch["parallel.pp"], launch["parallel.cp"]) == (2, 1, 2)
    assert launch["replication.num_instances"] == 2 and launch["replication.spares"] == 0
    env = view["environment"]
    assert (env[TP_ENV], env[PP_ENV], env[CP_ENV], env[NUM_INSTANCES_ENV]) == ("2", "1", "2", "2")
    assert env["NCL_COLLECTIVE_TIMEOUT_S"] == "30.0" and env["NCL_CHECKPOINT_EVERY_N_STEPS"] == "0"
    assert env["NCL_RUN_DIR"] == str((Path.cwd() / "runs" / "llama3_8b").absolute())
    assert "NCL_FAULT_PLAN" not in env
    # The recipe's model, data and optimizer are the script's own business: said, not passed.
    assert {"model", "optim", "trainer.max_steps"} <= set(view["not_passed"])
    assert not any(k.startswith(("model", "data", "optim")) for k in launch)


def test_the_launch_is_checkpointless_runs_for_the_same_settings(tmp_path: Path) -> None:
    """The recipe path and `checkpointless-run` give the script the same command and the same launcher variables;
    the recipe path adds its layout (and replication, also when it is 1)."""
    run_dir = str(tmp_path / "job")
    cfg = compose(["recipe=tiny_llama_nemo", f"script={NEMO_SCRIPT}", "script_args=[--max-steps,8]",
                   "replication.spares=1", "launcher.collective_timeout_s=8", "launcher.max_restarts=2",
                   "checkpoint.every_n_steps=5", "fault.plan=[{kind:kill,rank:1,step:500}]", f"run.dir={run_dir}"])
    command = script_launch(cfg)
    args = run_cli.build_parser().parse_args(
        ["--nproc-per-node", "4", "--spares", "1", "--num-instances", "2", "--collective-timeout", "8",
         "--max-restarts", "2", "--checkpoint-every", "5", "--fault", "kill:1:500", "--run-dir", run_dir,
         str(NEMO_SCRIPT), "--max-steps", "8"])
    run_cfg, run_command = run_cli._config(args), run_cli._command(args)
    assert command == run_command
    ours, theirs = script_environment(cfg, command), script_environment(run_cfg, run_command)
    layout = {TP_ENV: "1", PP_ENV: "1", CP_ENV: "1"}
    assert ours == {**theirs, **layout} and json.loads(ours["NCL_FAULT_PLAN"]) == [{"kind": "kill", "rank": 1,
                                                                                   "step": 500}]
    # What the launcher itself reads: ranks, spares, replication, restart budget, collective timeout.
    assert (cfg.trainer.world_size, cfg.replication, cfg.launcher.collective_timeout_s, cfg.launcher.max_restarts) \
        == (run_cfg.trainer.world_size, run_cfg.replication, run_cfg.launcher.collective_timeout_s,
            run_cfg.launcher.max_restarts)
    assert ours[NUM_INSTANCES_ENV] == "2"
    one = compose(["recipe=tiny_llama_nemo", f"script={NEMO_SCRIPT}", "replication.num_instances=1", "parallel.pp=2"])
    env = script_environment(one, script_launch(one))
    assert {k: env[k] for k in (TP_ENV, PP_ENV, CP_ENV, NUM_INSTANCES_ENV)} == {TP_ENV: "1", PP_ENV: "2", CP_ENV: "1",
                                                                               NUM_INSTANCES_ENV: "1"}


def test_preload_modules_run_before_the_script() -> None:
    cfg = compose(["recipe=tiny_llama_nemo", f"script={NEMO_SCRIPT}", "launcher.preload=[nemo_shim,json]",
                   "script_args=[--max-steps,8]"])
    command = script_launch(cfg)
    assert command[:3] == [sys.executable, "-u", "-c"] and command[4:] == ["nemo_shim,json", str(NEMO_SCRIPT),
                                                                          "--max-steps", "8"]


def test_script_arguments_reach_the_script_as_written() -> None:
    cfg = compose([f"script={LIGHTNING_SCRIPT}", "script_args=[--lr=3e-3, true ,08,1e-4,'a, b',\"it's\"]"])
    assert cfg.script_args == ["--lr=3e-3", "true", "08", "1e-4", "a, b", "it's"]
    assert compose([f"script={LIGHTNING_SCRIPT}", "script_args=[--seed,${seed}]"]).script_args == ["--seed", "1234"]
    assert compose([f"script={LIGHTNING_SCRIPT}", "script_args=[]"]).script_args == []


@pytest.mark.parametrize(("overrides", "expected"), [
    (["recipe=tiny_llama_nemo", "script=no/such/train.py"],
     ["script=no/such/train.py: is not a file", "give the path of your training script"]),
    ([f"script={LIGHTNING_SCRIPT}", "script_args=--max-steps"],
     ["script_args=--max-steps: must be a list", "'script_args=[--max-steps,8]'"]),
    ([f"script={LIGHTNING_SCRIPT}", "--max-steps", "8"],
     ["override=--max-steps: is not of the form key=value", "script_args=[...]"]),
    (["script_args=[--max-steps,8]"], ["script_args=[--max-steps,8]: are the arguments of a script=PATH",
                                       "add script=path/to/train.py"]),
    ([f"script={LIGHTNING_SCRIPT}", "script_args=[[1,2]]"], ["script_args[0]=[1, 2]: must be one argument",
                                                             "quote it"]),
    ([f"script={LIGHTNING_SCRIPT}", "parallel.tp=2"],
     ["parallel.tp=2: recipe=tiny_llama_cpu is engine=lightning, whose CheckpointlessStrategy is data-parallel "
      "only", "use parallel.tp=1, or a NeMo recipe"]),
    (["recipe=llama3_8b", f"script={NEMO_SCRIPT}"],
     ["trainer.num_nodes=2: needs one agent per node", "launcher.target=k8s", "launcher.rdzv_endpoint=HOST:PORT"]),
    ([f"script={LIGHTNING_SCRIPT}", "launcher.preload=[no_such_module_here]"],
     ["launcher.preload[0]=no_such_module_here: is not an importable module here"]),
])
def test_bad_input_is_one_clear_message(overrides: list[str], expected: list[str], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*overrides, f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("checkpointless-train: error: "), err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not (tmp_path / "logs").exists(), "no process may start on bad input"


def test_a_fault_may_come_after_the_recipes_max_steps() -> None:
    """trainer.max_steps is not passed to the script (it runs its own number of steps)."""
    cfg = compose([f"script={LIGHTNING_SCRIPT}", "fault.plan=[{kind:kill,rank:1,step:5000}]"])
    assert cfg.trainer.max_steps == 200 and cfg.fault.plan[0].step == 5000


# ------------------------------------------------------------------------------------------------- NeMo processes
@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_nemo_strategy_takes_the_recipes_layout_and_refuses_another(tmp_path: Path) -> None:
    """`tests/scripts/nemo_strategy_checks.py` builds `CheckpointlessMegatronStrategy(**case)` under a 4-device CPU
    `nl.Trainer` with the variables `checkpointless-train recipe=tiny_llama_nemo parallel.tp=2 script=...` sets."""
    cfg = compose(["recipe=tiny_llama_nemo", f"script={NEMO_SCRIPT}", "parallel.tp=2"])
    extra = {k: v for k, v in script_environment(cfg, script_launch(cfg)).items()
             if k in (TP_ENV, PP_ENV, CP_ENV, NUM_INSTANCES_ENV)}
    cases = [{}, {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 1},
             {"pipeline_model_parallel_size": 2}]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "nemo_strategy_checks.py"),
                           *(json.dumps(c) for c in cases)], env={**child_env(tests_on_path=True), **extra},
                          cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(cases), proc.stdout[-3000:] + proc.stderr[-3000:]
    # No layout argument: TP=2 from the recipe, so DP = 4 / 2 = 2 (and N=2 from replication.num_instances).
    assert results[0] == results[1] == {"num_instances": 2, "megatron": 2, "dp": 2}
    assert results[2] == {"error": "tensor_model_parallel_size=1: the script's CheckpointlessMegatronStrategy("
                                   "tensor_model_parallel_size=1) differs from the recipe's parallel.tp=2 "
                                   "(checkpointless-train recipe=... script=...); drop tensor_model_parallel_size= "
                                   "from the script to take the recipe's, or run with parallel.tp=1"}
    assert results[3]["error"].startswith("pipeline_model_parallel_size=2: the script's "), results[3]
    assert "the recipe's parallel.pp=1" in results[3]["error"], results[3]


def _script_without_layout(tmp_path: Path) -> Path:
    """`tests/scripts/user_nemo.py` with its `--tp`/`--pp` arguments left out of the strategy: a user's script that
    builds `CheckpointlessMegatronStrategy` without a layout (the recipe's is then the one it runs)."""
    source = NEMO_SCRIPT.read_text()
    layout = "tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, "
    assert source.count(layout) == 1, "tests/scripts/user_nemo.py changed: update this test's layout removal"
    path = tmp_path / "user_nemo_no_layout.py"
    path.write_text(source.replace(layout, ""))
    return path


@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_recipe_runs_a_users_nemo_script_with_its_layout_and_recovers_a_kill(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", "recipe=tiny_llama_nemo",
           f"script={_script_without_layout(tmp_path)}", "script_args=[--max-steps,8]", "parallel.tp=2",
           "replication.spares=1", "fault.plan=[{kind:kill,rank:1,step:5}]", "launcher.collective_timeout_s=8",
           "launcher.max_restarts=2", "launcher.preload=[nemo_shim]", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, env=child_env(tests_on_path=True), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    summary = finish_job(proc, run_dir, "nemo_rank{r}.json", TIMEOUT_S)
    assert summary["recipe"] == "tiny_llama_nemo" and summary["world_size"] == 4, summary
    assert summary["spares"] == 1 and summary["num_instances"] == 2 and summary["final_step"] == 8, summary
    (record,) = summary["recoveries"]
    assert record["failed_ranks"] == [1] and record["fault_kind"] == "kill", record
    assert record["path"] == "p2p" and record["resumed_from_step"] == 4 and record["steps_lost"] == 0, record
    assert record["replacement"]["1"] in ("warm spare", "starting spare"), record
    # TP=2 (tp-cp-ep-dp-pp order): ranks 0 and 2 hold one half of every layer, ranks 1 and 3 the other half; with
    # TP=1 all four would hold the same parameters.
    params = {r: summary["ranks"][r]["params_sha256"] for r in range(4)}
    assert params[0] == params[2] and params[1] == params[3] and params[0] != params[1], params


# -------------------------------------------------------------------------------------------- Lightning processes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_recipe_runs_a_users_lightning_script_with_a_preload_module(tmp_path: Path) -> None:
    run_dir, probe = tmp_path / "job", tmp_path / "probe"
    probe.mkdir()
    # A preload module of the user's: its install() leaves a file per process, before the script runs.
    (probe / "ncl_probe.py").write_text(
        "import os, sys\n\n\ndef install():\n"
        "    assert 'lightning' not in sys.modules, 'the script ran first'\n"
        "    open(os.path.join(os.environ['NCL_RUN_DIR'], f'preloaded_{os.getpid()}'), 'w').close()\n")
    env = child_env()
    env["PYTHONPATH"] = ":".join(filter(None, [str(probe), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", f"script={LIGHTNING_SCRIPT}",
           "script_args=[--max-steps,6]", "fault.plan=[{kind:kill,rank:1,step:3}]", "launcher.collective_timeout_s=8",
           "launcher.preload=[ncl_probe]", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    summary = finish_job(proc, run_dir, "user_rank{r}.json", 240)
    assert summary["recipe"] == "tiny_llama_cpu" and summary["final_step"] == 6 and summary["num_instances"] == 2
    (record,) = summary["recoveries"]
    assert record["failed_ranks"] == [1] and record["path"] == "p2p", record
    pids = {p for procs in summary["pids"].values() for p in procs}
    preloaded = {int(p.name.split("_")[1]) for p in run_dir.glob("preloaded_*")}
    # Every rank and spare is forked from the rank template (restart.script_runner), which installed the preload
    # (before Lightning: the probe's assertion) and says so once, under its own pid; they inherit it.
    forked = {int(p.stem) for p in (run_dir / "forked").glob("*.json")}
    assert pids <= forked and len(preloaded - pids) == 1, "a process missed the preload"
