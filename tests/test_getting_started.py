"""The tier-3 snippet of docs/getting_started.md (`# train.py`), run as shown under `checkpointless-run`: once
without a fault and once with a rank killed at step 10; both end at step 30 with the same state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _snippet() -> str:
    text = (ROOT / "docs" / "getting_started.md").read_text()
    start = text.index("```python\n# train.py")
    return text[start + len("```python\n") : text.index("```", start + 10)]


@pytest.mark.timeout(600)
def test_the_tier3_snippet_runs_as_shown_and_recovers_equal(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_snippet())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    summaries = []
    for name, extra in (("clean", []), ("fault", ["--fault", "kill:1:10"])):
        cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--spares", "1",
               "--run-dir", str(tmp_path / name), *extra, "train.py"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300, check=False)
        assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")[-4000:]
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    clean, fault = summaries
    assert clean["final_step"] == fault["final_step"] == 30
    assert fault["state_sha256"] == clean["state_sha256"]
    [recovery] = fault["recoveries"]
    assert recovery["path"] == "p2p" and recovery["step"] == 10 and recovery["steps_lost"] == 0, recovery
