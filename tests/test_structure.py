"""The structure rule: the engine below `lightning/` and `nemo/` never imports Lightning or NeMo."""

from __future__ import annotations

import subprocess
import sys

ENGINE = ["nemo_checkpointless", "nemo_checkpointless.topology", "nemo_checkpointless.state",
          "nemo_checkpointless.replication", "nemo_checkpointless.replication.checkpoint",
          "nemo_checkpointless.restart", "nemo_checkpointless.restart.recovery", "nemo_checkpointless.data.loader",
          "nemo_checkpointless.data.cache", "nemo_checkpointless.launcher.local", "nemo_checkpointless.config",
          "nemo_checkpointless.planning"]


def test_engine_imports_neither_lightning_nor_nemo() -> None:
    code = (f"import sys\nfor m in {ENGINE!r}:\n    __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'nemo'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_surface_loads_lazily() -> None:
    import nemo_checkpointless

    assert "CheckpointlessStrategy" in nemo_checkpointless.__all__
    assert nemo_checkpointless.ParallelDims(world_size=4, num_instances=2).dp == 4
