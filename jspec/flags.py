"""The flags and conventions every jspec command shares: the model, speculation, compilation and mesh flags,
loading the models they name, status lines on stderr, and one way to report bad input.

A command is `python -m jspec.NAME`. Its parser and `main(argv) -> int`, decorated with `command`, live in
the module `jspec.NAME` (`calibrate`, `plan`, `convert`), unless that module is only an entry that runs them
from elsewhere: a package's command lives in its `cli` module (`jspec.serve.cli`, `jspec.bench.cli`), the
generate command in `jspec.cli` (a module named `generate` would shadow the API's `jspec.generate`), and the
training commands (`train`, `data`, `continuations`) beside their code in `jspec.train`. Parsing imports
no JAX, so `--help` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable

import jspec
from jspec.core import shipped
from jspec.core.settings import (
  ATTENTION_CHOICES,
  DEFAULT_TREE,
  DRAFTERS,
  DTYPES,
  MAX_DRAFT_LEN,
  MAX_NGRAM,
  WEIGHT_FORMATS,
  AdaptiveConfig,
  SpecConfig,
  TreeConfig,
  user_cache_dir,
)

log = logging.getLogger("jspec")


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
  """A command's `main(argv) -> int`, reporting bad input the one way every jspec command does: a
  ValueError prints `error: <its message>` as one line on stderr, and the command exits with status 2."""
  @functools.wraps(main)
  def run(argv: list[str] | None = None) -> int:
    try:
      return main(argv)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  return run


class Formatter(argparse.RawDescriptionHelpFormatter):
  """Shows each flag's default where it has one worth saying and its help does not already say it."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if "default" not in text and not any(action.default is x for x in (None, False, argparse.SUPPRESS)) \
        and action.default != []:
      text += " (default: %(default)s)"
    return text


