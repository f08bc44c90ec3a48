"""The shared-memory batch cache: one private directory per job, one subdirectory per (data version, batch group).

Layout (``root`` defaults to ``/dev/shm``)::

    ROOT/ncl-data-<job id>/                     mode 0700, removed by the launcher when the job ends
        <version[:16]>.g<group>/                mode 0700, one per data version and batch group
            000000000012.bin                    mode 0600: the batch's tensors, raw bytes, each 64-byte aligned
            000000000012.json                   mode 0600: the index (below); written last, so it commits the batch

The index is JSON, never pickle::

    {"format": 1, "job": ..., "version": ..., "group": 3, "step": 12, "samples": [...], "nbytes": N,
     "sha256": "<of the N bytes of .bin>", "structure": <tree>, "tensors": [{"dtype", "shape", "offset", "nbytes"}]}

A reader trusts a batch only when the header names this job, this data version, this group, the step and the
sample ids the plan assigns to it, the .bin has exactly N bytes, and their sha256 matches. Anything else is
reported once (a `CacheFallbackWarning` naming the file and the reason) and the caller reads the dataset directly.

Who calls what: one writer per batch group (`BatchCache.write`, `discard_before`); any number of readers
(`BatchCache.read`), in the writer's process or others. Files are published by rename, so a reader never sees a
half-written batch; a writer that dies leaves at most temporaries, which the next writer of the group removes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_checkpointless.state.packing import DTYPES, dtype_name

CACHE_FORMAT = 1
JOB_DIR_PREFIX = "ncl-data-"
ALIGN = 64
_MAX_INDEX_BYTES = 64 << 20
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

Batch = Any  # a tensor, or a list / tuple / dict of batches
WriteFile = Callable[[str, Sequence[memoryview]], None]


class CacheFallbackWarning(UserWarning):
    """The cache could not serve (or store) a batch; the loader reads the dataset directly instead."""


def default_cache_root() -> str:
    """``/dev/shm`` where it exists and is writable, else the system temp directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


def new_job_id() -> str:
    """A fresh job id (the launcher makes one per run)."""
    return secrets.token_hex(8)


def job_cache_dir(root: str | os.PathLike[str] | None, job_id: str) -> Path:
    """``ROOT/ncl-data-<job id>``. The id must be 1-64 of ``[A-Za-z0-9_-]`` (it names a directory)."""
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return Path(root if root is not None else default_cache_root()) / f"{JOB_DIR_PREFIX}{job_id}"


def remove_job_cache(root: str | os.PathLike[str] | None, job_id: str) -> bool:
    """Remove the job's cache directory if it exists and is ours (a real directory owned by this user).

    Called once by whoever owns the job (the launcher) after every rank has exited. Returns True if removed.
    """
    path = job_cache_dir(root, job_id)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False  # never follow a planted symlink or delete someone else's directory
    shutil.rmtree(path, ignore_errors=True)
    return True


