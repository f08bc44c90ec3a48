"""The rank template (`restart.script_runner` under `restart.template`): a process forked from it runs a Python
command as a new interpreter would. Real template, real forks: each command below is run both ways, forked and as
`python ...`, and what it saw (argv, `__name__`, `sys.path[0]`, its environment, fresh `random` and torch seeds)
and how it ended (exit code, `atexit`, non-daemon threads, an idle thread pool, output) must be the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import child_env

from nemo_checkpointless.launcher.procs import rank_pids
from nemo_checkpointless.protocol import RUN_DIR_ENV

SCRIPT = '''\
import atexit, json, os, random, sys, threading, time
import torch
out = os.environ["PROBE_OUT"]
seen = {"argv": sys.argv, "name": __name__, "path0": sys.path[0], "rank": os.environ.get("RANK"),
        "draw": random.random(), "torch_seed": torch.initial_seed(), "template_vars":
        sorted(k for k in os.environ if k.startswith("NCL_TEMPLATE") or k == "NCL_PYTHON_ARGV")}
with open(out + ".json", "w") as f:
    json.dump(seen, f)
atexit.register(lambda: open(out + ".atexit", "w").close())
def late():
    time.sleep(0.3)
    open(out + ".thread", "w").close()
threading.Thread(target=late).start()
# A thread pool left running, as libraries leave theirs: its idle worker ends only by threading's exit hook.
import concurrent.futures
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(time.sleep, 0.01).result()
print("to stdout", flush=True)
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError("boom")
if mode == "message":
    sys.exit("a message")
'''


# What both drivers start with: a child subreaper (as the launcher is; pytest must not become one) with a rank
# template, its log in argv[1].
DRIVER_SETUP = """
import json, os, sys, time
from nemo_checkpointless.launcher.spares import SpareFactory
from nemo_checkpointless.restart.kin import become_child_subreaper
from nemo_checkpointless.restart import script_runner
tmp = sys.argv[1]
assert become_child_subreaper()
base = json.loads(os.environ["PROBE_BASE"])
log = os.fdopen(os.open(os.path.join(tmp, "template.log"), os.O_WRONLY | os.O_CREAT, 0o600), "wb")
factory = SpareFactory(script_runner.__name__, {**base, **script_runner.template_env([], "lightning")}, log)
log.close()
"""

# The launcher's side, in a process of its own (it becomes a child subreaper, which pytest must not): fork each
# mode from one template, print {mode: [pid, exit code]}.
DRIVER = DRIVER_SETUP + """
script, modes = sys.argv[2], sys.argv[3].split(",")
forked = {}
for i, mode in enumerate(modes):
    env = {**base, "RANK": str(i), "PROBE_OUT": os.path.join(tmp, "forked-" + mode),
           script_runner.ARGV_ENV: json.dumps(["-u", script, mode])}
    forked[mode] = factory.fork(env, os.path.join(tmp, mode + ".log"), spawn=lambda: None, replace_env=True)
deadline = time.monotonic() + 120
while any(p.pid < 0 for p in forked.values()) and time.monotonic() < deadline and not factory.failed:
    time.sleep(0.01)
