"""`checkpointless-export --run-dir RUN_DIR [--step N] --out DIR [--format hf]`: one step of a run's persistent
checkpoint as a directory the Hugging Face ecosystem loads (`transformers.LlamaForCausalLM.from_pretrained(DIR)`).

Reads the run's saved config and the checkpoint (`megatron.export`, no NeMo or megatron-core needed); writes the
model parameters only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.megatron.export import FORMATS, export_hf

PROG = "checkpointless-export"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Export one step of a run's persistent checkpoint as a Hugging Face Llama directory "
                               "(config.json + model.safetensors; parameters only).",
        epilog="example: checkpointless-export --run-dir runs/tiny_llama_nemo --out llama-hf")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR", help="the run.dir of a checkpointless-train run")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint step to export (default: the newest that verifies)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory to write")
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: a Hugging Face Llama (the default)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns 0, or 2 after printing one `ConfigError` message on stderr."""
    args = build_parser().parse_args(argv)
    try:
        if args.step is not None and args.step < 1:
            raise ConfigError("--step", args.step, "must be >= 1 (a checkpoint step)",
                              "leave --step out for the newest checkpoint")
        result = export_hf(args.run_dir, args.out, args.step)
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: step {result.step} -> {result.out} ({result.num_params:,} parameters, {result.dtype}); load "
          f"it with transformers.LlamaForCausalLM.from_pretrained({str(result.out)!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
