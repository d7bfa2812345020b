"""`jspec.generate` and `jspec.stream`: validate, tokenize, pad, run the jitted loop, and report tokens and
statistics."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jspec.core import machine
from jspec.core.settings import SamplingConfig, SpecConfig
from jspec.decoding import programs
from jspec.decoding.batches import check_prompts, make_batch, seed_array
from jspec.decoding.decoder import Decoder, make_decoder
from jspec.drafters import Heads
from jspec.engine.engine import Engine
from jspec.engine.segments import SEGMENT_ROUNDS, STREAM_ROUNDS
from jspec.engine.stream import Stream
from jspec.model import sharding
from jspec.model.model import Model
from jspec.planning import memory
from jspec.speculation.logprobs import MAX_TOP, TokenLogprob
from jspec.speculation.logprobs import read as read_logprobs
from jspec.speculation.stats import RequestStats, Stats
from jspec.text import constraints
from jspec.text.constraints import Constraint
from jspec.text.tokenizer import detokenize, encode


@dataclasses.dataclass
class Result:
  texts: list[str]
  token_ids: list[list[int]]
  stats: Stats  # the totals
  request_stats: list[RequestStats]  # one per prompt
  logprobs: list[list[TokenLogprob]] | None = None  # one per new token of each prompt, with `logprobs=`


def _sampling(options: Options) -> SamplingConfig | list[SamplingConfig]:
  """The sampling settings from either the `sampling=` object(s) or the simple keywords (not both)."""
  sampling, temperature, top_k, top_p = options.sampling, options.temperature, options.top_k, options.top_p
  if sampling is None:
    return SamplingConfig(0.0 if temperature is None else temperature, top_k or 0, 1.0 if top_p is None else top_p)
  if any(x is not None for x in (temperature, top_k, top_p)):
    raise ValueError("give sampling=SamplingConfig(...) or temperature/top_k/top_p, not both")
  if isinstance(sampling, SamplingConfig):
    return sampling
  if not all(isinstance(s, SamplingConfig) for s in sampling):
    raise ValueError("sampling must be a SamplingConfig or a list of them, one per prompt")
  return list(sampling)


Constraints = Constraint | Sequence[Constraint | None] | None


def _constraint_tables(target: Model, constraint: Constraints, rows: int,
                       ignore_eos: bool) -> list[constraints.Tables | None] | None:
  """Each prompt's compiled constraint (None: no prompt is constrained)."""
  vocabulary = None if constraint is None else constraints.Vocabulary.of(
      target.tokenizer, target.config.stop_ids, target.config.vocab_size)
  return constraints.compile_rows(constraint, vocabulary, rows, ignore_eos)


def _mesh_shape(mesh: Mesh | None) -> tuple[int, ...]:
  return (1, 1) if mesh is None else tuple(mesh.shape.values())


