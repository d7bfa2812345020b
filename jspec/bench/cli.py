"""`python -m jspec.bench --suite NAME`: one suite, its JSON in --out DIR (and, for the sweep, Markdown tables
and plots). Every ratio is measured in one process, interleaved (A, B, A, B, ...), warm, as a median.

  python -m jspec.bench                              # the sweep: drafter x K x temperature x batch vs plain
  python -m jspec.bench --suite defaults --max-new-tokens 128 --also-drafters model   # what a user gets
  python -m jspec.bench --suite drafters --draft-lens 2,4,6 --prompt-sets code,thirdparty,prose   # per drafter
  python -m jspec.bench --target DIR --draft eagle=DIR --suite defaults   # your own pair
  python -m jspec.bench --suite serving --drafters eagle   # the server: speculative against plain, over HTTP
  python -m jspec.bench --suite paging --drafters eagle    # paged caches: capacity, prefix caching, chunks
  python -m jspec.bench --suite cross-vocab --draft-lens 4 --prompt-sets code   # drafts with another tokenizer
  python -m jspec.bench --suite structured --drafters eagle,model,medusa,ngram   # under constraints
  python -m jspec.bench --suite suffix --drafters ngram,eagle   # drafting from earlier requests' texts
  python -m jspec.bench --suite quantized --max-new-tokens 128 --prompts 16   # int8/fp8 targets against float
  python -m jspec.bench --suite gpu                  # the prepared check on one NVIDIA GPU (--smoke: anywhere)
  python -m jspec.bench --quick                      # a smoke run of the sweep on tiny random models (CI)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

import jax

import jspec
from jspec import flags, testing
from jspec.bench import cross_vocab, end_to_end, gpu, paging, parts, quantized, serving, structured, suffix, sweep
from jspec.bench.harness import machine
from jspec.bench.prompts import PROMPT_SETS
from jspec.core import shipped

# --draft-lens, --temperatures and --batches when not given (a suite may have its own)
DRAFT_LENS, TEMPERATURES, BATCHES = "1,2,3,4,5,6,7,8", "0,0.7,1.0", "1,4,8"


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def _kinds(args) -> list[str]:
  return args.drafters.split(",")


def _sweep(args, models: parts.Models, out_dir: pathlib.Path) -> dict:
  target = jspec.load(models.target)
  drafts = {kind: parts.shipped_pair(models, kind)[1] for kind in _kinds(args)}
  result = {"sets": {}}
  for name in args.prompt_sets.split(","):
    print(f"prompt set {name}", file=sys.stderr)

    def save(cells, name=name):
      result["sets"][name] = cells
      _write(out_dir, {"partial": True, **result})
    result["sets"][name] = sweep.suite_sweep(target, drafts, PROMPT_SETS[name](args.prompts),
                                             _ints(args.draft_lens or DRAFT_LENS),
                                             _floats(args.temperatures or TEMPERATURES), _ints(args.batches or BATCHES),
                                             args.max_new_tokens, args.repeats, save)
  if args.with_hf:
    from jspec.bench import hf
    result["hf"] = hf.compare(models.target, models.drafts["model"], PROMPT_SETS["code"](args.prompts),
                              args.max_new_tokens, args.repeats, out_dir / "hf")
  return result


def _quick(args, models: parts.Models, out_dir: pathlib.Path) -> dict:
  target = testing.random_model(testing.TINY, scale=2.0)
  drafts = {"model": testing.perturbed(target, 0.3), "ngram": None}
  return {"sets": {"quick": sweep.suite_sweep(target, drafts, ["def f(x):", "import os\n"], [2], [1.0], [1, 2],
                                              16, 1)}}


def _paging(args, models: parts.Models, out_dir: pathlib.Path) -> dict:
  result = paging.suite_paging(models, _kinds(args)[0])
  (out_dir / "paging.md").write_text(paging.markdown(result) + "\n")
  return result


def _gpu(args, models: parts.Models, out_dir: pathlib.Path) -> dict:
  if args.compile_for:
    return gpu.compiled_for(args.compile_for, args.smoke)
  return gpu.check(args.smoke, args.budget, lambda result: _write(out_dir, {"partial": True, **result}))


# The suites: name -> (what it measures, how to run it from the parsed flags).
SUITES: dict[str, tuple[str, Callable[[argparse.Namespace, parts.Models, pathlib.Path], dict]]] = {
    "sweep": ("drafter x K x temperature x batch against plain decoding", _sweep),
    "quick": ("the sweep on tiny random models, in seconds", _quick),
    "defaults": ("every default against plain decoding, per prompt: code and prose at batch 1, code at 4",
                 lambda a, m, o: end_to_end.suite_defaults(m, a.max_new_tokens, a.repeats, a.prompts,
                                                           tuple(_ints(a.also_draft_lens)),
                                                           tuple(a.also_drafters.split(",")) if a.also_drafters
                                                           else (), _cost_model(a.also_cost_model),
                                                           tuple(_ints(a.also_fixed_lens)))),
    "drafters": ("every drafter with the CLI defaults at each --draft-lens, per prompt set, against plain decoding",
                 lambda a, m, o: end_to_end.suite_drafters(m, _kinds(a), _ints(a.draft_lens or DRAFT_LENS),
                                                           a.prompt_sets.split(","), a.max_new_tokens, a.repeats,
                                                           a.prompts, _floats(a.temperatures or "0"),
                                                           _ints(a.batches or "1"))),
    "cross-vocab": ("drafts with other tokenizers (--compare DIRS) against the pair's draft model, fixed K",
                    lambda a, m, o: cross_vocab.suite_cross_vocab(m, a.compare.split(","),
                                                                  _ints(a.draft_lens or DRAFT_LENS),
                                                                  a.prompt_sets.split(","), a.max_new_tokens,
                                                                  a.repeats, a.prompts)),
    "adaptive": ("adaptive K and fallback against every fixed K",
                 lambda a, m, o: end_to_end.suite_adaptive(*parts.shipped_pair(m, _kinds(a)[0]), _kinds(a)[0],
                                                           a.max_new_tokens, a.repeats, a.prompts)),
    "stream": ("streaming's cost: segments against one loop",
               lambda a, m, o: end_to_end.suite_stream(m, _kinds(a)[0], a.max_new_tokens, a.repeats, a.prompts)),
    "batching": ("continuous batching against static batches",
                 lambda a, m, o: end_to_end.suite_batching(m, _kinds(a)[0], a.max_new_tokens, a.repeats, a.prompts)),
    "tree": ("draft trees against chains (--write: the fastest shape into the checkpoints)",
             lambda a, m, o: sweep.suite_tree(m, _kinds(a), _ints(a.draft_lens or DRAFT_LENS),
                                              _ints(a.batches or BATCHES),
                                              a.max_new_tokens, a.repeats, a.prompts, a.write, a.tree_depth,
                                              tuple(tuple(_ints(s.replace("x", ","))) for s in
                                                    a.tree_shapes.split(",")))),
    "round": ("where a round's time goes, per drafter and --draft-lens (default 4)",
              lambda a, m, o: {"rounds": [parts.suite_round(m, a.repeats, kind, k)
                                          for kind in _kinds(a) for k in _ints(a.draft_lens or "4")]}),
    "prefill": ("prefill time by prompt bucket", lambda a, m, o: parts.suite_prefill(m, a.repeats)),
    "structured": ("constraints: a permissive one's cost, and constrained speculative against constrained plain",
                   lambda a, m, o: structured.suite_structured(m, _kinds(a), a.max_new_tokens, a.repeats,
                                                               a.prompts)),
    "suffix": ("suffix drafting against other drafters on requests one after another: a repetitive workload "
               "(JSON records of one schema) and one without repetition (code)",
               lambda a, m, o: suffix.suite_suffix(m, _kinds(a), a.max_new_tokens, a.repeats, a.prompts)),
    "tables": ("constraint tables over a 128k-token vocabulary: states, classes, bytes, compile time",
               lambda a, m, o: structured.table_sizes()),
    "step": ("decode-step costs on a random model", lambda a, m, o: parts.suite_step(a.repeats)),
    "loop": ("loop overhead and the verify cost curve on a random ~31M model",
             lambda a, m, o: parts.suite_loop(a.repeats)),
    "serving": ("the OpenAI server under Poisson arrivals over HTTP, speculative against --no-draft",
                lambda a, m, o: serving.suite_serving(m, _kinds(a)[0], [float(r) for r in a.rates.split(",")],
                                                      a.requests, a.repeats, a.batch_size, out_dir=o)),
    "streaming": ("one streamed completion at a time through the server: chunks, first token and tokens/s "
                  "with short segments for young streams against 16-round ones",
                  lambda a, m, o: serving.suite_streaming(m, _kinds(a)[0], a.prompts, a.repeats,
                                                          a.max_new_tokens)),
    "paging": ("the paged engine: requests at once in a few slots' memory, a shared prefix's time to first "
               "token, streams' gaps while a long prompt goes in chunks", lambda a, m, o: _paging(a, m, o)),
    "quantized": ("the target in int8, fp8 and fp8-block against float: teacher-forced agreement and KL, each "
                  "drafter's tau, a plain step's and an EAGLE round's time",
                  lambda a, m, o: quantized.suite_quantized(m, _kinds(a), a.max_new_tokens, a.repeats, a.prompts)),
    "gpu": ("the prepared accelerator check: losslessness on the device, an 8B-shaped target against its "
            "weight-streaming bound, verify and round costs", _gpu),
}


def _cost_model(path: str | None):
  """The default drafter's entry of a cost_model.json."""
  from jspec.core.settings import CostModel
  return None if path is None else CostModel(**json.loads(pathlib.Path(path).read_text())[shipped.DEFAULT_DRAFTER])


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m jspec.bench", description=__doc__.split("\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="suites:\n" + "\n".join(f"  {k:<9} {v[0]}" for k, v in SUITES.items()))
  ap.add_argument("--suite", choices=list(SUITES), default="sweep")
  ap.add_argument("--quick", action="store_true", help="the same as --suite quick")
  ap.add_argument("--pair", choices=list(shipped.PAIRS), default=shipped.DEFAULT.name,
                  help="the shipped target and drafters to measure")
  ap.add_argument("--target", metavar="DIR", help="your own target instead of a shipped pair's")
  ap.add_argument("--draft", action="append", default=[], metavar="KIND=DIR",
                  help="with --target: a drafter's weights (repeat for several kinds)")
  ap.add_argument("--write", action="store_true",
                  help="--suite tree: store the fastest tree shapes in the checkpoints (the cost models: "
                       "python -m jspec.calibrate --write)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--draft-lens", help=f"default {DRAFT_LENS} (--suite round: 4)")
  ap.add_argument("--temperatures", help=f"default {TEMPERATURES} (--suite drafters: 0)")
  ap.add_argument("--batches", help=f"default {BATCHES} (--suite drafters: 1)")
  ap.add_argument("--drafters", default="model,medusa,eagle,ngram")
  ap.add_argument("--also-draft-lens", default="", help="--suite defaults: also time these longest drafts")
  ap.add_argument("--also-fixed-lens", default="",
                  help="--suite defaults: also time these fixed draft lengths (adaptive K off)")
  ap.add_argument("--also-drafters", default="", help="--suite defaults: also time these drafters")
  ap.add_argument("--also-cost-model", default=None, metavar="FILE",
                  help="--suite defaults: also time the default drafter with this cost_model.json's figures")
  ap.add_argument("--compare", default="checkpoints/code-draft-4k", metavar="DIRS",
                  help="--suite cross-vocab: draft model directories (any tokenizer), comma-separated")
  ap.add_argument("--tree-depth", type=int, default=4, help="--suite tree: the trees' depth")
  ap.add_argument("--tree-shapes", default="2x8,4x16,4x32", help="--suite tree: top-k x nodes of each tree")
  ap.add_argument("--prompt-sets", default="code",
                  help="comma-separated: code (held-out stdlib completions), thirdparty (installed packages' code), "
                       "edit (context editing), prose (English)")
  ap.add_argument("--with-hf", action="store_true",
                  help="the sweep: also Hugging Face transformers' assisted generation (needs [interop])")
  ap.add_argument("--rates", default="1,2,4", help="--suite serving: Poisson arrival rates, requests/s")
  ap.add_argument("--requests", type=int, default=24, help="--suite serving: requests per load")
  ap.add_argument("--batch-size", type=int, default=8, help="--suite serving: the servers' slots")
  ap.add_argument("--smoke", action="store_true", help="--suite gpu: tiny shapes, on any backend")
  ap.add_argument("--budget", type=float, default=420.0, help="--suite gpu: seconds; later sections are skipped")
  ap.add_argument("--compile-for", default=None, metavar="gpu:CHIP:COUNT",
                  help="--suite gpu: compile its target and rounds programs here for that GPU (or tpu:CHIP:TOPOLOGY) "
                       "with abstract weights, running none (needs pip install -e \".[gpu-compile]\")")
  ap.add_argument("--out", default="bench-out", help="directory for bench.json (and the sweep's bench.md, plots)")
  return ap


