"""The structure rules: the engine below `lightning/` and `nemo/` never imports Lightning or NeMo; `replication/`
and `restart/` do not import each other; `state/` imports neither."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = ["nemo_checkpointless", "nemo_checkpointless.topology", "nemo_checkpointless.state",
          "nemo_checkpointless.replication", "nemo_checkpointless.state.checkpoint",
          "nemo_checkpointless.restart", "nemo_checkpointless.restart.recovery", "nemo_checkpointless.data.loader",
          "nemo_checkpointless.data.cache", "nemo_checkpointless.launcher.local", "nemo_checkpointless.config",
          "nemo_checkpointless.planning"]


def test_engine_imports_neither_lightning_nor_nemo() -> None:
    code = (f"import sys\nfor m in {ENGINE!r}:\n    __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'nemo'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _imported_packages(modules: list[str]) -> set[str]:
    """The `nemo_checkpointless` subpackages loaded by importing `modules` in a fresh interpreter."""
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules\n"
            "                       if m.startswith('nemo_checkpointless.') and m.count('.') >= 1})))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return set(proc.stdout.split())


def _modules_of(package: str) -> list[str]:
    root = Path(__file__).resolve().parents[1] / "nemo_checkpointless" / package
    return [f"nemo_checkpointless.{package}.{p.stem}" for p in sorted(root.glob("*.py")) if p.stem != "__init__"]


@pytest.mark.parametrize(("package", "forbidden"), [("restart", {"replication"}), ("replication", {"restart"}),
                                                    ("state", {"replication", "restart"})])
def test_layers_do_not_import_each_other(package: str, forbidden: set[str]) -> None:
    modules = _modules_of(package)
    assert modules, package
    loaded = _imported_packages(modules)
    assert package in loaded and not loaded & forbidden, (package, sorted(loaded))


LAZY = """
import json, sys
HEAVY = ("torch", "lightning", "pytorch_lightning", "nemo", "megatron")
def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] in HEAVY or m.startswith("nemo_checkpointless."))
import nemo_checkpointless
out = {"on_import": loaded(), "all": nemo_checkpointless.__all__}
out["dp"] = nemo_checkpointless.ParallelDims(world_size=4, num_instances=2).dp
out["after_dims"] = loaded()
out["strategy"] = nemo_checkpointless.CheckpointlessStrategy.__module__
out["lightning_after_strategy"] = "lightning" in sys.modules
try:
    nemo_checkpointless.NoSuchName
except AttributeError as e:
    out["missing"] = str(e)
print(json.dumps(out))
"""


def test_public_surface_loads_lazily() -> None:
    """In a fresh interpreter (this one has imported everything already): importing the package loads none of its
    subpackages, nor torch, Lightning or NeMo; a public name loads its own module when first touched, and only what
    that module needs (ParallelDims: no Lightning); a Lightning name then loads Lightning."""
    proc = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["on_import"] == [], out
    assert "CheckpointlessStrategy" in out["all"] and out["dp"] == 4, out
    heavy = [m for m in out["after_dims"] if not m.startswith("nemo_checkpointless.") and m.split(".")[0] != "torch"]
    assert "nemo_checkpointless.topology" in out["after_dims"] and heavy == [], out["after_dims"]
    assert not any(m.startswith("nemo_checkpointless.lightning") for m in out["after_dims"]), out["after_dims"]
    assert out["strategy"] == "nemo_checkpointless.lightning.strategy" and out["lightning_after_strategy"], out
    assert out["missing"] == "module 'nemo_checkpointless' has no attribute 'NoSuchName'", out