def _prepare(target: Model, prompts, options: Options, batch_size: int | None,
             sampling: SamplingConfig | list[SamplingConfig]) -> tuple[list[list[int]], Decoder]:
  """Validated token ids and the decoder for the rows that run: every prompt, or at most `batch_size`."""
  if isinstance(prompts, (str, bytes)):
    prompts = [prompts]
  spec, chat = options.spec, options.chat
  if options.draft_len is not None:
    spec = dataclasses.replace(spec or SpecConfig(), draft_len=options.draft_len)
  if batch_size is not None and not (isinstance(batch_size, numbers.Integral) and batch_size >= 1):
    raise ValueError(f"batch_size must be an integer >= 1, got {batch_size}")
  if chat:
    if target.chat_template is None:
      raise ValueError("chat: the target has no chat template")
    if not all(isinstance(p, str) for p in prompts):
      raise ValueError("chat: prompts must be texts, not token ids")
    prompts = [target.chat_template.render(p) for p in prompts]
  prompt_ids = [encode(target.tokenizer, p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
  if isinstance(sampling, list) and len(sampling) != len(prompt_ids):
    raise ValueError(f"got sampling settings for {len(sampling)} rows, not {len(prompt_ids)}")
  rows = min(batch_size or len(prompt_ids), len(prompt_ids)) or 1
  decoder = make_decoder(target, options.draft, spec, rows, _mesh_shape(options.mesh), options.attention)
  check_prompts(decoder, prompt_ids, options.max_new_tokens)
  return prompt_ids, decoder


DEFAULT_SLOTS = 8  # an engine's rows when not given: each width up to it is a program to compile

Samplings = SamplingConfig | Sequence[SamplingConfig] | None


@dataclasses.dataclass(frozen=True)
class Options:
  """The keywords `generate` and `stream` share (each is documented at `generate`); both take them as
  keywords, and their signatures list them."""
  draft: Model | Heads | None = None
  max_new_tokens: int = 64
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  sampling: Samplings = None
  draft_len: int | None = None
  seed: int | Sequence[int] = 0
  spec: SpecConfig | None = None
  chat: bool = False
  ignore_eos: bool = False
  mesh: Mesh | None = None
  shard_draft: bool = True
  constraint: Constraints = None
  attention: str = "auto"


def _with_options(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn(target, prompts, *, its own keywords, options: Options)` called as `fn(target, prompts, **keywords)`:
  the `Options` keywords gathered into `options`, an unknown keyword refused as Python refuses one, and
  every keyword in the signature `help()` and editors show."""
  own = [p for p in inspect.signature(fn).parameters.values() if p.name != "options"]
  fields = [f.name for f in dataclasses.fields(Options)]

  @functools.wraps(fn)
  def call(target, prompts, **keywords):
    unknown = sorted(set(keywords) - set(fields) - {p.name for p in own})
    if unknown:
      raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {unknown[0]!r}")
    options = Options(**{k: v for k, v in keywords.items() if k in fields})
    return fn(target, prompts, options=options, **{k: v for k, v in keywords.items() if k not in fields})

  shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(Options)]
  call.__signature__ = inspect.signature(fn).replace(parameters=own[:2] + shared + own[2:])
  return call


@_with_options
def generate(target: Model, prompts: str | Sequence[str | Sequence[int]], *, logprobs: int | None = None,
             options: Options) -> Result:
  """Decodes a batch of prompts (texts or token-id lists), speculatively when a drafter is given.

  `draft` is a draft `Model` or trained Medusa/EAGLE `Heads` (`jspec.load` returns either); with
  `spec=SpecConfig(drafter="ngram")` n-gram lookup needs none. With neither, decoding is plain
  autoregression. Sampling is greedy unless `temperature` (with `top_k`, `top_p`) or `sampling=` (a
  `SamplingConfig`, or one per prompt) says otherwise. `spec` holds the other speculation settings
  (adaptive K, on by default; typical acceptance, ...); `draft_len` (K), when given, replaces its
  `draft_len` (default 4).

  Row b samples with `seed + b` (or `seed[b]` when a list is given), so a row is reproducible alone (with a
  fixed K, `SpecConfig(adaptive=None)`: adaptive K is chosen for the whole batch). A row stops at any of
  the target's EOS tokens; `ignore_eos=True` decodes `max_new_tokens` for every row, past any EOS (as
  vLLM's benchmarks do), without compiling anything new. `constraint` (a `jspec.Regex`, `jspec.JsonSchema`
  or `jspec.Choice`, or one per prompt, None for a free one) restricts what a row outputs: at every step
  the target's distribution is masked to the tokens the constraint allows and renormalised (before top-k
  and top-p), drafts are drawn from the drafter's masked distribution, and the text ends with EOS when the
  constraint is complete; tables of one size bucket share an executable. `chat=True` renders each text
  prompt as one user turn of the target's chat template, with the assistant's turn opened after it.

  With a `mesh` (`jspec.make_mesh("data=D,model=M")`), parameters and caches are sharded by the rules in
  `jspec.model.sharding` (the drafter's too, unless `shard_draft=False` replicates it) and the loop runs as one
  SPMD program on the mesh, across processes when `jax.distributed` is initialized. `attention` picks how
  attention reads the caches: "auto" (the Pallas kernel of a TPU or GPU, the reference loop on a CPU),
  "xla" (that loop everywhere), "tpu" or "gpu" (that kernel; interpreted on a CPU).

  `logprobs=k` (0 to `jspec.speculation.logprobs.MAX_TOP`) fills `Result.logprobs`: each new token's log-probability
  under the target's distribution after the row's sampling (its own distribution at temperature 0), with
  the k most likely tokens at its position, recorded by the forward that scored it.
  """
  o = options
  if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_TOP):
    raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP}], got {logprobs}")
  sampling = _sampling(o)
  prompt_ids, decoder = _prepare(target, prompts, o, None, sampling)
  tables = _constraint_tables(target, o.constraint, len(prompt_ids), o.ignore_eos)
  batch = make_batch(decoder, prompt_ids, o.max_new_tokens, sampling=sampling, seed=o.seed,
                        ignore_eos=o.ignore_eos, constraints=tables,
                        logprobs=None if logprobs is None else [True] * len(prompt_ids),
                        top_logprobs=max(logprobs or 0, 1))
  width = batch.prompts_BxP.shape[1]
  memory.check(decoder, len(prompt_ids), width + o.max_new_tokens, width, o.mesh, o.shard_draft)
  if o.mesh is not None:
    decoder = sharding.place_decoder(o.mesh, decoder, len(prompt_ids), o.shard_draft)
    batch = sharding.place(batch, o.mesh)
  executable, compile_seconds = programs.compiled_run(decoder, batch)
  start = time.perf_counter()
  decoded = jax.block_until_ready(executable(decoder, batch))
  wall = time.perf_counter() - start

  tokens, seq_lens, stats, scored = programs.fetch(decoded)
  token_ids = [tokens[b, len(p):seq_lens[b]].tolist() for b, p in enumerate(prompt_ids)]
  texts = [detokenize(target.tokenizer, ids) for ids in token_ids]
  spec = decoder.spec if decoder.drafter is not None else None
  return Result(texts=texts, token_ids=token_ids, stats=Stats.from_device(stats, wall, compile_seconds, spec),
                request_stats=[RequestStats.of_row(stats, b, len(ids)) for b, ids in enumerate(token_ids)],
                logprobs=None if scored is None else [read_logprobs(scored, b, len(p), ids, logprobs)
                                                      for b, (p, ids) in enumerate(zip(prompt_ids, token_ids))])


@_with_options
def stream(target: Model, prompts: str | Sequence[str | Sequence[int]], *, batch_size: int | None = None,
           segment_rounds: int = SEGMENT_ROUNDS, options: Options) -> Stream:
  """Decodes like `generate`, handing out each prompt's text as it is accepted: iterate over the returned
  `Stream` for `Delta(index, text, token_ids, finished, stats)`s (a prompt's last delta has `finished` and
  its `RequestStats`); `stream.stats` holds the totals afterwards.

  With `batch_size` below the number of prompts, they are decoded by continuous batching: `batch_size` rows
  (slots), and when a prompt finishes the next one is prefilled into its slot. Prompt i samples with
  `seed + i` (or `seed[i]`) whatever its slot, so with a fixed K its tokens are those it gets decoded alone.
  The loop returns to the host every `segment_rounds` rounds, and whenever a prompt finishes while others
  wait. `constraint` is as for `generate`.
  """
  o = options
  sampling = _sampling(o)
  prompt_ids, decoder = _prepare(target, prompts, o, batch_size, sampling)
  slots = min(batch_size or len(prompt_ids), len(prompt_ids))
  _constraint_tables(target, o.constraint, len(prompt_ids), o.ignore_eos)  # refuses a bad one before anything runs
  if o.mesh is not None:
    decoder = sharding.place_decoder(o.mesh, decoder, slots, o.shard_draft)
  return Stream(decoder, target.tokenizer, prompt_ids, slots=slots, max_new_tokens=o.max_new_tokens,
                sampling=sampling, seeds=seed_array(o.seed, len(prompt_ids)).tolist(), ignore_eos=o.ignore_eos,
                segment_rounds=segment_rounds, constraint=o.constraint)


def make_engine(target: Model, *, draft: Model | Heads | None = None, spec: SpecConfig | None = None,
                slots: int | None = DEFAULT_SLOTS, max_len: int | None = None, mesh: Mesh | None = None,
                shard_draft: bool = True, segment_rounds: int = SEGMENT_ROUNDS, stream_rounds: int = STREAM_ROUNDS,
                memory_fraction: float = 1.0, attention: str = "auto", pages: int | None = None,
                prefix_caching: bool = True, max_prefill_tokens: int | None = None, max_logprobs: int = 0) -> Engine:
  """An online `Engine` over `slots` rows of up to `max_len` tokens each (default: the model's context):
  `add` requests (`jspec.Request`) at any time, from any thread, `abort` them, and `step` it for their
  text deltas. The models, `spec` and `attention` are as for `generate`. Segments run at the narrowest batch width
  that holds the busy rows, and the adaptive policy reads the costs of that width, so a full engine
  decodes plainly and a quiet one speculates. A segment runs `segment_rounds` rounds; while a request with
  `stream=True` is young and none waits for a slot, as many as it has run so far (1, 1, 2, 4, ...,
  at least `stream_rounds` after the first).

  The slots must fit `memory_fraction` of the device (`jspec.planning.memory`; a ValueError says what would);
  `slots=None` takes as many as fit, up to `DEFAULT_SLOTS`. The slots share a pool of `pages` KV pages of
  `jspec.model.cache.PAGE_SIZE` tokens (default: as many as fit, at most every slot's whole context; on a mesh,
  each page's kv heads split over "model", and a pool of its own per data shard), and with
  `prefix_caching` a prompt shares the cached pages of its longest prefix an earlier one left;
  `max_prefill_tokens` bounds the prompt tokens prefilled between two segments (None: whole prompts).
  `max_logprobs` > 0 lets requests ask for log-probabilities (`Request.logprobs`), with up to that many of the
  most likely tokens at each position."""
  if slots is None:
    shapes = make_decoder(target, draft, spec, 1, _mesh_shape(mesh))
    context = max_len or shapes.context_len
    fit = memory.make_plan(shapes, 1, context, context - 1, mesh=mesh, shard_draft=shard_draft,
                           memory=machine.budget(mesh, memory_fraction), serving=True).max_batch
    slots = max(min(fit, DEFAULT_SLOTS), 1)  # none fits: the engine says why
  if not (isinstance(slots, numbers.Integral) and slots >= 1):
    raise ValueError(f"slots must be an integer >= 1, got {slots}")
  decoder = make_decoder(target, draft, spec, slots, _mesh_shape(mesh), attention)
  if mesh is not None:
    decoder = sharding.place_decoder(mesh, decoder, slots, shard_draft)
  return Engine(decoder, target.tokenizer, slots=slots, max_len=max_len, segment_rounds=segment_rounds,
                stream_rounds=stream_rounds, memory_fraction=memory_fraction, pages=pages,
                prefix_caching=prefix_caching, max_prefill_tokens=max_prefill_tokens, max_logprobs=max_logprobs)