def _models(args) -> parts.Models:
  if args.target is None:
    if args.draft:
      raise SystemExit("error: --draft needs --target")
    return parts.shipped_models(args.pair)
  drafts = {}
  for entry in args.draft:
    kind, _, where = entry.partition("=")
    if not where:
      raise SystemExit(f"error: --draft {entry}: write KIND=DIR")
    drafts[kind] = pathlib.Path(where)
  return parts.Models(pathlib.Path(args.target), drafts)


def _write(out_dir: pathlib.Path, result: dict) -> None:
  text = json.dumps(result, indent=2, default=lambda x: x.item() if hasattr(x, "item") else str(x))
  (out_dir / "bench.json").write_text(text)


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  suite = "quick" if args.quick else args.suite
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  result = SUITES[suite][1](args, _models(args), out_dir)
  result = {"suite": suite, "command": " ".join(sys.argv), "jax": jax.__version__,
            "device": str(jax.devices()[0].device_kind), "machine": machine(), **result}
  _write(out_dir, result)
  if suite in ("sweep", "quick"):
    from jspec.bench import report
    (out_dir / "bench.md").write_text(report.markdown(result))
    report.plots(result, out_dir)
  print(json.dumps({k: v for k, v in result.items() if k != "sets"}, indent=2, default=str))
  print(f"wrote {out_dir}/bench.json", file=sys.stderr)
  return 0 if result.get("ok", True) else 1
