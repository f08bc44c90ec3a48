"""Token files: Megatron-compatible .bin/.idx, the byte-level corpus and the checkpointless-tokenize CLI."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from nemo_checkpointless.cli.tokenize import main as tokenize_main
from nemo_checkpointless.data.corpus import VOCAB_SIZE, default_corpus, expand_inputs, tokenize_files
from nemo_checkpointless.data.indexed import MAGIC, IndexedTokens, IndexedTokensWriter, resolve_prefix
from nemo_checkpointless.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DOCS = [[1, 2, 3], [], [7], list(range(100, 140))]


def _write(prefix: Path | str, docs: list[list[int]], dtype: npt.DTypeLike = np.uint16) -> str:
    with IndexedTokensWriter(prefix, dtype=dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def _mode(p: Path | str) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, "int16"])
def test_round_trip(tmp_path: Path, dtype: npt.DTypeLike) -> None:
    prefix = _write(tmp_path / "d", DOCS, dtype)
    data = IndexedTokens(prefix)
    assert data.dtype == np.dtype(dtype)
    assert data.num_documents == len(data) == len(DOCS)
    assert data.num_tokens == sum(map(len, DOCS))
    for i, doc in enumerate(DOCS):
        assert data.document(i).tolist() == doc
    assert data.document(-1).tolist() == DOCS[-1]
    assert data.tokens.tolist() == [t for d in DOCS for t in d]
    assert os.path.getsize(prefix + ".bin") == data.num_tokens * np.dtype(dtype).itemsize
    with pytest.raises(IndexError):
        data.document(len(DOCS))


def test_document_is_read_only_view(tmp_path: Path) -> None:
    data = IndexedTokens(_write(tmp_path / "d", DOCS))
    doc = data.document(3)
    assert isinstance(data.tokens, np.memmap)
    assert np.shares_memory(doc, data.tokens)
    assert not doc.flags.writeable
    assert data.document_span(3) == (4, 44)


def test_empty_dataset(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "e", [])
    data = IndexedTokens(prefix)
    assert (data.num_documents, data.num_tokens, data.tokens.size) == (0, 0, 0)
    assert os.path.getsize(prefix + ".bin") == 0
    assert len(data.content_id()) == 64
    with pytest.raises(IndexError):
        data.document(0)


def test_idx_layout_is_megatron_v1(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "d", [[5, 6], [7, 8, 9]], np.int32)
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == MAGIC == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 4, 2, 3)
    assert np.frombuffer(raw, "<i4", 2, 34).tolist() == [2, 3]
    assert np.frombuffer(raw, "<i8", 2, 42).tolist() == [0, 8]
    assert np.frombuffer(raw, "<i8", 3, 58).tolist() == [0, 1, 2]
    assert len(raw) == 82


def test_writer_rejects_bad_tokens(tmp_path: Path) -> None:
    for bad, dtype in (([256], np.uint8), ([-1], np.uint16), ([[1, 2]], np.uint16), ([1.5], np.int32)):
        with pytest.raises(ValueError), IndexedTokensWriter(tmp_path / "b", dtype=dtype) as w:
            w.add_document(bad)
    with pytest.raises(ValueError, match="unsupported token dtype"):
        IndexedTokensWriter(tmp_path / "b", dtype=np.float32)
    assert os.listdir(tmp_path) == []


def test_atomic_write_leaves_nothing_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), IndexedTokensWriter(tmp_path / "d") as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("killed mid-way")
    assert os.listdir(tmp_path) == []
    # A failed rewrite keeps the previous pair intact.
    old = IndexedTokens(_write(tmp_path / "d", DOCS)).content_id()
    with pytest.raises(RuntimeError), IndexedTokensWriter(tmp_path / "d.bin") as w:
        w.add_document([9, 9])
        raise RuntimeError("killed mid-way")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    assert IndexedTokens(tmp_path / "d").content_id() == old


def test_file_permissions(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        prefix = _write(tmp_path / "d", DOCS)
    finally:
        os.umask(old)
    assert _mode(prefix + ".bin") == _mode(prefix + ".idx") == 0o600


def test_prefix_resolution(tmp_path: Path) -> None:
    assert resolve_prefix("/x/y") == resolve_prefix("/x/y.bin") == resolve_prefix("/x/y.idx") == "/x/y"
    assert resolve_prefix("/x/y.txt") == "/x/y.txt"
    assert resolve_prefix("~/d") == os.path.expanduser("~/d")
    prefix = _write(tmp_path / "d", DOCS)
    ids = {IndexedTokens(p).content_id() for p in (prefix, prefix + ".bin", prefix + ".idx", Path(prefix))}
    assert len(ids) == 1
    assert IndexedTokens(prefix + ".idx").prefix == prefix


def test_content_id_tracks_data(tmp_path: Path) -> None:
    a = IndexedTokens(_write(tmp_path / "a", DOCS)).content_id()
    assert IndexedTokens(tmp_path / "a").content_id() == a
    assert IndexedTokens(_write(tmp_path / "b", DOCS)).content_id() == a
    assert IndexedTokens(_write(tmp_path / "c", [*DOCS, [1]])).content_id() != a
    assert IndexedTokens(_write(tmp_path / "u8", DOCS, np.uint8)).content_id() != a


def _config_error(path: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        IndexedTokens(path)  # type: ignore[arg-type]
    assert info.value.key == "data.path"
    assert str(info.value).startswith(f"data.path={path}: ")
    return info.value


def test_missing_files(tmp_path: Path) -> None:
    err = _config_error(tmp_path / "nope")
    assert f"no token file {tmp_path / 'nope'}.bin" in str(err)
    assert "checkpointless-tokenize" in str(err)
    prefix = _write(tmp_path / "d", DOCS)
    os.unlink(prefix + ".idx")
    assert f"no token file {prefix}.idx" in str(_config_error(prefix))


def test_truncated_bin(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "d", DOCS)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    assert "truncated" in _config_error(prefix).rule


def test_corrupt_index(tmp_path: Path) -> None:
    prefix = _write(tmp_path / "d", DOCS)
    idx = Path(prefix + ".idx")
    good = idx.read_bytes()
    cases = {
        b"NOTANIDX\x00" + good[9:]: "bad magic",
        good[:20]: "truncated",
        good[:9] + struct.pack("<Q", 2) + good[17:]: "version 2",
        good[:17] + bytes([9]) + good[18:]: "dtype code 9",
        good[:-8]: "needs",
        good[:-8] + struct.pack("<q", 3): "document indices",
    }
    for raw, words in cases.items():
        idx.write_bytes(raw)
        assert words in _config_error(prefix).rule


def test_megatron_reads_our_files(tmp_path: Path) -> None:
    mi = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    for dtype in (np.uint16, np.int32):
        prefix = _write(tmp_path / f"ours_{np.dtype(dtype).name}", DOCS, dtype)
        ds = mi.IndexedDataset(prefix)
        assert len(ds) == len(DOCS)
        assert ds.index.dtype == dtype
        assert ds.document_indices.tolist() == list(range(len(DOCS) + 1))
        for i, doc in enumerate(DOCS):
            assert ds[i].tolist() == doc
        assert [s.tolist() for s in ds[0:4]] == DOCS


def test_we_read_megatron_files(tmp_path: Path) -> None:
    mi = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = str(tmp_path / "theirs")
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.array([1, 2, 3, 4, 5]), [2, 3])  # one document of two sequences
    builder.add_document(np.array([9]), [1])
    builder.add_document(np.array([6, 7]), [2])
    builder.finalize(prefix + ".idx")
    data = IndexedTokens(prefix)
    assert (data.num_documents, data.num_tokens, data.dtype) == (3, 8, np.dtype(np.uint16))
    assert [data.document(i).tolist() for i in range(3)] == [[1, 2, 3, 4, 5], [9], [6, 7]]
    # Same tokens and index written by us give the same bytes when each document is one sequence.
    builder = mi.IndexedDatasetBuilder(prefix + "2.bin", dtype=np.uint16)
    for d in DOCS:
        builder.add_document(np.array(d, dtype=np.uint16), [len(d)])
    builder.finalize(prefix + "2.idx")
    ours = _write(tmp_path / "ours", DOCS)
    for ext in (".bin", ".idx"):
        assert Path(prefix + "2" + ext).read_bytes() == Path(ours + ext).read_bytes()


def test_default_corpus_deterministic_and_reused(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "b"
    p1 = default_corpus(str(cache), max_bytes=50_000)
    assert _mode(tmp_path / "a") == _mode(cache) == 0o700
    assert _mode(p1 + ".bin") == _mode(p1 + ".idx") == 0o600
    mtimes = [os.stat(p1 + ext).st_mtime_ns for ext in (".bin", ".idx")]
    p2 = default_corpus(str(cache), max_bytes=50_000)
    assert p2 == p1
    assert [os.stat(p1 + ext).st_mtime_ns for ext in (".bin", ".idx")] == mtimes
    assert sorted(os.listdir(cache)) == [os.path.basename(p1) + ".bin", os.path.basename(p1) + ".idx"]
    data = IndexedTokens(p1)
    assert data.num_tokens == 50_000
    assert int(data.tokens.max()) < VOCAB_SIZE
    first = bytes(data.document(0).astype(np.uint8))
    assert Path(sysconfig.get_paths()["stdlib"], "__future__.py").read_bytes().startswith(first)
    # Another cache directory gets identical content; another budget gets another name.
    other = default_corpus(str(tmp_path / "c"), max_bytes=50_000)
    assert os.path.basename(other) == os.path.basename(p1)
    assert IndexedTokens(other).content_id() == data.content_id()
    assert default_corpus(str(cache), max_bytes=40_000) != p1


def test_default_corpus_default_dir_and_concurrency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(default_corpus(max_bytes=30_000))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert results[0].startswith(str(tmp_path / "xdg" / "nemo_checkpointless" / "data") + os.sep)
    assert _mode(tmp_path / "xdg" / "nemo_checkpointless") == 0o700
    assert IndexedTokens(results[0]).num_tokens == 30_000
    assert len(os.listdir(tmp_path / "xdg" / "nemo_checkpointless" / "data")) == 2


def test_tokenize_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello\xff")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "b.txt").write_text("world")
    prefix = tokenize_files([tmp_path / "a.txt", tmp_path / "empty.txt", tmp_path / "b.txt"], tmp_path / "out" / "t")
    data = IndexedTokens(prefix)
    assert [bytes(data.document(i).astype(np.uint8)) for i in range(len(data))] == [b"hello\xff", b"world"]
    with pytest.raises(ConfigError, match=r"^inputs=.*missing\.txt: no such file"):
        tokenize_files([tmp_path / "missing.txt"], tmp_path / "x")
    with pytest.raises(ConfigError, match="no non-empty input"):
        tokenize_files([tmp_path / "empty.txt"], tmp_path / "x")
    with pytest.raises(ConfigError, match=r"^dtype=int8"):
        tokenize_files([tmp_path / "a.txt"], tmp_path / "x", dtype=np.int8)
    assert not (tmp_path / "x.bin").exists()


def _tree(root: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bbb")
    (root / "a.txt").write_text("aa")
    (root / "c.md").write_text("skipped by glob")
    (root / "sub" / "d.txt").write_text("dddd")
    (root / "e.txt").write_text("")


def test_expand_inputs_sorted_with_glob(tmp_path: Path) -> None:
    _tree(tmp_path / "in")
    got = expand_inputs([tmp_path / "in"], glob="*.txt")
    assert [os.path.relpath(p, tmp_path / "in") for p in got] == [
        "a.txt",
        "b.txt",
        "e.txt",
        os.path.join("sub", "d.txt"),
    ]
    assert expand_inputs([tmp_path / "in" / "c.md"], glob="*.txt") == [str(tmp_path / "in" / "c.md")]


def test_cli_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tree(tmp_path / "in")
    out = tmp_path / "tok"
    assert tokenize_main([str(tmp_path / "in"), "--output", str(out), "--glob", "*.txt", "--dtype", "uint8"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"3 documents, 9 tokens -> {out}.bin {out}.idx"
    data = IndexedTokens(out)
    assert data.dtype == np.uint8
    assert bytes(data.tokens) == b"aabbbdddd"
    assert tokenize_main([str(tmp_path / "nope"), "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"checkpointless-tokenize: inputs={tmp_path / 'nope'}: no such file or directory;")
    assert "Traceback" not in err


def test_cli_subprocess(tmp_path: Path) -> None:
    _tree(tmp_path / "in")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.tokenize", str(tmp_path / "in"), "--output"]
    ok = subprocess.run([*cmd, str(tmp_path / "t")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("4 documents, 24 tokens -> ")
    assert IndexedTokens(tmp_path / "t").num_documents == 4
    bad = subprocess.run(
        [*cmd, str(tmp_path / "t"), "--glob", "*.none"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "no non-empty input file" in bad.stderr and "Traceback" not in bad.stderr