assert factory.failed is None, factory.failed
out = {mode: [p.pid, p.wait()] for mode, p in forked.items()}
factory.close()
print(json.dumps(out))
"""


def _fresh(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, check=False, timeout=120).returncode


def test_a_forked_process_runs_a_command_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cases = {"ok": 0, "exit3": 3, "raise": 1, "message": 1}
    driver_env = child_env()
    base = {**driver_env, RUN_DIR_ENV: str(run_dir)}
    driver = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(script), ",".join(cases)],
                            env={**driver_env, "PROBE_BASE": json.dumps(base)}, capture_output=True, check=False,
                            timeout=240)
    assert driver.returncode == 0, driver.stderr.decode(errors="replace")[-3000:]
    result = json.loads(driver.stdout.decode().strip().splitlines()[-1])
    assert {mode: code for mode, (_, code) in result.items()} == cases
    # The same commands as new interpreters.
    for i, mode in enumerate(cases):
        env = {**base, "RANK": str(i), "PROBE_OUT": str(tmp_path / f"fresh-{mode}")}
        assert _fresh(["-u", str(script), mode], env) == cases[mode]
    draws = set()
    for mode in cases:
        forked_seen = json.loads((tmp_path / f"forked-{mode}.json").read_text())
        fresh_seen = json.loads((tmp_path / f"fresh-{mode}.json").read_text())
        draws.add((forked_seen.pop("draw"), forked_seen.pop("torch_seed")))
        fresh_seen.pop("draw"), fresh_seen.pop("torch_seed")
        assert forked_seen == fresh_seen, mode
        assert forked_seen["template_vars"] == [] and forked_seen["name"] == "__main__"
        assert forked_seen["path0"] == str(script.parent)
        for suffix in (".atexit", ".thread"):
            assert (tmp_path / f"forked-{mode}{suffix}").exists(), (mode, suffix)
    assert len({d for d, _ in draws}) == len({t for _, t in draws}) == len(cases), "reseeded in every forked process"
    logs = {mode: (tmp_path / f"{mode}.log").read_text() for mode in cases}
    assert all("to stdout" in text for text in logs.values())
    assert "ValueError: boom" in logs["raise"] and "a message" in logs["message"]
    # Each forked process said which rank it is, for `procs.rank_pids` (none is alive any more: none is listed).
    records = {int(p.stem): json.loads(p.read_text())["env"]["RANK"] for p in (run_dir / "forked").glob("*.json")}
    assert records == {result[mode][0]: str(i) for i, mode in enumerate(cases)}
    assert rank_pids(run_dir) == {}


# A kill the launcher sends before the template has forked the process (a whole restart right after a spare was
# asked for): the process is killed once forked, and `wait()` returns when it is gone, not before.
KILL_DRIVER = DRIVER_SETUP + """
def fork(code):
    env = {**base, script_runner.ARGV_ENV: json.dumps(["-u", "-c", code])}
    return factory.fork(env, os.path.join(tmp, "p.log"), spawn=lambda: None, replace_env=True)
sleeper = fork("import time; time.sleep(120)")
sleeper.kill()
unknown_at_kill = factory.pid_of(sleeper.request_id) is None  # the template is still importing
t0 = time.monotonic()
code = sleeper.wait()
waited = time.monotonic() - t0
try:
    os.kill(sleeper.pid, 0)
    alive = True
except ProcessLookupError:
    alive = False
after = fork("raise SystemExit(7)")
out = {"unknown_at_kill": unknown_at_kill, "code": code, "pid": sleeper.pid, "alive": alive,
       "waited": waited, "after": after.wait()}
factory.close()
print(json.dumps(out))
"""


def test_a_process_killed_before_it_is_forked_is_killed_once_forked(tmp_path: Path) -> None:
    driver_env = child_env()
    base = {**driver_env, RUN_DIR_ENV: str(tmp_path)}
    driver = subprocess.run([sys.executable, "-c", KILL_DRIVER, str(tmp_path)],
                            env={**driver_env, "PROBE_BASE": json.dumps(base)}, capture_output=True, check=False,
                            timeout=240)
    assert driver.returncode == 0, driver.stderr.decode(errors="replace")[-3000:]
    result = json.loads(driver.stdout.decode().strip().splitlines()[-1])
    assert result["unknown_at_kill"], result
    # wait() waited for the fork and the kill, and nothing of it is left running: -9, the kill's status (a sleeper
    # that slept out its 120 s would have exited 0), however long the template took to import before it forked.
    assert result["code"] == -9 and result["pid"] > 0 and not result["alive"], result
    # The template forks on: a later process runs and exits as it should.
    assert result["after"] == 7, result
