"""`python -m jspec.plan`: what a deployment needs in memory on each device, whether it fits, and the largest
batch and context that do, from model directories or bare config files (no weights read).

Parsing imports no JAX, so `--help` answers at once. User errors: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from jspec import flags

EXAMPLES = """examples:
  python -m jspec.plan --batch-size 8 --context 2048
  python -m jspec.plan --target llama-70b/config.json --draft llama-1b/config.json --drafter model \\
      --dtype bfloat16 --mesh model=2 --device-memory 80GB --batch-size 64 --context 8192
"""
UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10,
         "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str) -> int:
  """"80GB", "80 GiB", "1.5e9": bytes."""
  match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
  unit = match and match.group(2).upper()
  try:
    value = float(match.group(1)) * UNITS[unit] if match else -1
  except (KeyError, ValueError):
    value = -1
  if value <= 0:
    raise ValueError(f"--device-memory: expected a size such as 80GB or 24GiB, got {text!r}")
  return int(value)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jspec.plan", formatter_class=flags.Formatter, epilog=EXAMPLES,
                              description="The memory a speculative deployment needs per device: target and "
                                          "draft weights, both KV caches and the workspace.")
  flags.add_model_args(p, config_files=True)
  g = p.add_argument_group("deployment")
  g.add_argument("--draft-len", type=int, default=4, metavar="K", help="the longest draft a round verifies")
  g.add_argument("--batch-size", type=int, default=1, metavar="B", help="rows decoded together")
  g.add_argument("--context", type=int, default=None, metavar="N",
                 help="tokens a row holds, prompt and output (default: the model's context)")
  g.add_argument("--prompt-len", type=int, default=None, metavar="P",
                 help="prompt tokens per row, prefilled together (default: half the context)")
  g.add_argument("--serving", action="store_true",
                 help="plan a server (python -m jspec.serve --max-model-len CONTEXT): any prompt up to the "
                      "context, prefilled one request at a time")
  g.add_argument("--mesh", default=None, metavar="SPEC", help="data=D,model=M: the devices it is sharded over")
  g.add_argument("--replicate-draft", action="store_true", help="with --mesh: the drafter unsharded")
  g.add_argument("--device-memory", default=None, metavar="SIZE",
                 help="memory per device, e.g. 80GB (default: the devices here; on the CPU the memory "
                      "available to this process)")
  g.add_argument("--memory-fraction", type=float, default=1.0, metavar="F",
                 help="share of each device's memory the deployment may use")
  g.add_argument("--estimate", action="store_true",
                 help="estimate the workspace instead of compiling the decode program to measure it (it is "
                      "always estimated for other devices: with --device-memory or --mesh)")
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  return p


def plan(args: argparse.Namespace):
  from jspec import loading, machine, memory, shaped, sharding
  from jspec.decoder import drafter_kind
  from jspec.settings import SpecConfig

  for name in ("batch_size", "context", "prompt_len", "draft_len"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  load = lambda path: loading.load_shapes(path, args.dtype)
  target = load(args.target)
  if not isinstance(target, loading.Model):
    raise ValueError(f"--target {args.target}: heads, not a model")
  draft, drafter = flags.load_draft(args, load)
  drafter = drafter or (draft and drafter_kind(draft))
  spec = None if drafter is None and draft is None else SpecConfig(args.draft_len, drafter=drafter)
  sizes = sharding.mesh_sizes(args.mesh or "")
  mesh = memory.planned_mesh(sizes) if args.mesh else None
  decoder = shaped.shaped_decoder(target, draft, spec, args.batch_size)
  context = args.context or decoder.context_len
  if context > decoder.context_len:
    raise ValueError(f"--context {context} exceeds the model's context of {decoder.context_len} tokens")
  prompt_len = min(args.prompt_len or max(context // 2, 1), context - 1) or 1
  # The workspace is measured on the devices here, and estimated for other hardware.
  here = None if args.device_memory is not None or args.mesh else True
  if args.device_memory is not None:
    available = (int(parse_bytes(args.device_memory) * args.memory_fraction), f"{args.device_memory} given")
  else:
    if mesh is not None and sizes["data"] * sizes["model"] > 1:
      raise ValueError("--mesh without --device-memory: say each device's memory")
    available = machine.budget(None, args.memory_fraction)
  measured = None if args.estimate or here is None else shaped.compiled_workspace_per_row(
      decoder, args.batch_size, context, prompt_len, mesh, args.serving)
  return memory.make_plan(decoder, args.batch_size, context, prompt_len, mesh=mesh,
                          shard_draft=not args.replicate_draft, memory=available, workspace_per_row=measured,
                          serving=args.serving), drafter


def describe(p, args: argparse.Namespace, drafter: str | None) -> str:
  from jspec.memory import gb
  u = p.usage
  figures = [("target weights", u.weights_bytes), ("draft weights", u.draft_weights_bytes),
          ("target KV cache", u.kv_cache_bytes), ("draft KV cache", u.draft_kv_cache_bytes),
          (f"workspace ({'measured' if p.workspace_source == 'compiled' else 'estimated'})", u.workspace_bytes)]
  rows = lambda n: f"{n} row{'s' * (n != 1)}"
  head = (f"{args.target} with {drafter + ' drafter' if drafter else 'no drafter'}: {rows(p.batch)} x "
          f"{p.context:,} tokens (prompts {p.prompt_len:,}), {p.devices} device{'s' * (p.devices > 1)}")
  lines = [head, *(f"  {name:<24}{gb(n):>12}" for name, n in figures),
           f"  {'total per device':<24}{gb(u.total_bytes):>12} of {gb(p.device_memory_bytes)} "
           f"({p.memory_source}): {'fits' if p.fits else 'does NOT fit'}",
           f"  largest batch at {p.context:,} tokens: {p.max_batch}",
           f"  largest context at {rows(p.batch)}: {p.max_context:,} tokens"]
  return "\n".join(lines)


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  flags.show_status(not args.json)
  result, drafter = plan(args)
  print(json.dumps(result.to_json()) if args.json else describe(result, args, drafter))
  return 0


if __name__ == "__main__":
  sys.exit(main())
