"""Memory-mapped token files in the Megatron ``PREFIX.bin`` + ``PREFIX.idx`` layout.

``.bin`` holds the tokens of every sequence back to back. ``.idx`` (all integers little-endian) is::

    b"MMIDIDX\\x00\\x00"            magic, 9 bytes
    u64 version = 1
    u8  dtype code                 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    u64 S                          sequence count
    u64 D                          length of the document-index array (documents + 1)
    int32[S] sequence lengths      in tokens
    int64[S] sequence pointers     byte offsets into .bin
    int64[D] document indices      0, then the sequence index that ends each document

This is what ``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads and ``IndexedDatasetBuilder`` writes
(non-multimodal). Files written here store one sequence per document; files from Megatron may hold several
sequences per document, and ``IndexedTokens.document`` returns all of them as one contiguous view.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import struct
from array import array
from collections.abc import Iterable
from types import TracebackType
from typing import IO, Any, NoReturn

import numpy as np
import numpy.typing as npt

from nemo_checkpointless.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
_CODE_OF = {(dt.kind, dt.itemsize): code for code, dt in DTYPE_CODES.items()}
_MAX_SEQUENCE_TOKENS = np.iinfo(np.int32).max
_CHECK_CHUNK = 1 << 22

_KEY = "data.path"
_FIX_MAKE = (
    "run checkpointless-tokenize FILE_OR_DIR --output PREFIX, or point data.path at an existing PREFIX (.bin + .idx)"
)
_FIX_REMAKE = "re-create it with checkpointless-tokenize, or point data.path at an intact PREFIX (.bin + .idx)"


def resolve_prefix(path: str | os.PathLike[str]) -> str:
    """``PREFIX`` of a token file pair given as ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` (``~`` expanded)."""
    p = os.path.expanduser(os.fspath(path))
    for suffix in (".bin", ".idx"):
        if p.endswith(suffix):
            return p[: -len(suffix)]
    return p


def _dtype_code(dtype: npt.DTypeLike) -> tuple[np.dtype[Any], int]:
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise ValueError(f"token dtype must be little-endian or native, got {dt}")
    code = _CODE_OF.get((dt.kind, dt.itemsize))
    if code is None or dt.kind not in "iu":
        names = ", ".join(str(d) for d in DTYPE_CODES.values() if d.kind in "iu")
        raise ValueError(f"unsupported token dtype {dt}; use one of {names}")
    return DTYPE_CODES[code], code


def _open_private(path: str) -> IO[bytes]:
    # O_EXCL: a leftover or planted file under the temp name is never reused or followed as a symlink.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a umask cannot widen it, but a restrictive one (e.g. 0o277) would narrow it
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class IndexedTokensWriter:
    """Write ``PREFIX.bin`` / ``PREFIX.idx``, one sequence per document.

    Use as a context manager. Tokens stream to a temporary ``.bin`` beside the target; on a clean exit the index is
    written and both files are renamed into place (``.bin`` first, then ``.idx``), so no file under the final name
    is ever partial. On an exception the temporaries are removed. Files are created with mode 0600.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike = np.uint16) -> None:
        self.prefix = resolve_prefix(prefix)
        self.dtype, self._code = _dtype_code(dtype)
        self._info = np.iinfo(self.dtype)
        self._lengths: array[int] = array("q")
        self.num_tokens = 0
        tag = f".tmp.{os.getpid()}.{secrets.token_hex(4)}"
        self._bin_tmp = self.prefix + ".bin" + tag
        self._idx_tmp = self.prefix + ".idx" + tag
        self._bin: IO[bytes] | None = None
        self._done = False

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._lengths)

    def __enter__(self) -> IndexedTokensWriter:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def open(self) -> None:
        """Create the temporary ``.bin`` (called by ``__enter__``)."""
        if self._bin is None and not self._done:
            self._bin = _open_private(self._bin_tmp)

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (a 1-D sequence of integer token ids that fit ``dtype``)."""
        if self._bin is None:
            raise RuntimeError("IndexedTokensWriter is not open; use it as a context manager")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size:
            if arr.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            # A silent astype would wrap out-of-range ids (e.g. 300 -> 44 in uint8) into wrong tokens.
            if lo < self._info.min or hi > self._info.max:
                raise ValueError(f"token ids [{lo}, {hi}] do not fit {self.dtype} [{self._info.min}, {self._info.max}]")
        if arr.size > _MAX_SEQUENCE_TOKENS:
            raise ValueError(
                f"a document has {arr.size} tokens; the index stores lengths as int32 (max {_MAX_SEQUENCE_TOKENS})"
            )
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._lengths.append(arr.size)
        self.num_tokens += arr.size

    def add_documents(self, documents: Iterable[npt.ArrayLike]) -> None:
        """Append each document in order."""
        for doc in documents:
            self.add_document(doc)

    def close(self) -> None:
        """Write the index and rename both files into place."""
        if self._done:
            return
        if self._bin is None:
            self.open()
        assert self._bin is not None
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            self._bin = None
            n = len(self._lengths)
            lengths = np.frombuffer(self._lengths, dtype=np.int64) if n else np.zeros(0, np.int64)
            pointers = np.zeros(n, dtype="<i8")
            if n > 1:
                np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            with _open_private(self._idx_tmp) as f:
                f.write(MAGIC)
                f.write(struct.pack("<QBQQ", VERSION, self._code, n, n + 1))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.tobytes())
                f.write(np.arange(n + 1, dtype="<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._bin_tmp, self.prefix + ".bin")
            os.replace(self._idx_tmp, self.prefix + ".idx")
        except BaseException:
            self.abort()
            raise
        self._done = True
        _fsync_dir(os.path.dirname(self.prefix) or ".")

    def abort(self) -> None:
        """Discard everything written; the final names are left untouched."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for p in (self._bin_tmp, self._idx_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        self._done = True


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class IndexedTokens:
    """Read-only memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx`` (nothing is read in full).

    ``prefix`` may be ``X``, ``X.bin`` or ``X.idx``. A missing, malformed or truncated pair raises
    ``ConfigError`` with key ``data.path``.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.path = os.fspath(prefix)
        self.prefix = resolve_prefix(prefix)
        self.bin_path = self.prefix + ".bin"
        self.idx_path = self.prefix + ".idx"
        for p in (self.bin_path, self.idx_path):
            if not os.path.isfile(p):
                self._fail(f"no token file {p}", _FIX_MAKE)
        try:
            idx_size = os.path.getsize(self.idx_path)
            self.bin_size = os.path.getsize(self.bin_path)
            with open(self.idx_path, "rb") as f:
                header = f.read(HEADER_SIZE)
        except OSError as e:
            self._fail(f"cannot read {e.filename or self.prefix}: {e.strerror}", "check the path and its permissions")
        if header[: len(MAGIC)] != MAGIC:
            self._fail(
                f"{self.idx_path} is not a Megatron token index (bad magic {header[: len(MAGIC)]!r})", _FIX_REMAKE
            )
        if len(header) < HEADER_SIZE:
            self._fail(f"{self.idx_path} is truncated ({idx_size} bytes, header needs {HEADER_SIZE})", _FIX_REMAKE)
        version, code, n_seq, n_doc_idx = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION:
            self._fail(f"{self.idx_path} has index version {version}; only version {VERSION} is supported", _FIX_REMAKE)
        if code not in DTYPE_CODES:
            self._fail(f"{self.idx_path} has unknown dtype code {code}; known codes are 1-8", _FIX_REMAKE)
        self.dtype: np.dtype[Any] = DTYPE_CODES[code]
        itemsize = self.dtype.itemsize
        need = HEADER_SIZE + n_seq * (4 + 8) + n_doc_idx * 8
        # Megatron's multimodal indexes append one int8 mode per sequence; those are accepted and ignored.
        if n_doc_idx < 1 or idx_size not in (need, need + n_seq):
            self._fail(
                f"{self.idx_path} is {idx_size} bytes but its header ({n_seq} sequences, {n_doc_idx} document "
                f"indices) needs {need}",
                _FIX_REMAKE,
            )
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self._idx = idx
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc_idx, offset=off)
        self._check_index(n_seq, itemsize)
        self.num_tokens = int(self.sequence_pointers[-1]) // itemsize + int(self.sequence_lengths[-1]) if n_seq else 0
        if self.bin_size != self.num_tokens * itemsize:
            self._fail(
                f"{self.bin_path} is {self.bin_size} bytes but its index says {self.num_tokens} tokens x {itemsize} "
                f"bytes = {self.num_tokens * itemsize} (truncated or from a different index)",
                _FIX_REMAKE,
            )
        self.tokens: np.ndarray[Any, np.dtype[Any]]
        if self.num_tokens:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        else:  # np.memmap refuses an empty file
            self.tokens = np.zeros(0, dtype=self.dtype)
            self.tokens.flags.writeable = False
        self._content_id: str | None = None

    def _fail(self, rule: str, fix: str) -> NoReturn:
        raise ConfigError(_KEY, self.path, rule, fix)

    def _check_index(self, n_seq: int, itemsize: int) -> None:
        docs, lengths, pointers = self.document_indices, self.sequence_lengths, self.sequence_pointers
        if docs[0] != 0 or docs[-1] != n_seq:
            self._fail(f"{self.idx_path}: document indices must run from 0 to {n_seq}", _FIX_REMAKE)
        if n_seq and pointers[0] != 0:
            self._fail(f"{self.idx_path}: first sequence pointer is {int(pointers[0])}, not 0", _FIX_REMAKE)
        # Chunked so a billion-sequence index is checked without billion-element temporaries.
        for lo in range(0, max(n_seq, len(docs)), _CHECK_CHUNK):
            hi = lo + _CHECK_CHUNK
            if np.any(np.diff(docs[lo : hi + 1]) < 0):
                self._fail(f"{self.idx_path}: document indices decrease", _FIX_REMAKE)
            if np.any(lengths[lo:hi] < 0):
                self._fail(f"{self.idx_path}: negative sequence length", _FIX_REMAKE)
            p = pointers[lo : hi + 1]
            if np.any(np.diff(p) != lengths[lo : lo + len(p) - 1].astype(np.int64) * itemsize):
                self._fail(f"{self.idx_path}: sequences are not stored back to back in .bin", _FIX_REMAKE)

    @property
    def num_documents(self) -> int:
        """Number of documents."""
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self.num_documents

    def _token_offset(self, seq: int) -> int:
        if seq >= len(self.sequence_pointers):
            return self.num_tokens
        return int(self.sequence_pointers[seq]) // self.dtype.itemsize

    def document_span(self, i: int) -> tuple[int, int]:
        """Token range ``[start, end)`` of document ``i`` within ``tokens`` (negative ``i`` counts from the end)."""
        n = self.num_documents
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i %= n
        return self._token_offset(int(self.document_indices[i])), self._token_offset(int(self.document_indices[i + 1]))

    def document(self, i: int) -> np.ndarray[Any, np.dtype[Any]]:
        """Tokens of document ``i`` as a read-only view into the memory map."""
        start, end = self.document_span(i)
        return self.tokens[start:end]

    def content_id(self) -> str:
        """Stable id of this data version: sha256 over the ``.idx`` bytes and the ``.bin`` size (hex)."""
        if self._content_id is None:
            h = hashlib.sha256()
            for lo in range(0, len(self._idx), 1 << 24):
                h.update(self._idx[lo : lo + (1 << 24)].tobytes())
            h.update(b"\x00bin_size=%d" % self.bin_size)
            self._content_id = h.hexdigest()
        return self._content_id

    def __repr__(self) -> str:
        return (
            f"IndexedTokens({self.prefix!r}, dtype={self.dtype}, documents={self.num_documents}, "
            f"tokens={self.num_tokens})"
        )