def data_version(**fields: Any) -> str:
    """sha256 (hex) of the JSON of `fields`: what a cached batch depends on (content id, seq_len, batch, seed, ...)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ batch layout
def flatten(batch: Batch) -> tuple[list[torch.Tensor], Any]:
    """The tensors of a batch (depth first) and a JSON tree that rebuilds it (`unflatten`)."""
    leaves: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return len(leaves) - 1
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [walk(v) for v in x]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": {k: walk(v) for k, v in x.items()}}
        raise TypeError(f"a cached batch holds tensors, lists, tuples and str-keyed dicts; got {type(x).__name__}")

    return leaves, walk(batch)


def unflatten(structure: Any, leaves: Sequence[torch.Tensor]) -> Batch:
    if isinstance(structure, int):
        return leaves[structure]
    if "list" in structure:
        return [unflatten(s, leaves) for s in structure["list"]]
    if "tuple" in structure:
        return tuple(unflatten(s, leaves) for s in structure["tuple"])
    return {k: unflatten(s, leaves) for k, s in structure["dict"].items()}


def _leaf_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def layout(leaves: Sequence[torch.Tensor]) -> tuple[list[memoryview], list[dict[str, Any]], int]:
    """The byte chunks of .bin (tensors with zero padding to `ALIGN`), their index entries and the total size."""
    chunks: list[memoryview] = []
    entries: list[dict[str, Any]] = []
    offset = 0
    for t in leaves:
        name = dtype_name(t.dtype)
        if name not in DTYPES:
            raise TypeError(f"cannot cache a tensor of dtype {t.dtype}")
        data = _leaf_bytes(t)
        pad = -offset % ALIGN
        if pad:
            chunks.append(memoryview(bytes(pad)))
            offset += pad
        entries.append({"dtype": name, "shape": list(t.shape), "offset": offset, "nbytes": data.nbytes})
        chunks.append(data)
        offset += data.nbytes
    return chunks, entries, offset


def fingerprint(batch: Batch) -> str:
    """sha256 (hex) of a batch in its .bin layout: the index's checksum of a cached batch is its fingerprint."""
    chunks, _, _ = layout(flatten(batch)[0])
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing the temporary `tmp_name` (`<file>.tmp.<pid>.<hex>`, `BatchCache.write`)
    still lives; a name without a pid counts as dead."""
    pid = tmp_name.rsplit(".tmp.", 1)[1].split(".", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def write_chunks(path: str, chunks: Sequence[memoryview]) -> None:
    """Write a new private file (0600, O_EXCL: a planted file or symlink is never followed). The default write hook
    of `BatchCache`; tests point it at a full filesystem or make it raise."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for c in chunks:
            view = c.cast("B") if c.ndim != 1 or c.format != "B" else c
            while view.nbytes:
                n = os.write(fd, view)
                view = view[n:]
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- the cache
class BatchCache:
    """One batch group's batches of one data version in a job's cache directory.

    Args:
        root: the cache root (None: `default_cache_root()`); the job's directory is created under it.
        job_id: names the directory and is written into (and checked against) every index.
        version: the data version (`data_version`); batches of another version are never read.
        group: the batch group id: ranks that train on the same micro-batch (a TP/CP group) share one group.
        write_file: how a file is written (`write_chunks`); an `OSError` from it disables writing (warned once).

    Construction never raises for an unusable directory: the cache disables itself, warns once, and every `read`
    misses (the caller then reads the dataset directly).
    """

    def __init__(self, root: str | os.PathLike[str] | None, job_id: str, version: str, group: int,
                 write_file: WriteFile = write_chunks) -> None:
        self.job_id = job_id
        self.version = version
        self.group = group
        self.job_dir = job_cache_dir(root, job_id)
        self.dir = self.job_dir / f"{version[:16]}.g{group}"
        self.write_file = write_file
        self.enabled = True
        self.can_write = True
        self._warned: set[str] = set()
        self.rejected = 0
        self.write_errors = 0
        try:
            for d in (self.job_dir, self.dir):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
                self._check_private(d)
        except OSError as e:
            self._disable("unusable", str(self.dir), f"cannot create the cache directory: {e.strerror or e}")

    def _check_private(self, path: Path) -> None:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "not a directory (a symlink or file is in its place)")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not this user")
        if st.st_mode & 0o077:
            raise OSError(errno.EPERM, f"mode {oct(st.st_mode & 0o777)} is not private (0700)")

    # -------------------------------------------------------------------------------------------- reporting
    def _report(self, kind: str, path: str, why: str) -> None:
        """Warn once per kind of problem (the first file and its reason); later ones are only counted."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(f"data cache: {path}: {why}; reading the dataset directly instead (reported once)",
                      CacheFallbackWarning, stacklevel=3)

    def _disable(self, kind: str, path: str, why: str) -> None:
        self.enabled = self.can_write = False
        self._report(kind, path, why)

    def _paths(self, step: int) -> tuple[Path, Path]:
        stem = self.dir / f"{step:012d}"
        return stem.with_suffix(".bin"), stem.with_suffix(".json")

    # -------------------------------------------------------------------------------------------------- read
    def _load_index(self, step: int) -> dict[str, Any] | None:
        _, idx_path = self._paths(step)
        try:
            with open(idx_path, "rb") as f:
                raw = f.read(_MAX_INDEX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._reject("unreadable", idx_path, f"cannot read: {e.strerror or e}")
            return None
        try:
            if len(raw) > _MAX_INDEX_BYTES:
                raise ValueError(f"index larger than {_MAX_INDEX_BYTES} bytes")
            index = json.loads(raw)
            if not isinstance(index, dict):
                raise ValueError("not a JSON object")
            return index
        except (ValueError, UnicodeDecodeError) as e:
            self._reject("corrupt", idx_path, f"corrupt or truncated index ({e})")
            return None

    def _reject(self, kind: str, path: Path, why: str) -> None:
        self.rejected += 1
        self._report(kind, str(path), why)

    def _header_problem(self, index: dict[str, Any], step: int, samples: np.ndarray | None) -> tuple[str, str] | None:
        if index.get("format") != CACHE_FORMAT:
            return "stale", f"cache format {index.get('format')!r}, this build reads {CACHE_FORMAT}"
        if index.get("job") != self.job_id:
            return "stale", f"written by job {index.get('job')!r}, not this job {self.job_id!r}"
        if index.get("version") != self.version:
            return "stale", f"data version {str(index.get('version'))[:16]}..., not {self.version[:16]}..."
        if index.get("group") != self.group or index.get("step") != step:
            return "stale", (f"holds group {index.get('group')!r} step {index.get('step')!r}, "
                             f"expected group {self.group} step {step}")
        if samples is not None and index.get("samples") != samples.tolist():
            return "stale", f"holds other sample ids than the plan assigns to step {step}"
        return None

    def has(self, step: int) -> bool:
        """True when a batch for `step` with a matching header is present (the checksum is checked on `read`)."""
        if not self.enabled:
            return False
        index = self._load_index(step)
        return index is not None and self._header_problem(index, step, None) is None

    def read(self, step: int, samples: np.ndarray) -> tuple[Batch, str] | None:
        """The cached batch of `step` (and its sha256), or None: a miss, or a file that failed a check (reported).

        The tensors are copy-on-write memory maps of the .bin (no copy is made unless the caller writes to them).
        """
        if not self.enabled:
            return None
        index = self._load_index(step)
        if index is None:
            return None
        bin_path, idx_path = self._paths(step)
        problem = self._header_problem(index, step, samples)
        if problem is not None:
            self._reject(problem[0], idx_path, problem[1])
            return None
        try:
            nbytes = int(index["nbytes"])
            size = os.stat(bin_path).st_size
            if size != nbytes:
                self._reject("corrupt", bin_path, f"{size} bytes, its index says {nbytes} (truncated?)")
                return None
            buf = (torch.from_file(str(bin_path), shared=False, size=nbytes, dtype=torch.uint8) if nbytes
                   else torch.empty(0, dtype=torch.uint8))
            digest = hashlib.sha256(buf.numpy().data).hexdigest()
            if digest != index["sha256"]:
                self._reject("corrupt", bin_path, "checksum mismatch (corrupt)")
                return None
            leaves = []
            for e in index["tensors"]:
                off, n, dtype = int(e["offset"]), int(e["nbytes"]), DTYPES[e["dtype"]]
                if off % ALIGN or off < 0 or off + n > nbytes:
                    raise ValueError(f"tensor at [{off}, {off + n}) outside the {nbytes} bytes or misaligned")
                leaves.append(buf[off : off + n].view(dtype).reshape(e["shape"]))
            return unflatten(index["structure"], leaves), digest
        except FileNotFoundError:
            return None  # the writer discarded it between the index and the data: a miss
        except (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            self._reject("corrupt", idx_path, f"bad index or data ({type(e).__name__}: {e})")
            return None

    # ------------------------------------------------------------------------------------------------- write
    def write(self, step: int, samples: np.ndarray, batch: Batch) -> str | None:
        """Publish `batch` as `step`'s (the group's writer only); returns its sha256, or None if not written.

        An `OSError` (a full /dev/shm: ENOSPC) removes what was written, stops all further writes and is warned
        once; reads of batches already published go on.
        """
        if not self.can_write:
            return None
        leaves, structure = flatten(batch)
        chunks, entries, nbytes = layout(leaves)
        h = hashlib.sha256()
        for c in chunks:
            h.update(c)
        digest = h.hexdigest()
        index = {"format": CACHE_FORMAT, "job": self.job_id, "version": self.version, "group": self.group,
                 "step": step, "samples": np.asarray(samples).tolist(), "nbytes": nbytes, "sha256": digest,
                 "structure": structure, "tensors": entries}
        bin_path, idx_path = self._paths(step)
        tag = f".tmp.{os.getpid()}.{secrets.token_hex(4)}"
        tmps = [f"{bin_path}{tag}", f"{idx_path}{tag}"]
        try:
            self.write_file(tmps[0], chunks)
            self.write_file(tmps[1], [memoryview(json.dumps(index).encode())])
            os.replace(tmps[0], bin_path)
            os.replace(tmps[1], idx_path)  # the index last: it commits the batch
        except OSError as e:
            for p in tmps:
                with contextlib.suppress(OSError):
                    os.unlink(p)
            self.write_errors += 1
            self.can_write = False
            why = "no space left (ENOSPC)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else f"write failed: {e}"
            self._report("write", str(bin_path), f"{why}; prefetching stops")
            return None
        return digest

    def steps_on_disk(self) -> list[int]:
        """Steps with a committed index (sorted); also removes temporaries a dead writer left (the pid in their name
        is not a live process: a live writer's, this process's prefetch thread's among them, are in flight)."""
        if not self.enabled:
            return []
        steps = []
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                if ".tmp." in name:
                    if not _writer_alive(name):
                        with contextlib.suppress(OSError):
                            os.unlink(self.dir / name)
                elif name.endswith(".json") and name[:-5].isdigit():
                    steps.append(int(name[:-5]))
        return sorted(steps)

    def discard(self, steps: Iterable[int]) -> None:
        """Remove the batches of `steps` (index first, so a reader sees a miss, never a half-removed batch)."""
        for step in steps:
            bin_path, idx_path = self._paths(step)
            for p in (idx_path, bin_path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
