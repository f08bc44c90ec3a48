"""The structure rules: the engine below `lightning/` and `nemo/` never imports Lightning or NeMo (nor does
`megatron/`, megatron-core's side, which a Megatron-Bridge or Megatron-LM door reuses); `replication/`
and `restart/` do not import each other; `state/` imports neither; no two modules of the package import each other,
directly or around a loop (what runs: imports at module level and inside functions; a name imported for the type
checker only, under `if TYPE_CHECKING:`, runs nothing)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = ["nemo_checkpointless", "nemo_checkpointless.topology", "nemo_checkpointless.state",
          "nemo_checkpointless.replication", "nemo_checkpointless.state.checkpoint",
          "nemo_checkpointless.restart", "nemo_checkpointless.restart.recovery", "nemo_checkpointless.restart.runtime",
          "nemo_checkpointless.replication.participant", "nemo_checkpointless.data.loader",
          "nemo_checkpointless.data.cache", "nemo_checkpointless.launcher.local", "nemo_checkpointless.config",
          "nemo_checkpointless.planning", "nemo_checkpointless.megatron.participant",
          "nemo_checkpointless.megatron.groups", "nemo_checkpointless.megatron.numerics",
          "nemo_checkpointless.megatron.digest", "nemo_checkpointless.megatron.data",
          "nemo_checkpointless.megatron.export", "nemo_checkpointless.restart.step",
          "nemo_checkpointless.restart.channel"]


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


PACKAGE = Path(__file__).resolve().parents[1] / "nemo_checkpointless"


def _module_name(path: Path) -> str:
    parts = ["nemo_checkpointless", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports when it runs (not under `if TYPE_CHECKING:`); a package's
    `__init__` counts only where it is imported itself (`from pkg import name` loads `pkg`, or `pkg.name`)."""
    me = _module_name(path)
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in modules and m != me}


def test_no_module_imports_itself_around_a_loop() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _runtime_imports(p, set(paths)) for m, p in paths.items()}
    assert graph["nemo_checkpointless.lightning.strategy"], "the walk found no import: it reads nothing"
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.rsplit(".", 1)[0] == m or m.rsplit(".", 1)[0] == n:
                continue  # a package and its own module (`__init__` handing a name on)
            if state.get(n) == 1:
                cycles.append([*trail[trail.index(n):], n])
            elif n not in state:
                walk(n, [*trail, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


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
