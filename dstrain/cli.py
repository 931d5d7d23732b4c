"""The ``dstrain`` command: ``dstrain export CKPT_DIR OUT_DIR [--step N] [--dtype fp32|bf16|fp16]
[--max-shard-size 5GB]`` writes a checkpoint's whole weights as Hugging Face safetensors files
(`dstrain.checkpoint.export`), without the training job."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstrain", description="dstrain tools")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "export",
        help="write a checkpoint's whole weights as Hugging Face safetensors files",
        description="Consolidate a dstrain checkpoint (any world size, ZeRO stage, offload) into "
        "model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json.",
    )
    e.add_argument("ckpt_dir", help="the checkpoint directory (save_checkpoint's save_dir)")
    e.add_argument("out_dir", help="where the safetensors files go (created)")
    e.add_argument("--step", type=int, default=None, help="the step to export (default: the latest)")
    e.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="dtype of the weights")
    e.add_argument(
        "--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)"
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from dstrain.checkpoint.export import export
    from dstrain.errors import DstrainError

    try:
        written = export(
            args.ckpt_dir,
            args.out_dir,
            step=args.step,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            progress=not args.no_progress,
        )
    except (DstrainError, ValueError, OSError) as e:
        print(f"dstrain export: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
