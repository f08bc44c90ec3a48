"""Test hygiene: a test fails (an error at its teardown) when it leaks a child process, a non-daemon thread, an
initialized default process group or a change to `os.environ`. In-process restart is all about leftovers, so the
tests must not leave any either.

Also skips `gpu` tests without CUDA and `nemo` tests without NeMo, runs the session with `OMP_NUM_THREADS=1`
(CPU kernels on the two cores of CI, and bitwise-reproducible results), and with `--timeout-cap=S` (the PR tier of
`scripts/test.sh`) lowers every test's timeout to at most S seconds (`--timeout-cap-nemo` for `nemo`-marked ones),
so that a hung test costs minutes, not the CI run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

_SET_OMP = "OMP_NUM_THREADS" not in os.environ
if _SET_OMP:
    # Before torch is imported (by this file's fixtures or any test module): torch sizes its pool from it.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_THREAD_GRACE_S = 2.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nemo_checkpointless")
    group.addoption("--timeout-cap", type=float, default=None, metavar="S",
                    help="lower every test's timeout (pytest-timeout) to at most S seconds")
    group.addoption("--timeout-cap-nemo", type=float, default=None, metavar="S",
                    help="the same for `nemo`-marked tests (default: --timeout-cap)")


def _timeout_of(item: pytest.Item, config: pytest.Config) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = config.getini("timeout")
    return float(value) if value not in (None, "") else None


def _cap_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    cap = config.getoption("timeout_cap")
    if cap is None:
        return
    cap_nemo = config.getoption("timeout_cap_nemo") or cap
    for item in items:
        limit = cap_nemo if item.get_closest_marker("nemo") else cap
        current = _timeout_of(item, config)
        if current is None or current <= 0 or current > limit:
            item.add_marker(pytest.mark.timeout(limit), append=False)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SET_OMP:
        os.environ.pop("OMP_NUM_THREADS", None)


def _mark_full_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks `full` the tests tests/tiers.py names; where whole modules were collected (directories or files named,
    no single tests), an entry that names no test of a collected module is an error."""
    from tiers import FULL_ONLY

    modules = {item.path.name for item in items}
    used: set[str] = set()
    for item in items:
        test = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else ""
        for key in (item.path.name, f"{item.path.name}::{test.split('[', 1)[0]}", f"{item.path.name}::{test}"):
            if key in FULL_ONLY:
                item.add_marker(pytest.mark.full)
                used.add(key)
    stale = sorted(k for k in FULL_ONLY if k.split("::", 1)[0] in modules and k not in used)
    if stale and not any("::" in arg for arg in config.args):
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {stale}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_full_tier(config, items)
    _cap_timeouts(config, items)
    if any(item.get_closest_marker("gpu") for item in items) and not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip_gpu)
    if any(item.get_closest_marker("bench") for item in items):
        absent = [m for m in ("nvidia_resiliency_ext", "torchft", "matplotlib") if importlib.util.find_spec(m) is None]
        if absent:
            skip_bench = pytest.mark.skip(reason=f"needs the [bench] extra ({', '.join(absent)} not installed)")
            for item in items:
                if item.get_closest_marker("bench"):
                    item.add_marker(skip_bench)
    if any(item.get_closest_marker("nemo") for item in items):
        try:
            importlib.import_module("nemo")
        except Exception as e:  # not installed, or installed but broken
            skip_nemo = pytest.mark.skip(reason=f"needs the [nemo] extra (import nemo: {type(e).__name__}: {e})")
            for item in items:
                if item.get_closest_marker("nemo"):
                    item.add_marker(skip_nemo)


# ------------------------------------------------------------------------------------------------ child processes
def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the live (or zombie, i.e. unreaped) children of `pid`, from a scan of /proc."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            # "pid (comm) state ppid ...": comm may contain spaces and parentheses, so split after the last ')'.
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # it exited while we looked
        out[int(name)] = cmd or stat.split(")")[0] + ")"
    return out


def _reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    before = set(_children(os.getpid()))
    yield
    me = os.getpid()
    leaked = {p: c for p, c in _children(me).items() if p not in before}
    if leaked:
        # Kill them, so one leaky test does not fail the ones after it.
        _reap(list(leaked))
        lines = "\n".join(f"  pid {p}: {c[:200]}" for p, c in sorted(leaked.items()))
        pytest.fail(f"the test leaked {len(leaked)} child process(es) (now killed):\n{lines}", pytrace=False)


# ------------------------------------------------------------------------------------------------------- threads
@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    new = [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
    deadline = time.monotonic() + _THREAD_GRACE_S
    for t in new:  # a thread that is just finishing is not a leak
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in new if t.is_alive()]
    if alive:
        names = ", ".join(f"{t.name} (ident {t.ident})" for t in alive)
        pytest.fail(f"the test left {len(alive)} non-daemon thread(s) running: {names}", pytrace=False)


# ------------------------------------------------------------------------------------------------- process group
@pytest.fixture(autouse=True)
def no_default_process_group() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left torch.distributed's default process group initialized (now destroyed); "
                    "build groups with nemo_checkpointless.restart.groups.Membership, or destroy it",
                    pytrace=False)


# ---------------------------------------------------------------------------------------------------- os.environ
# Not leaks of a test: pytest rewrites PYTEST_CURRENT_TEST around every phase; torch sets TORCHINDUCTOR_CACHE_DIR
# once per process when torch._dynamo is first imported (lazily, e.g. by the first optimizer step).
_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED}


@pytest.fixture(autouse=True)
def no_environ_changes() -> Iterator[None]:
    before = _environ()
    yield
    after = _environ()
    if after == before:
        return
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    for key in added:
        del os.environ[key]
    os.environ.update({k: before[k] for k in removed + changed})
    pytest.fail(f"the test changed os.environ (now restored): added {added}, removed {removed}, changed {changed}; "
                "use monkeypatch.setenv / monkeypatch.delenv", pytrace=False)
