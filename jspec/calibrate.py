"""`python -m jspec.calibrate`: measure the cost model (c, v, o) of a target and drafter on the devices here,
keep it in the user's cache (where `jspec.generate`, the CLI and the server find it), print it.

Parsing imports no JAX, so `--help` answers at once. User errors: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jspec import flags
from jspec.core import shipped
from jspec.core.settings import SpecConfig

EXAMPLES = """examples:
  python -m jspec.calibrate                                  # the shipped pair's EAGLE head, batch 1
  python -m jspec.calibrate --drafter model --batches 1,4,8 --json
  python -m jspec.calibrate --target HF_DIR --draft HF_DRAFT_DIR --batches 1,16
  python -m jspec.calibrate --target code --drafter ngram --write   # into the checkpoint (shipped figures)
"""


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jspec.calibrate", formatter_class=flags.Formatter, epilog=EXAMPLES,
                              description="Measure what a draft step, a verified token and a round cost here, "
                                          "for adaptive speculation.")
  flags.add_model_args(p)
  p.add_argument("--batches", default="1", metavar="B,B",
                 help="batch sizes to measure at (batch 1 always)")
  p.add_argument("--draft-len", type=int, default=SpecConfig().draft_len, metavar="K",
                 help="the longest draft whose round is timed (and 1, 2, 4, ... below it): the --draft-len you "
                      "decode with")
  p.add_argument("--repeats", type=int, default=5, metavar="N", help="interleaved timings per figure (medians)")
  p.add_argument("--write", action="store_true",
                 help="also store the figures in the drafter's checkpoint (n-gram's: the target's), as the shipped "
                      "checkpoints get theirs")
  p.add_argument("--json", action="store_true", help="print the cost model as JSON")
  return p


def batches(text: str) -> list[int]:
  try:
    values = sorted({1, *(int(b) for b in text.split(",") if b.strip())})
  except ValueError:
    raise ValueError(f"--batches: expected sizes such as 1,4,8, got {text!r}") from None
  if values[0] < 1:
    raise ValueError(f"--batches: sizes must be >= 1, got {text!r}")
  return values


def calibrate(args: argparse.Namespace) -> tuple[dict, str]:
  """Measures, stores, and returns (the figures as JSON, where they were stored)."""
  import jspec
  from jspec.core.settings import MAX_DRAFT_LEN
  from jspec.decoding.decoder import drafter_kind
  from jspec.formats import checkpoint
  from jspec.planning import calibration
  from jspec.speculation import costs

  sizes = batches(args.batches)
  if not 1 <= args.draft_len <= MAX_DRAFT_LEN or args.repeats < 1:
    raise ValueError(f"--draft-len must be in [1, {MAX_DRAFT_LEN}] and --repeats >= 1")
  if args.no_draft:
    raise ValueError("--no-draft: plain decoding has no cost model to calibrate")
  target = jspec.load(shipped.resolve(args.target), dtype=args.dtype, quantize=args.quantize)
  draft, kind = flags.load_draft(args, lambda path, **kw: jspec.load(path, dtype=args.dtype,
                                                                      quantize=args.draft_quantize, **kw))
  kind = kind or drafter_kind(draft)
  flags.log.info("measuring the %s drafter's costs at batch %s", kind, ", ".join(map(str, sizes)))
  cost = calibration.measure(target, draft, kind, sizes, args.repeats, args.draft_len)
  where = str(costs.store(target, draft, kind, cost))
  if args.write:
    path = pathlib_of(args, draft, kind)
    models = checkpoint.read_cost_models(path)
    if kind in models:  # a measured tree shape stays
      cost = dataclasses.replace(cost, tree_top_k=models[kind].tree_top_k, tree_nodes=models[kind].tree_nodes)
    checkpoint.write_cost_models(path, {**models, kind: cost})
    where += f" and {path}"
  return {"drafter": kind, **cost.to_json()}, where


def pathlib_of(args: argparse.Namespace, draft, kind: str):
  """The checkpoint directory a drafter's figures are written to: the draft's, or the target's for n-gram."""
  import pathlib
  if draft is None:
    return shipped.resolve(args.target)
  if args.draft is not None:
    return pathlib.Path(args.draft)
  return shipped.pair_of(args.target).drafts[kind]


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  flags.show_status(not args.json)
  figures, where = calibrate(args)
  if args.json:
    print(json.dumps({**figures, "stored": where}))
  else:
    rows = {1: figures, **{int(b): c for b, c in figures.get("batches", {}).items()}}
    print(f"{figures['drafter']} drafter on {figures['device_kind']} ({figures['backend']}):")
    for b, c in rows.items():
      rounds = " ".join(f"{x:.2f}" for x in c.get("round_costs", []))
      print(f"  batch {b:>3}: c {c['cost_ratio']:.3f}  v {c['verify_cost']:.3f}  o {c['round_overhead']:.3f}  "
            f"rounds of K = 1..{len(c.get('round_costs', []))}: {rounds}")
    print(f"stored in {where}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
