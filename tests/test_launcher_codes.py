"""How the launcher reads its ranks' exits (`_Job.exit_codes`), on real processes and a real store: a rank killed
after its training ended and its results were written (it set `finished_key`) counts as finished, not as a fault
to recover; one killed before that is a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nemo_checkpointless.config import Config
from nemo_checkpointless.launcher.local import _Job, _Proc, host_store

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