def add_model_args(p: argparse.ArgumentParser, config_files: bool = False) -> None:
  """The flags that choose the target and the drafter. `config_files`: a bare config.json (or drafter.json)
  stands for a model, as a memory plan reads no weights."""
  what = "PATH" if config_files else "DIR"
  g = p.add_argument_group("models")
  g.add_argument("--target", default=shipped.DEFAULT.name, metavar=what,
                 help="target checkpoint: a jspec or Hugging Face model directory"
                      + (" or its config.json" if config_files else "")
                      + f", or the name of a shipped pair ({', '.join(shipped.PAIRS)}; default: "
                        f"{shipped.DEFAULT.name})")
  g.add_argument("--draft", default=None, metavar=what,
                 help="draft model (any tokenizer) or Medusa/EAGLE heads directory"
                      + (", or its config.json / drafter.json" if config_files else "")
                      + " (default: the shipped weights of --drafter when the target is a shipped one)")
  g.add_argument("--drafter", choices=DRAFTERS, default=None,
                 help=f"who proposes tokens: a draft model, Medusa heads, an EAGLE head, n-gram lookup in the "
                      f"context, other requests' texts (suffix), or the MTP layer of --target's checkpoint (mtp) "
                      f"(default: the kind of --draft, else {shipped.DEFAULT_DRAFTER})")
  g.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
  g.add_argument("--dtype", choices=DTYPES, default=None,
                 help="parameters and activations (default: float32 on the CPU, bfloat16 on accelerators)")
  g.add_argument("--quantize", choices=WEIGHT_FORMATS, default=None,
                 help="the target's attention and MLP weights quantized at load: int8 or fp8 (e4m3) with a scale "
                      "per output channel, fp8-block with one per 128 x 128 block; weight-only, activations stay in "
                      "--dtype (a checkpoint stored quantized loads as stored without it)")
  g.add_argument("--draft-quantize", choices=WEIGHT_FORMATS, default=None,
                 help="the same for the draft model or EAGLE head")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
  """Speculation, adaptive K and draft trees (shared with `python -m jspec.serve`)."""
  spec, adaptive = SpecConfig(), AdaptiveConfig()
  g = p.add_argument_group("speculation")
  g.add_argument("--draft-len", type=int, default=spec.draft_len, metavar="K",
                 help=f"tokens drafted per round, K (at most {MAX_DRAFT_LEN}); the largest K when adaptive "
                      "(and at most Medusa's heads)")
  g.add_argument("--max-ngram", type=int, default=spec.max_ngram, metavar="M",
                 help=f"longest match of a row's own context the ngram and suffix drafters try (at most {MAX_NGRAM})")
  g.add_argument("--suffix-cache-tokens", type=int, default=spec.suffix_cache_tokens, metavar="N",
                 help="past tokens (earlier requests' prompts and outputs) the suffix drafter's index holds, on the "
                      "device: about 36 bytes each")
  g.add_argument("--typical-acceptance", action="store_true",
                 help="LOSSY: Medusa's typical acceptance instead of exact rejection sampling; output no longer "
                      "follows the target's distribution exactly when sampling (greedy output is unchanged)")
  g.add_argument("--disable-at-batch-size", type=int, default=None, metavar="B",
                 help="decode plainly while at least this many rows run (without adaptive K: when the batch "
                      "has that many)")

  g = p.add_argument_group("adaptive speculation")
  g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                 help="pick each round's K (up to --draft-len) from the carried acceptance, inside the loop, and "
                      "fall back to plain decoding when acceptance is low; --no-adaptive drafts --draft-len "
                      "tokens every round (default: on)")
  g.add_argument("--fallback-threshold", type=float, default=adaptive.fallback_threshold, metavar="A",
                 help="plain steps while the windowed acceptance is below this (0 = never)")
  g.add_argument("--probe-interval", type=int, default=adaptive.probe_interval, metavar="N",
                 help="plain steps between speculative probes during fallback")
  g.add_argument("--adaptive-draft-lens", default=None, metavar="K,K,...",
                 help="the draft lengths adaptive K chooses among, each a branch of the compiled round (default: "
                      "1, 2, 4, ... and --draft-len; offering every K compiles and loads more slowly)")
  g.add_argument("--cost-ratio", type=float, default=None, metavar="C",
                 help="c: the drafter's step cost over the target's (default: measured, from the drafter's "
                      "checkpoint, else 0.1; 0 for ngram)")
  g.add_argument("--verify-cost", type=float, default=None, metavar="V",
                 help="v: a target forward's extra cost per extra verified token, in target steps (default: "
                      "measured, else 0)")
  g.add_argument("--round-overhead", type=float, default=None, metavar="O",
                 help="o: a speculative round's time beyond its forwards, in target steps (default: measured, "
                      "else 0)")

  g = p.add_argument_group("draft trees")
  g.add_argument("--tree", action=argparse.BooleanOptionalAction, default=False,
                 help="draft a token tree of depth --draft-len instead of a chain, all verified in one target "
                      "forward, so a rejected token's sibling can still be accepted (medusa: a static tree; eagle "
                      "and model: EAGLE-2's dynamic tree); rounds keep that shape (no adaptive K)")
  g.add_argument("--tree-top-k", type=int, default=None, metavar="K",
                 help="children per expanded node: the draft's top-K tokens (default: the drafter's measured "
                      f"shape, from its checkpoint, else {DEFAULT_TREE[0]})")
  g.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                 help=f"nodes verified per round (default: measured, else {DEFAULT_TREE[1]})")
  g.add_argument("--tree-sampled", action="store_true",
                 help="eagle, model: when sampling, draw each node's children from the draft's distribution "
                      "(SpecInfer's multi-draft rule) instead of taking its top-k")
  g.add_argument("--tree-choices", metavar="JSON",
                 help="medusa: the static tree as a JSON list of paths of ranks, as Medusa's tree_choices "
                      "(default: the --tree-nodes paths likeliest to be accepted)")


def add_attention_arg(g) -> None:
  g.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto",
                 help="how attention reads the KV caches: auto (a Pallas kernel on TPUs and GPUs, the XLA loop on "
                      "CPUs), xla (that loop everywhere), tpu or gpu (that kernel; interpreted on a CPU)")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
  """Compilation and distribution (shared with `python -m jspec.serve`)."""
  g = p.add_argument_group("compilation")
  g.add_argument("--compile-cache", default=default_compile_cache(), metavar="DIR",
                 help="keep compiled programs here, so later runs load them instead of compiling "
                      "(default: $JSPEC_COMPILE_CACHE, else jspec/xla under the user's cache directory)")
  g.add_argument("--no-compile-cache", action="store_true", help="compile every run from scratch")
  add_attention_arg(g)

  g = p.add_argument_group("distributed")
  g.add_argument("--mesh", default=None, metavar="SPEC",
                 help="shard over a device mesh, e.g. data=2,model=4 (default: one device)")
  g.add_argument("--replicate-draft", action="store_true", help="with --mesh: keep the drafter unsharded")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="multi-process: the address of process 0 (jax.distributed)")
  g.add_argument("--num-processes", type=int, default=None, metavar="N", help="multi-process: how many")
  g.add_argument("--process-id", type=int, default=None, metavar="I", help="multi-process: this one's index")


def _draft_lens(text: str | None) -> tuple[int, ...]:
  try:
    return () if text is None else tuple(int(k) for k in text.split(","))
  except ValueError:
    raise ValueError(f"--adaptive-draft-lens takes integers separated by commas, got {text!r}") from None


