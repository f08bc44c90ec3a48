"""How the launcher reads its ranks' exits (`_Job.exit_codes`), on real processes and a real store: a rank killed
after its training ended and its results were written (it set `finished_key`) counts as finished, not as a fault
to recover; one killed before that is a failure. And the priority of a spare refilled while the job trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_checkpointless.config import Config
from nemo_checkpointless.launcher.local import _Job, _Proc, host_store, start_process
from nemo_checkpointless.launcher.procs import (
    REFILL_NICE,
    dying_status,
    may_restore_priority,
    proc_state,
    restore_priority,
)

RANK = """
import os, signal, sys, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
if sys.argv[2] == "finished":
    from nemo_checkpointless.protocol import finished_key
    store.set(finished_key(os.getpid()), "1")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_after_it_finished_counts_as_finished(tmp_path: Path) -> None:
    store, port = host_store("127.0.0.1", 30)
    job = _Job(Config(), tmp_path, store, port, worker_module="")
    for rank, mode in enumerate(("finished", "failed")):
        popen = subprocess.Popen([sys.executable, "-c", RANK, str(port), mode])
        popen.wait(timeout=60)
        job.ranks[rank] = _Proc(popen, None, None)
    assert {r: p.popen.returncode for r, p in job.ranks.items()} == {0: -9, 1: -9}
    assert job.exit_codes() == {0: 0, 1: -9}
    assert job.finished_late == {0}


def _nice(pid: int) -> list[int]:
    """The nice value of every thread of `pid` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.skipif(not may_restore_priority(), reason="this user may not lower a nice value again (not root, "
                    "RLIMIT_NICE < 20): the launcher then starts refilled spares at normal priority")
def test_a_refilled_spare_runs_niced_until_it_takes_a_rank(tmp_path: Path) -> None:
    # A real process with threads of its own (torch's, and one it starts), started as the launcher starts a refill,
    # then given back its priority as the launcher does when the spare takes a rank.
    code = ("import torch, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "print('ready', flush=True); time.sleep(60)")
    log = tmp_path / "spare.log"
    popen, out = start_process([sys.executable, "-c", code], dict(os.environ), log, REFILL_NICE)
    try:
        while "ready" not in log.read_text():  # torch imported, the thread started (pytest's timeout bounds it)
            assert popen.poll() is None, log.read_text()
            time.sleep(0.05)
        assert len(_nice(popen.pid)) >= 2 and set(_nice(popen.pid)) == {REFILL_NICE}, _nice(popen.pid)
        restore_priority(popen.pid)
        assert set(_nice(popen.pid)) == {0}, _nice(popen.pid)
    finally:
        popen.kill()
        popen.wait()
        assert out is not None
        out.close()


def _zombie(code: str) -> subprocess.Popen[bytes]:
    """A child that ran `code` and exited, left unreaped: its exit has begun (and ended) but `wait` was not called."""
    popen = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while (state := proc_state(popen.pid)) is None or state[0] != "Z":
        assert time.monotonic() < deadline, f"{code!r} did not exit"
        time.sleep(0.01)
    return popen


def test_a_dying_process_shows_its_failure_before_it_can_be_reaped() -> None:
    # The launcher declares a fault from /proc as soon as a rank's exit begins (`dying_status`), not once the kernel
    # has freed its memory (0.19 s for a 0.9 GB rank here). Read here in the state a zombie keeps of its exit.
    cases = {"import os, signal; os.kill(os.getpid(), signal.SIGKILL)": -9,
             "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)": -11,
             "raise SystemExit(3)": 3,
             "pass": None}  # an exit 0 is left to `poll`: a finished rank, or one that left early (`left_early`)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert dying_status(live.pid) is None
        for code, expected in cases.items():
            popen = _zombie(code)
            assert dying_status(popen.pid) == expected, code
            assert popen.wait() == (expected or 0)  # the status it is reaped with is the one read before
    finally:
        live.kill()
        live.wait()


WARM_AGAIN = """
import json, os, sys
from nemo_checkpointless.restart.template import SPARE_REFILL_ENV, warm_up_again_on_this_thread
seen = []
def fn():
    seen.append(os.getpriority(os.PRIO_PROCESS, 0))
    if sys.argv[1] == "raise":
        raise ValueError("boom")
try:
    ran = warm_up_again_on_this_thread(fn)
except ValueError:
    ran = "raised"
print(json.dumps({"ran": ran, "during": seen, "after": os.getpriority(os.PRIO_PROCESS, 0)}))
"""


@pytest.mark.skipif(not may_restore_priority(), reason="this user may not lower a nice value again (not root, "
                    "RLIMIT_NICE < 20): a refill then skips its second warm-up")
@pytest.mark.parametrize(("refill", "mode", "expected"), [
    ("1", "ok", {"ran": True, "during": [REFILL_NICE], "after": 0}),
    ("1", "raise", {"ran": "raised", "during": [REFILL_NICE], "after": 0}),
    ("0", "ok", {"ran": True, "during": [0], "after": 0}),
])
def test_a_forked_spares_second_warm_up_runs_niced_when_it_refills_and_trains_at_its_priority_after(
        refill: str, mode: str, expected: dict[str, object]) -> None:
    """`restart.template.warm_up_again_on_this_thread`, in a real process: a refill's warm-up runs at nice 19 on the
    thread that will train, which is back at its priority afterwards, an error or not."""
    from nemo_checkpointless.restart.template import SPARE_REFILL_ENV

    out = subprocess.run([sys.executable, "-c", WARM_AGAIN, mode], env={**os.environ, SPARE_REFILL_ENV: refill},
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
