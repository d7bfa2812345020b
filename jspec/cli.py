"""The command line of `python -m jspec.generate` (`jspec/generate.py` runs it: a module named `generate` would
shadow the API's `jspec.generate`): parse, call the library, print. User errors: one line on stderr, exit 2
(`jspec.flags.command`). Parsing imports no JAX, so `--help` and `--version` answer at once.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import time

import jspec
from jspec import flags, outputs
from jspec.core.settings import SamplingConfig

EXAMPLES = """examples:
  python -m jspec.generate --prompt "def parse_args("
  python -m jspec.generate --prompt "def f(" --prompt "class A:" --max-new-tokens 96 --baseline --json
  python -m jspec.generate --drafter eagle --no-adaptive --temperature 0.7 --top-p 0.95 --prompt "import os"
  python -m jspec.generate --drafter eagle --tree --draft-len 5 --tree-top-k 4 --tree-nodes 24 --prompt "def f("
  python -m jspec.generate --prompt "def f(" --regex "[a-z_]+\\(\\)"
  python -m jspec.generate --target HF_DIR --draft HF_DRAFT_DIR --prompt "Hello"
  python -m jspec.generate --prompt-file prompts.txt --batch-size 8 --output out.jsonl
  python -m jspec.generate --mesh data=2,model=4 --prompt-file prompts.jsonl --json
