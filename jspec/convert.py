"""Checkpoint conversion.

  python -m jspec.convert HF_DIR OUT_DIR            # a Hugging Face directory (jspec.hf.FAMILIES) -> jspec
  python -m jspec.convert --to-hf JSPEC_DIR OUT_DIR # a jspec checkpoint -> a Hugging Face Llama directory
"""
from __future__ import annotations

import argparse
import sys

from jspec import flags
from jspec.checkpoint import save
from jspec.hf import save_hf
from jspec.loading import load


@flags.command
def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.convert")
  ap.add_argument("src", help="Hugging Face model directory (llama, qwen2 or mistral); with --to-hf, a jspec "
                  "checkpoint")
  ap.add_argument("out", help="output jspec checkpoint directory; with --to-hf, a Hugging Face directory")
  ap.add_argument("--to-hf", action="store_true", help="write a Hugging Face Llama directory (float32 safetensors)")
  ap.add_argument("--storage-dtype", default=None, help="e.g. bfloat16 to halve the files")
  args = ap.parse_args(argv)
  model = load(args.src)
  if args.to_hf:
    save_hf(model, args.out)
  else:
    save(model, args.out, storage_dtype=args.storage_dtype)
  print(f"wrote {args.out}: {model.config.n_layers} layers, width {model.config.dim}, "
        f"vocab {model.config.vocab_size}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
