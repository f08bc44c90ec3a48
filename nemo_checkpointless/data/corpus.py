"""Byte-level tokenisation and the embedded default corpus (the Python standard library's own sources).

Token id = byte value, so ``VOCAB_SIZE`` is 256. Documents are separate sequences in the index, so no separator
token is written into the stream.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import platform
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from nemo_checkpointless.data.indexed import IndexedTokens, IndexedTokensWriter, resolve_prefix
from nemo_checkpointless.errors import ConfigError

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4_000_000
_CORPUS_FORMAT = 1  # bump when the selection or layout below changes, so old caches are not reused
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
_MAX_DOCUMENT_BYTES = np.iinfo(np.int32).max


def _check_byte_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    dt = np.dtype(dtype)
    if dt.kind not in "iu" or np.iinfo(dt).max < VOCAB_SIZE - 1 or np.iinfo(dt).min > 0:
        raise ConfigError("dtype", dt, f"byte tokens 0..{VOCAB_SIZE - 1} do not fit", "use uint8, uint16 or int32")
    return dt


def expand_inputs(paths: Iterable[str | os.PathLike[str]], glob: str = "*") -> list[str]:
    """Files named in ``paths``, with each directory replaced by its files matching ``glob`` (by file name).

    Directories are walked recursively in sorted relative-path order; explicitly named files are kept whatever
    their name. A missing path raises ``ConfigError`` (key ``inputs``).
    """
    out: list[str] = []
    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            found: list[str] = []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                found.extend(os.path.relpath(os.path.join(root, f), p) for f in files if fnmatch.fnmatchcase(f, glob))
            out.extend(os.path.join(p, rel) for rel in sorted(found, key=lambda r: r.split(os.sep)))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise ConfigError("inputs", p, "no such file or directory", "pass existing files or directories")
    return out


def tokenize_files(
    paths: Iterable[str | os.PathLike[str]], prefix: str | os.PathLike[str], dtype: npt.DTypeLike = np.uint16
) -> str:
    """Write each file's bytes as one document to ``PREFIX.bin`` / ``PREFIX.idx`` and return ``PREFIX``.

    Empty files are skipped. A missing or unreadable input, or no non-empty input at all, raises ``ConfigError``
    (key ``inputs``); an output that cannot be written raises ``ConfigError`` (key ``output``).
    """
    dt = _check_byte_dtype(dtype)
    files = [os.fspath(p) for p in paths]
    out = resolve_prefix(prefix)
    for f in files:
        if not os.path.isfile(f):
            rule = "is a directory" if os.path.isdir(f) else "no such file"
            raise ConfigError("inputs", f, rule, "pass readable files (checkpointless-tokenize also walks directories)")
    parent = os.path.dirname(out)
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        writer = IndexedTokensWriter(out, dtype=dt)
        writer.open()
    except OSError as e:
        raise ConfigError("output", out, f"cannot write: {e.strerror}", "choose a writable --output PREFIX") from e
    with writer:
        for f in files:
            try:
                with open(f, "rb") as fh:
                    data = fh.read(_MAX_DOCUMENT_BYTES + 1)
            except OSError as e:
                raise ConfigError(
                    "inputs", f, f"cannot read: {e.strerror}", "check the path and its permissions"
                ) from e
            if len(data) > _MAX_DOCUMENT_BYTES:
                raise ConfigError(
                    "inputs", f, f"larger than {_MAX_DOCUMENT_BYTES} bytes (one document)", "split the file"
                )
            if data:
                writer.add_document(np.frombuffer(data, dtype=np.uint8))
        if writer.num_documents == 0:
            raise ConfigError("inputs", ", ".join(files) or "(none)", "no non-empty input file", "pass files with text")
    return out


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nemo_checkpointless", "data")


def _make_private_dirs(path: str) -> None:
    """Create ``path`` and any missing parents with mode 0700 (existing directories are left as they are)."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it first
            continue
        os.chmod(d, 0o700)  # mkdir's mode is narrowed by the umask; make it exactly 0700


def _stdlib_selection(stdlib: str, max_bytes: int) -> list[tuple[str, int]]:
    """(relative path, bytes to take) for the stdlib ``.py`` files, sorted by relative path, capped at ``max_bytes``."""
    rels: list[str] = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel_root = os.path.relpath(root, stdlib)
        for f in files:
            if f.endswith(".py"):
                rels.append(f if rel_root == "." else os.path.join(rel_root, f).replace(os.sep, "/"))
    rels.sort(key=lambda r: r.split("/"))
    chosen: list[tuple[str, int]] = []
    total = 0
    for rel in rels:
        if total >= max_bytes:
            break
        try:
            size = os.path.getsize(os.path.join(stdlib, rel))
        except OSError:
            continue
        if size == 0:
            continue
        take = min(size, max_bytes - total)  # the last file is cut so the corpus is exactly max_bytes
        chosen.append((rel, take))
        total += take
    return chosen


def default_corpus(cache_dir: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Prefix of the built-in corpus: byte tokens (uint16) of this Python's standard-library ``.py`` sources.

    Files are taken in sorted relative-path order (skipping ``site-packages``, ``test``, ``tests`` and ``idlelib``)
    up to ``max_bytes`` in total, one document per file. The pair is written once into ``cache_dir`` (default
    ``$XDG_CACHE_HOME/nemo_checkpointless/data`` or ``~/.cache/nemo_checkpointless/data``, made with mode 0700)
    under a name hashed from the Python version, the file list, their sizes and ``max_bytes``; later calls reuse it.
    Concurrent callers each write private temporaries and rename identical content into place.
    """
    if max_bytes <= 0:
        raise ConfigError("data.default_corpus_bytes", max_bytes, "must be >= 1", "use e.g. 4000000")
    stdlib = sysconfig.get_paths()["stdlib"]
    chosen = _stdlib_selection(stdlib, max_bytes)
    if not chosen:
        raise ConfigError(
            "data.path",
            "(default corpus)",
            f"no Python standard-library sources found under {stdlib}",
            "tokenize your own text with checkpointless-tokenize and set data.path=PREFIX",
        )
    key = json.dumps(
        {
            "format": _CORPUS_FORMAT,
            "python": [platform.python_implementation(), platform.python_version()],
            "files": chosen,
            "max_bytes": max_bytes,
        },
        separators=(",", ":"),
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    directory = cache_dir if cache_dir is not None else _default_cache_dir()
    prefix = os.path.join(
        os.path.expanduser(directory), f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    )
    with contextlib.suppress(ConfigError):
        IndexedTokens(prefix)  # already written, and intact
        return prefix
    try:
        _make_private_dirs(os.path.dirname(prefix))
        writer = IndexedTokensWriter(prefix, dtype=np.uint16)
        writer.open()
    except OSError as e:
        raise ConfigError(
            "data.cache_dir",
            directory,
            f"cannot write the default corpus: {e.strerror}",
            "point it at a writable directory",
        ) from e
    with writer:
        for rel, take in chosen:
            with open(os.path.join(stdlib, rel), "rb") as fh:
                data = fh.read(take)
            if data:
                writer.add_document(np.frombuffer(data, dtype=np.uint8))
    return prefix
