"""`python -m jspec.convert HF_DIR OUT_DIR`: a Hugging Face model directory -> a jspec checkpoint."""
from __future__ import annotations

import argparse
import sys

from jspec.checkpoint import load, save


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.convert")
  ap.add_argument("src", help="Hugging Face model directory (llama, qwen2 or mistral)")
  ap.add_argument("out", help="output jspec checkpoint directory")
  ap.add_argument("--storage-dtype", default=None, help="e.g. bfloat16 to halve the files")
  args = ap.parse_args(argv)
  try:
    model = load(args.src)
    save(model, args.out, storage_dtype=args.storage_dtype)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {model.config.n_layers} layers, width {model.config.dim}, "
        f"vocab {model.config.vocab_size}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
