"""`python -m jspec.generate`: parse, call the library, print. User errors: one line on stderr, exit 2."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

CHECKPOINTS = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_TARGET = CHECKPOINTS / "code-target"
# The shipped weights of each drafter for the shipped target (ngram needs none).
SHIPPED_DRAFTS = {"model": CHECKPOINTS / "code-draft", "medusa": CHECKPOINTS / "code-target-medusa",
                  "eagle": CHECKPOINTS / "code-target-eagle"}
# c for each shipped drafter on the shipped target: one proposal's time over one target step, batch 1
# (tools/bench.py, "c" per drafter, measured on 2 CPU cores).
# Adaptive speculation's cost model for the shipped pair, in target steps, measured by tools/bench.py: c per
# drafter, o (a speculative round's time beyond its forwards) per drafter, v for the target.
SHIPPED_COST_RATIO = {"model": 0.082, "medusa": 0.061, "eagle": 0.177, "ngram": 0.006}
# o: fitted from fixed-K rounds (BENCHMARKS.md, the batch-1 sweep after the faster rounds).
SHIPPED_ROUND_OVERHEAD = {"model": 0.54, "medusa": 0.40, "eagle": 0.56, "ngram": 0.21}
SHIPPED_VERIFY_COST = 0.08
# The best measured speedup on held-out code at the default K = 4 and --max-new-tokens (README, "Drafters").
DEFAULT_DRAFTER = "model"
KINDS = ("model", "medusa", "eagle", "ngram")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jspec.generate",
                              description="Speculative decoding: a draft proposes, the target verifies, "
                                          "and the output is exactly the target's.")
  p.add_argument("--target", default=str(DEFAULT_TARGET), help="target checkpoint dir (default: shipped)")
  p.add_argument("--drafter", choices=KINDS, default=None,
                 help=f"who proposes tokens: a draft model, Medusa heads, an EAGLE head, or n-gram lookup in the "
                      f"context (default: {DEFAULT_DRAFTER}, or the kind of --draft)")
  p.add_argument("--draft", default=None, help="draft model or heads checkpoint dir (default: the shipped "
                                               "weights of the drafter when the target is the shipped one)")
  p.add_argument("--max-ngram", type=int, default=3, help="longest context match the ngram drafter tries")
  p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
  p.add_argument("--prompt-file", help="one prompt per line (write a newline inside a prompt as \\n), "
                                       "or JSONL with a \"prompt\" field")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--draft-len", type=int, default=4, help="tokens drafted per round (K)")
  p.add_argument("--seed", type=int, default=0, help="row b samples with seed + b")
  p.add_argument("--ignore-eos", action="store_true",
                 help="decode --max-new-tokens for every prompt, past any EOS (for benchmarks)")
  p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
  p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                 help="pick each round's K (up to --draft-len) from the carried acceptance, inside the loop, and "
                      "fall back to plain decoding when acceptance is low")
  p.add_argument("--fallback-threshold", type=float, default=0.4,
                 help="adaptive: plain steps while the windowed acceptance is below this (0 = never)")
  p.add_argument("--probe-interval", type=int, default=16,
                 help="adaptive: plain steps between speculative probes during fallback")
  p.add_argument("--cost-ratio", type=float, default=None,
                 help="adaptive: the drafter's step cost over the target's, c (default: measured for the "
                      "shipped drafters, else 0.1)")
  p.add_argument("--verify-cost", type=float, default=None,
                 help="adaptive: the target step's extra cost per extra verified token, v (default: measured "
                      "for the shipped target, else 0)")
  p.add_argument("--round-overhead", type=float, default=None,
                 help="adaptive: a speculative round's time beyond its forwards, in target steps, o (default: "
                      "measured for the shipped pair, else 0)")
  p.add_argument("--disable-at-batch-size", type=int, default=None,
                 help="decode plainly when the batch has at least this many prompts")
  p.add_argument("--typical-acceptance", action="store_true",
                 help="LOSSY: Medusa's typical acceptance instead of exact rejection sampling; output no longer "
                      "follows the target's distribution exactly when sampling (greedy output is unchanged)")
  p.add_argument("--baseline", action="store_true", help="also run plain decoding and report the speedup")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--mesh", default=None, help="shard over a device mesh, e.g. data=2,model=4 (default: one device)")
  p.add_argument("--replicate-draft", action="store_true", help="with --mesh: keep the drafter unsharded")
  p.add_argument("--coordinator", default=None, help="multi-process: HOST:PORT of process 0 (jax.distributed)")
  p.add_argument("--num-processes", type=int, default=None, help="multi-process: how many")
  p.add_argument("--process-id", type=int, default=None, help="multi-process: this one's index")
  return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
  prompts = list(args.prompt)
  if args.prompt_file:
    try:
      lines = pathlib.Path(args.prompt_file).read_text().splitlines()
    except OSError as e:
      raise ValueError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    for i, line in enumerate(lines):
      if line.lstrip().startswith("{"):
        try:
          prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
          raise ValueError(f"{args.prompt_file}:{i + 1}: not a JSON object with a \"prompt\" field") from None
      elif line.strip():
        prompts.append(line.replace("\\n", "\n"))
  if not prompts:
    raise ValueError("no prompt given: use --prompt TEXT or --prompt-file FILE")
  return prompts


def run(args: argparse.Namespace) -> dict:
  import jspec  # after argument parsing, so --help is instant

  prompts = read_prompts(args)
  mesh = None
  if args.mesh:
    from jspec import sharding
    mesh = sharding.make_mesh(args.mesh)
  target = jspec.load(args.target, mesh=mesh)
  draft, drafter = None, None
  if not args.no_draft:
    if args.draft is not None:
      draft, drafter = jspec.load(args.draft, mesh=None if args.replicate_draft else mesh), args.drafter
    else:
      drafter = args.drafter or DEFAULT_DRAFTER
      shipped = SHIPPED_DRAFTS.get(drafter)
      if shipped is not None:
        if pathlib.Path(args.target).resolve() != DEFAULT_TARGET:
          raise ValueError(f"the {drafter} drafter needs --draft DIR for a target other than the shipped one")
        draft = jspec.load(shipped, mesh=None if args.replicate_draft else mesh)
  shipped_pair = pathlib.Path(args.target).resolve() == DEFAULT_TARGET and args.draft is None
  measured = lambda given, value: given if given is not None else (value if shipped_pair else 0.0)
  opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
  result = jspec.generate(target, prompts, draft=draft, drafter=drafter, draft_len=args.draft_len,
                          max_ngram=args.max_ngram, typical_acceptance=args.typical_acceptance,
                          adaptive=args.adaptive, fallback_threshold=args.fallback_threshold,
                          probe_interval=args.probe_interval, disable_at_batch_size=args.disable_at_batch_size,
                          cost_ratio=args.cost_ratio or SHIPPED_COST_RATIO.get(drafter, 0.1),
                          verify_cost=measured(args.verify_cost, SHIPPED_VERIFY_COST),
                          round_overhead=measured(args.round_overhead, SHIPPED_ROUND_OVERHEAD.get(drafter, 0.0)),
                          mesh=mesh,
                          shard_draft=not args.replicate_draft, **opts)
  out = {"outputs": [{"prompt": p, "text": t, "token_ids": ids}
                     for p, t, ids in zip(prompts, result.texts, result.token_ids)],
         "stats": result.stats, "baseline": None, "speedup": None}
  if args.baseline:
    base = jspec.generate(target, prompts, **opts)
    out["baseline"] = {"tokens_per_second": base.stats["tokens_per_second"],
                       "wall_seconds": base.stats["wall_seconds"],
                       "token_ids_match": base.token_ids == result.token_ids}
    out["speedup"] = base.stats["wall_seconds"] / result.stats["wall_seconds"]
  return out


def print_human(out: dict) -> None:
  for o in out["outputs"]:
    print(o["prompt"] + o["text"])
    print("-" * 40)
  s = out["stats"]
  line = f"{s['emitted_tokens']} tokens in {s['wall_seconds']:.3f}s ({s['tokens_per_second']:.1f} tok/s, " \
         f"compile {s['compile_seconds']:.1f}s)"
  if s["acceptance_rate"] is not None:
    line += f"; acceptance {s['acceptance_rate']:.2f}, {s['mean_accepted_length']:.2f} tokens/target forward"
  if out["speedup"] is not None:
    line += f"; {out['speedup']:.2f}x over plain decoding" + \
            ("" if out["baseline"]["token_ids_match"] else " (tokens differ from plain decoding)")
  print(line)


def init_distributed(args: argparse.Namespace) -> bool:
  """Joins a multi-process run (flags, or JAX's standard environment variables); True on process 0."""
  import os

  import jax
  if args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  return jax.process_index() == 0


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    leader = init_distributed(args)
    out = run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not leader:  # every process ran the same program; one reports it
    return 0
  if args.json:
    print(json.dumps(out))
  else:
    print_human(out)
  return 0
