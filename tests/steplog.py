"""The ranks' own record of the steps they completed, and what a run's records must show.

Every training process appends one JSON line per completed optimizer step to RUN_DIR/steps_rank<r>.<pid>.jsonl:
`{"rank", "pid", "step", "batch", "t"}`: its rank (`trainer.global_rank`), `os.getpid()`, `trainer.global_step`
after the step, a digest of the step's batch (its micro-batches; of a `training_step(dataloader_iter)`, NeMo's, the
last one, which Lightning hands to the hooks: a repeated or skipped batch shows) and `time.monotonic()` (one clock
for every process of the machine: it orders a rank's processes, nothing else).
The line is written and the file closed before the next step starts, so a SIGKILLed rank's lines up to its death
survive; a replacement has another pid, hence its own file.

A user's script writes these lines itself (tests/scripts/user_lightning.py, user_nemo.py). The package's built-in
job gets them from `launcher.preload=[steplog]` with tests/ on PYTHONPATH (`harness.child_env(tests_on_path=True)`):
`install()`, run once in each template the launcher forks ranks and spares from (or in a process started as a new
interpreter) before any Trainer is built, adds a `StepLog` to every Trainer's callbacks. Nothing in the package
knows of it.

`assert_steps` reads a run's lines and checks them against what the test expects: (a) each rank completed steps
1..N once each, in order, except the steps a checkpoint fallback repeats (the test names them); (b) a rank the test
never killed trained in one process from its first step to its last, and a killed rank's processes followed each
other, one block of steps each; (c) each step's batch is the one the fault-free reference run trained that rank on.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from nemo_checkpointless.protocol import RUN_DIR_ENV

PRELOAD = "launcher.preload=[steplog]"  # for the built-in job (tests/ on PYTHONPATH)


def batch_digest(batch: Any) -> str:
    """sha256 of every tensor in `batch` (nested in lists, tuples and dicts) with its dtype and shape."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, Mapping):
            for key in sorted(obj, key=str):
                h.update(str(key).encode())
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)

    walk(batch)
    return h.hexdigest()[:16]