"""
log = flags.log


def parser() -> argparse.ArgumentParser:
  sampling = SamplingConfig()
  p = argparse.ArgumentParser(prog="python -m jspec.generate", formatter_class=flags.Formatter, epilog=EXAMPLES,
                              description="Speculative decoding: a draft proposes, the target verifies, "
                                          "and the output is exactly the target's.")
  p.add_argument("--version", action="version", version=f"jspec {jspec.__version__}")
  flags.add_model_args(p)
  g = p.add_argument_group("prompts and output")
  g.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeat for a batch")
  g.add_argument("--prompt-file", metavar="FILE", help="one prompt per line (write a newline inside a prompt as \\n), "
                                       "or JSONL with a \"prompt\" field")
  g.add_argument("--chat", action="store_true",
                 help="render each prompt as a user turn of the target's chat template")
  g.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt")
  g.add_argument("--ignore-eos", action="store_true",
                 help="decode --max-new-tokens for every prompt, past any EOS (for benchmarks)")
  g.add_argument("--batch-size", type=int, default=8, metavar="B",
                 help="rows decoded together; more prompts than this are decoded by continuous batching: each "
                      "finished row takes the next prompt")
  g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                 help="print text as it is accepted (default: when stdout is a terminal, without --json and "
                      "--output)")
  g.add_argument("--output", metavar="FILE.jsonl",
                 help="write one JSON line per prompt as it finishes; a rerun skips the prompts already there")
  g.add_argument("--json", action="store_true", help="print one JSON object at the end")
  g.add_argument("--quiet", action="store_true", help="no status lines or progress bar on stderr")
  g.add_argument("--baseline", action="store_true",
                 help="also run plain decoding and report the speedup: after one untimed run of each, --repeats "
                      "timed runs of the two, interleaved; the ratio of their median times")
  g.add_argument("--repeats", type=int, default=3, metavar="N", help="timed runs of each with --baseline")

  g = p.add_argument_group("sampling")
  g.add_argument("--temperature", type=float, default=sampling.temperature, metavar="T", help="0 = greedy")
  g.add_argument("--top-k", type=int, default=sampling.top_k, metavar="K", help="0 = off")
  g.add_argument("--top-p", type=float, default=sampling.top_p, metavar="P", help="1 = off")
  g.add_argument("--seed", type=int, default=0, metavar="S", help="row b samples with seed + b")

  g = p.add_argument_group("structured output (one of them, for every prompt)")
  g.add_argument("--regex", metavar="PATTERN", help="the output matches PATTERN in full")
  g.add_argument("--json-schema", metavar="FILE_OR_JSON",
                 help="the output is one JSON value valid under this schema (a file, or the JSON text)")
  g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                 help="the output is one of these texts; repeat for each choice")

  flags.add_speculation_args(p)
  flags.add_runtime_args(p)
  return p


def read_prompts(args: argparse.Namespace) -> list[str]:
  prompts = list(args.prompt)
  if args.prompt_file:
    try:
      lines = pathlib.Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except OSError as e:
      raise ValueError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    except UnicodeDecodeError as e:
      raise ValueError(f"{args.prompt_file}: not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(lines):
      where = f"{args.prompt_file}:{i + 1}"
      if line.lstrip().startswith("{"):
        try:
          prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
          raise ValueError(f"{where}: not a JSON object with a \"prompt\" field") from None
        if not isinstance(prompt, str):
          raise ValueError(f"{where}: \"prompt\" must be a string, got {type(prompt).__name__}")
        prompts.append(prompt)
      elif line.strip():
        prompts.append(line.replace("\\n", "\n"))
  if not prompts:
    raise ValueError("no prompt given: use --prompt TEXT or --prompt-file FILE")
  empty = next((i for i, p in enumerate(prompts) if not p), None)
  if empty is not None:
    raise ValueError(f"prompt {empty} is empty")
  return prompts


def constraint(args: argparse.Namespace) -> jspec.Regex | jspec.JsonSchema | jspec.Choice | None:
  """The constraint the flags ask for (a bad one is a ValueError)."""
  given = [name for name in ("regex", "json_schema", "choice") if getattr(args, name) is not None]
  if len(given) > 1:
    raise ValueError("give one of --regex, --json-schema and --choice")
  if args.regex is not None:
    return jspec.Regex(args.regex)
  if args.choice is not None:
    return jspec.Choice(args.choice)
  if args.json_schema is None:
    return None
  path = pathlib.Path(args.json_schema)
  try:
    text = path.read_text() if path.is_file() else args.json_schema
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read --json-schema {path}: {e}") from None
  try:
    return jspec.JsonSchema(text)
  except ValueError as e:
    raise ValueError(f"--json-schema: neither a readable file nor a valid schema ({e})") from None


def output_entry(index: int, prompt: str, text: str, token_ids: list[int], stats) -> dict:
  return {"index": index, "prompt": prompt, "text": text, "token_ids": token_ids, "stats": stats.to_dict()}


def run(args: argparse.Namespace) -> tuple[dict, bool]:
  """Decodes the prompts as the flags say. Returns the JSON result and whether the texts were printed
  already (streamed)."""
  prompts = read_prompts(args)
  sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, ignore_eos=args.ignore_eos, chat=args.chat, constraint=constraint(args))
  SamplingConfig(args.temperature, args.top_k, args.top_p)  # bad values fail before anything loads
  spec = flags.speculation(args)
  if args.max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {args.max_new_tokens}")
  if args.batch_size < 1:
    raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
  if args.output and not pathlib.Path(args.output).absolute().parent.is_dir():
    raise ValueError(f"--output: no directory {pathlib.Path(args.output).absolute().parent}")
  if args.output and pathlib.Path(args.output).is_dir():
    raise ValueError(f"--output: {args.output} is a directory")
  if args.baseline and args.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
  if args.baseline and (args.output or args.stream or len(prompts) > args.batch_size):
    raise ValueError("--baseline times one batch: give at most --batch-size prompts, and no --output or --stream")
  output = outputs.JsonlOutput(args.output, prompts) if args.output else None
  target, models = flags.load_models(args, spec)
  streaming = args.stream if args.stream is not None else sys.stdout.isatty() and not (args.json or args.output)
  if output is None and not streaming and len(prompts) <= args.batch_size:
    return run_batch(args, target, models, prompts, sampling), False
  return run_stream(args, target, models, prompts, sampling, output, streaming and not args.json), streaming


def run_batch(args: argparse.Namespace, target, models: dict, prompts: list[str], sampling: dict) -> dict:
  """The prompts as one batch, in one executable call; with --baseline, timed against plain decoding."""
  speculative = lambda: jspec.generate(target, prompts, seed=args.seed, **models, **sampling)
  result = speculative()
  out = {"outputs": [output_entry(i, *row) for i, row in
                     enumerate(zip(prompts, result.texts, result.token_ids, result.request_stats))],
         "stats": result.stats.to_dict(), "baseline": None, "speedup": None}
  if args.baseline:
    plain = lambda: jspec.generate(target, prompts, seed=args.seed, mesh=models["mesh"], attention=models["attention"],
                                   **sampling)
    base = plain()  # both have now run once untimed: compiled, and the caches warm
    from jspec.core.timing import interleaved_runs
    walls = interleaved_runs({"speculative": lambda: speculative().stats.wall_seconds,
                              "plain": lambda: plain().stats.wall_seconds},
                             args.repeats, warmup=False, reports_seconds=True)
    ratios = [p / s for p, s in zip(walls["plain"], walls["speculative"])]
    median_plain = statistics.median(walls["plain"])
    out["baseline"] = {"tokens_per_second": base.stats.emitted_tokens / median_plain,
                       "wall_seconds": median_plain, "token_ids_match": base.token_ids == result.token_ids,
                       "repeats": args.repeats, "speedup_min": min(ratios), "speedup_max": max(ratios)}
    out["speedup"] = median_plain / statistics.median(walls["speculative"])
  return out


def run_stream(args: argparse.Namespace, target, models: dict, prompts: list[str], sampling: dict,
               output: outputs.JsonlOutput | None, printing: bool) -> dict:
  """Segmented decoding: continuous batching over --batch-size slots, text printed as it is accepted
  (`printing`), lines written to --output as prompts finish, and a progress bar."""
  from tqdm import tqdm

  todo = [i for i in range(len(prompts)) if output is None or i not in output.done]
  out = {"outputs": [], "stats": None, "baseline": None, "speedup": None}
  if not todo:
    log.info("all %d prompts are in %s already", len(prompts), args.output)
    return out
  stream = jspec.stream(target, [prompts[i] for i in todo], seed=[args.seed + i for i in todo],
                        batch_size=args.batch_size, **models, **sampling)
  printer = outputs.OrderedPrinter([prompts[i] for i in todo]) if printing else None
  bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="prompt", file=sys.stderr,
             disable=args.quiet or printer is not None or (output is None and len(todo) <= args.batch_size))
  ids, texts, totals = collections.defaultdict(list), collections.defaultdict(str), collections.Counter()
  begin = time.perf_counter()
  for delta in stream:
    ids[delta.index] += delta.token_ids
    texts[delta.index] += delta.text
    if printer is not None:
      printer.add(delta.index, delta.text, delta.finished)
    if not delta.finished:
      continue
    index = todo[delta.index]
    entry = output_entry(index, prompts[index], texts[delta.index], ids[delta.index], delta.stats)
    out["outputs"].append(entry)
    if output is not None:
      output.write(entry)
    totals.update(tokens=delta.stats.emitted_tokens, drafted=delta.stats.drafted_tokens,
                  accepted=delta.stats.accepted_tokens)
    bar.update(1)
    decoding = time.perf_counter() - begin - stream.compile_seconds
    bar.set_postfix(tok_s=f"{totals['tokens'] / decoding:.0f}",
                    acceptance=f"{totals['accepted'] / totals['drafted']:.2f}" if totals["drafted"] else "-")
  bar.close()
  out["outputs"].sort(key=lambda e: e["index"])
  out["stats"] = stream.stats.to_dict()
  return out


def print_human(out: dict, texts: bool) -> None:
  if texts:
    for o in out["outputs"]:
      print(o["prompt"] + o["text"])
      print(outputs.SEPARATOR)
  s = out["stats"]
  if s is None:
    return
  line = f"{s['emitted_tokens']} tokens in {s['wall_seconds']:.3f}s ({s['tokens_per_second']:.1f} tok/s, " \
         f"compile {s['compile_seconds']:.1f}s)"
  if s["acceptance_rate"] is not None:
    line += f"; acceptance {s['acceptance_rate']:.2f}, {s['mean_accepted_length']:.2f} tokens/target forward"
  if out["speedup"] is not None:
    b = out["baseline"]
    line += f"; {out['speedup']:.2f}x over plain decoding (median of {b['repeats']}, " \
            f"{b['speedup_min']:.2f}-{b['speedup_max']:.2f}x)" + \
            ("" if b["token_ids_match"] else " (tokens differ from plain decoding)")
  print(line)


def calibrate_command(args: argparse.Namespace, rows: int) -> str:
  """The `python -m jspec.calibrate` command for the models these flags chose, decoding `rows` rows."""
  words = ["python -m jspec.calibrate", f"--target {args.target}"]
  words += [f"--draft {args.draft}"] * (args.draft is not None) + [f"--drafter {args.drafter}"] * bool(args.drafter)
  words += [f"--dtype {args.dtype}"] * bool(args.dtype) + [f"--batches 1,{rows}"] * (rows > 1)
  return " ".join(words)


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  flags.show_status(not (args.quiet or args.json))
  leader = flags.init_distributed(args)
  if not args.no_compile_cache:
    # Its programs load from now on, beside the imports and the models.
    from jspec.decoding import executables, program_cache
    executables.prefetch(args.compile_cache, json.dumps(vars(args), sort_keys=True, default=str))
    program_cache.use_compile_cache(args.compile_cache)
  out, printed = run(args)
  if not leader:  # every process ran the same program; one reports it
    return 0
  cost = (out.get("stats") or {}).get("cost_model")
  if cost and cost["source"] != "calibrated" and not args.quiet:
    figures = "neutral cost figures" if cost["source"] == "neutral" else "the checkpoint's cost figures"
    print(f"note: adaptive speculation ran on {figures} (none measured for these models on this device); "
          f"measure them once with: {calibrate_command(args, min(args.batch_size, len(out['outputs'])))}",
          file=sys.stderr)
  if args.json:
    print(json.dumps(out))
  else:
    print_human(out, texts=not (printed or args.output))
  return 0