def speculation(args: argparse.Namespace) -> SpecConfig:
  """The speculation settings the flags ask for (validated: a bad value is a ValueError)."""
  adaptive = None
  if args.adaptive:
    adaptive = AdaptiveConfig(cost_ratio=args.cost_ratio, verify_cost=args.verify_cost,
                              round_overhead=args.round_overhead, fallback_threshold=args.fallback_threshold,
                              probe_interval=args.probe_interval, draft_lens=_draft_lens(args.adaptive_draft_lens))
  tree = None
  if args.tree:
    choices = None
    if args.tree_choices is not None:
      try:
        choices = tuple(tuple(path) for path in json.loads(args.tree_choices))
      except (ValueError, TypeError):
        raise ValueError("--tree-choices must be a JSON list of lists of ranks, e.g. [[0], [1], [0, 0]]") from None
    tree = TreeConfig(top_k=args.tree_top_k, nodes=args.tree_nodes, choices=choices, sampled=args.tree_sampled)
  elif args.tree_choices is not None or args.tree_sampled:
    raise ValueError("--tree-choices and --tree-sampled need --tree")
  return SpecConfig(draft_len=args.draft_len, drafter=args.drafter, max_ngram=args.max_ngram,
                    suffix_cache_tokens=args.suffix_cache_tokens,
                    typical_acceptance=args.typical_acceptance, adaptive=adaptive,
                    disable_at_batch_size=args.disable_at_batch_size, tree=tree)


def default_compile_cache() -> str:
  """$JSPEC_COMPILE_CACHE, else jspec/xla under $XDG_CACHE_HOME (~/.cache)."""
  return os.environ.get("JSPEC_COMPILE_CACHE") or user_cache_dir("xla")


def load_draft(args: argparse.Namespace, load: Callable[..., object]) -> tuple:
  """(draft weights or None, the drafter kind or None for plain decoding), read by `load` (`jspec.load`
  with the dtype and mesh asked for, or `jspec.formats.loading.load_shapes` for a memory plan)."""
  if args.no_draft:
    return None, None
  if args.draft is not None:
    log.info("loading the draft %s", args.draft)
    draft = load(args.draft)
    if getattr(draft, "source", ""):
      log.info("%s: %s", args.draft, draft.source)
    return draft, args.drafter
  drafter = args.drafter or shipped.DEFAULT_DRAFTER
  if drafter == "mtp":  # the target checkpoint's own MTP layer
    log.info("loading the MTP layer of %s", args.target)
    return load(shipped.resolve(args.target), mtp=True), drafter
  if drafter not in shipped.DRAFTS:
    return None, drafter
  pair = shipped.pair_of(args.target)
  if pair is None:
    raise ValueError(f"the {drafter} drafter needs --draft DIR for a target other than the shipped ones")
  log.info("loading the %s drafter %s", drafter, pair.drafts[drafter])
  return load(pair.drafts[drafter]), drafter


def load_models(args: argparse.Namespace, spec: SpecConfig) -> tuple[jspec.Model, dict]:
  """The target, and the model keywords of `jspec.generate` (draft, spec, mesh, shard_draft, attention) the flags
  ask for; `spec` is `speculation(args)`."""
  mesh = jspec.make_mesh(args.mesh) if args.mesh else None
  log.info("loading the target %s", args.target)
  target = jspec.load(shipped.resolve(args.target), dtype=args.dtype, mesh=mesh, quantize=args.quantize)
  draft_mesh = None if args.replicate_draft else mesh
  draft, drafter = load_draft(args, lambda path, **kw: jspec.load(path, dtype=args.dtype, mesh=draft_mesh,
                                                                  quantize=args.draft_quantize, **kw))
  spec = None if drafter is None and draft is None else dataclasses.replace(spec, drafter=drafter)
  return target, dict(draft=draft, spec=spec, mesh=mesh, shard_draft=not args.replicate_draft,
                      attention=args.attention)


def init_distributed(args: argparse.Namespace) -> bool:
  """Joins a multi-process run (flags, or JAX's standard environment variables); True on process 0."""
  import os

  import jax  # here, not at the top: parsing and --help never import JAX
  if args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  return jax.process_index() == 0


class StatusHandler(logging.StreamHandler):
  """Writes each status line through tqdm, so that it lands on its own line above a progress bar that is
  running, not at the end of the bar's."""

  def emit(self, record: logging.LogRecord) -> None:
    from tqdm import tqdm

    try:
      tqdm.write(self.format(record), file=self.stream)
    except Exception:  # noqa: BLE001 - logging's rule: a handler never raises
      self.handleError(record)


def show_status(enabled: bool) -> None:
  """Status lines ("loading ...", "compiling ...") on stderr."""
  if enabled and not log.handlers:
    handler = StatusHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.propagate = False
  log.setLevel(logging.INFO if enabled else logging.WARNING)