class StepLog(pl.Callback):
    """Appends this process's line to RUN_DIR/steps_rank<r>.<pid>.jsonl after each completed optimizer step."""

    def __init__(self, run_dir: str | None = None) -> None:
        self.run_dir = run_dir or os.environ[RUN_DIR_ENV]
        self._step_before = -1
        self._started: tuple[Any, str] = (None, "")  # the batch on_train_batch_start saw, and its digest
        self._batches: list[str] = []  # the digests of the micro-batches of the step in flight

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = []  # fit entered again (a checkpoint fallback): a step begun before it never completed

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_before = trainer.global_step
        self._started = (batch, batch_digest(batch))  # before the step: what it trains on, whatever reuses it later

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # A `training_step(dataloader_iter)` (NeMo's) fetches inside the step: Lightning then passes the step's last
        # micro-batch here and the previous step's to on_train_batch_start.
        started, digest = self._started
        self._batches.append(digest if batch is started else batch_digest(batch))
        self._started = (None, "")
        if trainer.global_step == self._step_before:
            return  # a micro-batch that did not complete a step (gradient accumulation)
        batches, self._batches = self._batches, []
        batch = batches[0] if len(batches) == 1 else hashlib.sha256("".join(batches).encode()).hexdigest()[:16]
        line = {"rank": trainer.global_rank, "pid": os.getpid(), "step": trainer.global_step, "batch": batch,
                "t": time.monotonic()}
        path = os.path.join(self.run_dir, f"steps_rank{trainer.global_rank}.{os.getpid()}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def install() -> None:
    """Every `lightning.pytorch.Trainer` built from now on in this process (and the processes forked from it) gets a
    `StepLog` after its own callbacks. Wraps `Trainer.__init__`, Lightning's public constructor, whose arguments are
    keyword-only (Lightning 2): NeMo's `nl.Trainer` reaches it through `super().__init__`. Should Lightning take
    `callbacks` otherwise, no step is logged and every `assert_steps` fails on the missing lines."""
    init = pl.Trainer.__init__
    if getattr(init, "_steplog", False):
        return

    @functools.wraps(init)
    def __init__(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("callbacks")
        own = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
        kwargs["callbacks"] = [*own, StepLog()]
        init(self, *args, **kwargs)

    __init__._steplog = True  # type: ignore[attr-defined]
    pl.Trainer.__init__ = __init__  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------------------- reading and checks
@dataclass(frozen=True)
class Line:
    rank: int
    pid: int
    step: int
    batch: str
    t: float


def read(run_dir: Path) -> dict[int, list[Line]]:
    """Each rank's lines in the order its processes wrote them: one file per process, the files in the order of
    their first lines. A line must say the rank and pid its file's name says."""
    files: dict[int, list[list[Line]]] = {}
    for path in sorted(run_dir.glob("steps_rank*.jsonl")):
        rank, pid = (int(part) for part in path.name[len("steps_rank"):-len(".jsonl")].split("."))
        lines = [Line(**json.loads(text)) for text in path.read_text().splitlines()]
        assert lines and all((x.rank, x.pid) == (rank, pid) for x in lines), f"{path.name}: {lines[:3]}"
        files.setdefault(rank, []).append(lines)
    return {rank: [x for lines in sorted(per_pid, key=lambda lines: lines[0].t) for x in lines]
            for rank, per_pid in sorted(files.items())}


def completed_step(run_dir: Path, world_size: int = 4) -> int:
    """The step every rank of a running job has completed, from their logs (0 before each has logged one, or when a
    line is read half-written: ask again)."""
    try:
        logs = read(run_dir)
    except (ValueError, AssertionError):
        return 0
    return min(lines[-1].step for lines in logs.values()) if len(logs) == world_size else 0


def expected_steps(steps: int, replays: Iterable[tuple[int, int]] = ()) -> list[int]:
    """The steps a rank completes, in order, in a job of `steps` steps that falls back, for each `(fault step,
    checkpoint step)` of `replays`, to the checkpoint: the steps after the checkpoint before the fault run again.
    A fault recovered p2p repeats nothing: `(step, step - 1)`, or nothing at all."""
    done: list[int] = []
    next_step = 1
    for fault, checkpoint in sorted(replays):
        done += range(next_step, fault)
        next_step = checkpoint + 1
    return done + list(range(next_step, steps + 1))


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7, 8, 8, 9] -> '1-3, 7-8, 8-9': runs of consecutive steps."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "none"


def _blocks(lines: list[Line]) -> list[tuple[int, list[Line]]]:
    """Consecutive lines of one pid: (pid, its lines), in order."""
    blocks: list[tuple[int, list[Line]]] = []
    for x in lines:
        if blocks and blocks[-1][0] == x.pid:
            blocks[-1][1].append(x)
        else:
            blocks.append((x.pid, [x]))
    return blocks


def received_steps(run_dir: Path, recoveries: Iterable[Mapping[str, Any]]) -> dict[int, list[int]]:
    """The steps a rank received done instead of completing them: a rank killed in a step's parameter all-gather
    (after the step's gradient all-reduce) leaves that step complete on its replica, and its replacement starts
    from it; its instance partner, a survivor, completes that step from the replica too (rolled forward; on the
    NeMo engine outside its training loop, so no line). Read from the logs: a step missing between two consecutive
    lines of a rank (of one process or two); each must be the step a p2p recovery resumed from, of a recovery that
    replaced that rank or rolled it forward (its reason names it), so a step skipped for any other reason still
    fails `assert_steps`. A kill from outside at an unlucky moment lands there; pass the result as
    `not_completed`."""
    out: dict[int, list[int]] = {}
    recoveries = [r for r in recoveries if r["path"] == "p2p"]

    def explains(rank: int, step: int) -> bool:
        for r in recoveries:
            rolled = re.search(r"survivors \[([\d, ]+)\] lost an instance partner", r.get("reason", ""))
            mine = rank in r["failed_ranks"] or (rolled is not None and str(rank) in rolled[1].split(", "))
            if mine and r["resumed_from_step"] == step:
                return True
        return False

    for rank, lines in read(run_dir).items():
        for before, after in itertools.pairwise(lines):
            gap = list(range(before.step + 1, after.step))
            if not gap:
                continue
            assert len(gap) == 1 and explains(rank, gap[0]), (
                f"rank {rank}: no process of it completed steps {_ranges(gap)}, and no p2p recovery that replaced it "
                f"or rolled it forward resumed from there (p2p recoveries: "
                f"{[(r['failed_ranks'], r['resumed_from_step'], r['reason']) for r in recoveries]})")
            out.setdefault(rank, []).extend(gap)
    return out


def assert_steps(run_dir: Path, steps: int, *, world_size: int = 4, killed: Mapping[int, int] | None = None,
                 replays: Iterable[tuple[int, int]] = (), not_completed: Mapping[int, Collection[int]] | None = None,
                 reference: Path | None = None, final_pids: Mapping[int, int] | None = None
                 ) -> dict[int, list[Line]]:
    """What the ranks' own step logs in `run_dir` must show; returns them.

    (a) Rank r completed `expected_steps(steps, replays)` in that order, less the steps of `not_completed[r]` (a
    rank killed inside a step's parameter all-gather: its replacement receives that step's result). (b) A rank not
    in `killed` logged from one process throughout; rank r killed `killed[r]` times after it had trained logged
    from `killed[r] + 1` processes, one after the other (each pid one block of consecutive lines, the blocks in
    time order, no pid twice). (c) With `reference` (a fault-free run's directory, also logged): rank r's batch at
    each step is the one the reference trained rank r on at that step. (d) With `final_pids` (rank -> the pid that
    wrote its final record, e.g. the `os.getpid()` in a script's own end-of-training file): that process logged the
    rank's last step."""
    killed, not_completed = killed or {}, not_completed or {}
    replays = list(replays)
    logs = read(run_dir)
    assert sorted(logs) == list(range(world_size)), f"step logs of ranks {sorted(logs)} in {run_dir}"
    ref = read(reference) if reference is not None else None
    for rank, lines in logs.items():
        got = [x.step for x in lines]
        skip = set(not_completed.get(rank, ()))
        want = [s for s in expected_steps(steps, replays) if s not in skip]
        blocks = _blocks(lines)
        story = "; ".join(f"pid {pid}: steps {_ranges([x.step for x in b])}" for pid, b in blocks)
        if got != want:
            twice = sorted({s for s in got if got.count(s) > want.count(s)})
            missing = sorted({s for s in want if got.count(s) < want.count(s)})
            raise AssertionError(
                f"rank {rank} completed steps {_ranges(got)}, expected {_ranges(want)} (checkpoint fallbacks "
                f"(fault step, checkpoint): {replays or 'none'}): steps run more often than expected: "
                f"{twice or 'none'}, less often: {missing or 'none'} [{story}]")
        pids = [pid for pid, _ in blocks]
        assert len(set(pids)) == len(pids), f"rank {rank}: a process logged again after another had: {story}"
        for (_, before), (pid, after) in itertools.pairwise(blocks):
            assert before[-1].t < after[0].t, f"rank {rank}: pid {pid} logged while its predecessor did: {story}"
        if rank not in killed:
            assert len(pids) == 1, f"rank {rank}, never killed, logged its steps from {len(pids)} processes: {story}"
        else:
            assert len(pids) == killed[rank] + 1, (f"rank {rank}, killed {killed[rank]} time(s) after it had "
                                                   f"trained, logged its steps from {len(pids)} processes: {story}")
        if ref is not None:
            ref_batches = {x.step: x.batch for x in ref[rank]}
            wrong = [x.step for x in lines if x.batch != ref_batches.get(x.step)]
            assert not wrong, f"rank {rank}: the batches of steps {_ranges(wrong)} are not the reference's [{story}]"
        if final_pids is not None:
            assert lines[-1].pid == final_pids[rank], (f"rank {rank}: pid {final_pids[rank]} wrote its final record, "
                                                       f"pid {lines[-1].pid} logged its last step [{story}]")
    return logs
