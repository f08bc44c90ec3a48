"""``checkpointless-tokenize``: byte-tokenise text files into a Megatron ``PREFIX.bin`` / ``PREFIX.idx`` pair.

Each input file becomes one document (empty files are skipped); directories are walked recursively in sorted
order, keeping files whose name matches ``--glob``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nemo_checkpointless.data.corpus import expand_inputs, tokenize_files
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.errors import ConfigError

DTYPES = ("uint16", "uint8", "int32")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="checkpointless-tokenize",
        description="Byte-tokenise files (token id = byte value, vocab 256) into PREFIX.bin + PREFIX.idx.",
    )
    p.add_argument("inputs", nargs="+", metavar="FILE_OR_DIR", help="files, or directories to walk recursively")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--dtype", choices=DTYPES, default="uint16", help="token storage type (default: uint16)")
    p.add_argument("--glob", default="*", help="file-name pattern for files found in directories (default: '*')")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns 0, or 2 after printing a ``ConfigError`` message on stderr."""
    args = build_parser().parse_args(argv)
    try:
        files = expand_inputs(args.inputs, glob=args.glob)
        prefix = tokenize_files(files, args.output, dtype=args.dtype)
        data = IndexedTokens(prefix)
    except ConfigError as e:
        print(f"checkpointless-tokenize: {e}", file=sys.stderr)
        return 2
    print(f"{data.num_documents} documents, {data.num_tokens} tokens -> {data.bin_path} {data.idx_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
