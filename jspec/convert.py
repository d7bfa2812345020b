"""Checkpoint conversion.

  python -m jspec.convert HF_DIR OUT_DIR            # a Hugging Face directory (jspec.model.hf_config.FAMILIES) -> jspec
  python -m jspec.convert HF_DIR OUT_DIR --quantize fp8              # ... with fp8 (or int8) linear layers
  python -m jspec.convert --to-hf JSPEC_DIR OUT_DIR # a jspec checkpoint -> a Hugging Face Llama directory
  python -m jspec.convert --to speculators HEADS OUT_DIR --target TARGET
                                                    # jspec heads -> a published format (`jspec.formats.head_formats`)
"""
from __future__ import annotations

import argparse
import sys

from jspec import flags
from jspec.core import shipped
from jspec.core.settings import WEIGHT_FORMATS, SpecConfig
from jspec.drafters import Heads
from jspec.formats import head_formats
from jspec.formats.checkpoint import save
from jspec.formats.loading import load
from jspec.model.hf import save_hf
from jspec.model.model import Model


@flags.command
def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.convert")
  ap.add_argument("src", help="Hugging Face model directory (llama, qwen2 or mistral); with --to-hf, a jspec "
                  "checkpoint; with --to, jspec heads (EAGLE, Medusa or DFlash)")
  ap.add_argument("out", help="output jspec checkpoint directory; with --to-hf, a Hugging Face directory; with --to, "
                  "the head directory to write")
  ap.add_argument("--to-hf", action="store_true", help="write a Hugging Face Llama directory (float32 safetensors)")
  ap.add_argument("--to", choices=head_formats.formats(),
                  help="write heads in a published format: speculators (vLLM; EAGLE-3), eagle3 (the EAGLE "
                       "repository's, SGLang's), eagle (EAGLE-1 or EAGLE-3 as the EAGLE repository writes them), "
                       "medusa (vLLM's layout), dflash (z-lab's DFlash layout)")
  ap.add_argument("--target", help="with --to: the target the heads draft for (a shipped pair's name or a directory)")
  ap.add_argument("--verifier", help="with --to: the target's name as the serving system will load it, recorded in "
                  "the head's config (default: --target as given)")
  ap.add_argument("--storage-dtype", default=None, help="e.g. bfloat16 to halve the files (quantized weights and "
                  "their scales are kept as they are)")
  ap.add_argument("--quantize", choices=WEIGHT_FORMATS, default=None,
                  help="write the linear layers (attention, MLP) quantized: int8 or fp8 with a scale per output "
                       "channel, fp8-block with one per 128 x 128 block")
  args = ap.parse_args(argv)
  if args.to:
    if args.target is None:
      raise ValueError("--to needs --target: the model the heads draft for")
    heads, target = load(args.src, dtype="float32"), load(shipped.resolve(args.target), dtype="float32")
    if not isinstance(heads, Heads) or not isinstance(target, Model):
      raise ValueError("--to: SRC must be EAGLE, Medusa or DFlash heads and --target a model")
    # refuses heads that do not fit the target, with both figures
    heads.drafter.for_pair(target, heads, SpecConfig(1, drafter=heads.drafter.kind, adaptive=None))
    head_formats.export(heads, args.to, args.out, target, args.verifier or args.target)
    print(f"wrote {args.out}: {heads.drafter.kind} heads as {args.to} for {args.verifier or args.target}")
    return 0
  if args.quantize and (args.to_hf or args.to):
    raise ValueError("--quantize writes a jspec checkpoint; --to-hf and --to write float weights")
  model = load(args.src, quantize=args.quantize)
  if args.to_hf:
    save_hf(model, args.out)
  else:
    save(model, args.out, storage_dtype=args.storage_dtype)
  print(f"wrote {args.out}: {model.config.n_layers} layers, width {model.config.dim}, "
        f"vocab {model.config.vocab_size}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
