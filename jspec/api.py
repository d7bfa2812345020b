"""`jspec.generate` and `jspec.stream`: validate, tokenize, pad, run the jitted loop, and report tokens and
statistics."""
from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jspec import cache as kvcache
from jspec import decode, engine
from jspec.drafters import Heads
from jspec.model import Model
from jspec.pairing import make_decoder
from jspec.scheduler import SEGMENT_ROUNDS, Stream
from jspec.settings import SamplingConfig, SpecConfig
from jspec.stats import RequestStats, Stats
from jspec.tokenizer import decode as detokenize
from jspec.tokenizer import encode


@dataclasses.dataclass
class Result:
  texts: list[str]
  token_ids: list[list[int]]
  stats: Stats  # the totals
  request_stats: list[RequestStats]  # one per prompt


def check_request(target: Model, decoder: decode.Decoder, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
  """Raises ValueError with one clear line for anything the loop cannot serve."""
  if not prompt_ids:
    raise ValueError("no prompts given")
  if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
  context = target.config.max_seq_len
  if decoder.drafter is not None and decoder.drafter.kind == "model":
    context = min(context, decoder.drafter.config.max_seq_len)
  for i, ids in enumerate(prompt_ids):
    if not ids:
      raise ValueError(f"prompt {i} is empty")
    if min(ids) < 0 or max(ids) >= target.config.vocab_size:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {target.config.vocab_size})")
    if len(ids) + max_new_tokens > context:
      raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                       f"the model's context of {context} tokens")


def _seeds(seed: int | Sequence[int], batch: int) -> np.ndarray:
  seeds = [seed + b for b in range(batch)] if isinstance(seed, int) else [int(s) for s in seed]
  if len(seeds) != batch:
    raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
  if not all(0 <= s < 2 ** 32 for s in seeds):
    raise ValueError("seeds must be in [0, 2**32)")
  return np.asarray(seeds, np.uint32)


def _prepare(target: Model, prompts, draft, temperature, top_k, top_p, draft_len, spec, chat, max_new_tokens,
             batch: int | None) -> tuple[list[list[int]], decode.Decoder, SamplingConfig]:
  """Validated token ids, the decoder for batches of `batch` rows (None: all prompts), and the sampling."""
  if isinstance(prompts, (str, bytes)):
    prompts = [prompts]
  sampling = SamplingConfig(temperature, top_k, top_p)
  if draft_len is not None:
    spec = dataclasses.replace(spec or SpecConfig(), draft_len=draft_len)
  if chat:
    if target.chat_template is None:
      raise ValueError("chat: the target has no chat template")
    if not all(isinstance(p, str) for p in prompts):
      raise ValueError("chat: prompts must be texts, not token ids")
    prompts = [target.chat_template.render(p) for p in prompts]
  prompt_ids = [encode(target.tokenizer, p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
  decoder = make_decoder(target, draft, spec, batch or len(prompt_ids))
  check_request(target, decoder, prompt_ids, max_new_tokens)
  return prompt_ids, decoder, sampling


def generate(target: Model, prompts: str | Sequence[str | Sequence[int]], *, draft: Model | Heads | None = None,
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             draft_len: int | None = None, seed: int | Sequence[int] = 0, spec: SpecConfig | None = None,
             chat: bool = False, ignore_eos: bool = False, mesh: Mesh | None = None,
             shard_draft: bool = True) -> Result:
  """Decodes a batch of prompts (texts or token-id lists), speculatively when a drafter is given.

  `draft` is a draft `Model` or trained Medusa/EAGLE `Heads` (`jspec.load` returns either); with
  `spec=SpecConfig(drafter="ngram")` n-gram lookup needs none. With neither, decoding is plain
  autoregression. `spec` holds the other speculation settings (adaptive K, on by default; typical
  acceptance, ...); `draft_len` (K), when given, replaces its `draft_len` (default 4).

  Row b samples with `seed + b` (or `seed[b]` when a list is given), so a row is reproducible alone (with a
  fixed K, `SpecConfig(adaptive=None)`: adaptive K is chosen for the whole batch). A row stops at any of
  the target's EOS tokens; `ignore_eos=True` decodes `max_new_tokens` for every row, past any EOS (as
  vLLM's benchmarks do), without compiling anything new. `chat=True` renders each text prompt as one user
  turn of the target's chat template, with the assistant's turn opened after it.

  With a `mesh` (`jspec.make_mesh("data=D,model=M")`), parameters and caches are sharded by the rules in
  `jspec.sharding` (the drafter's too, unless `shard_draft=False` replicates it) and the loop runs as one
  SPMD program on the mesh, across processes when `jax.distributed` is initialized.
  """
  prompt_ids, decoder, sampling = _prepare(target, prompts, draft, temperature, top_k, top_p, draft_len, spec,
                                           chat, max_new_tokens, None)
  batch = len(prompt_ids)
  width = engine.prompt_bucket(max(len(p) for p in prompt_ids))
  capacity = kvcache.round_capacity(decode.required_capacity(width, max_new_tokens, decoder.headroom))

  prompts_BxP = np.zeros((batch, width), np.int32)
  for b, ids in enumerate(prompt_ids):
    prompts_BxP[b, :len(ids)] = ids
  requests = decode.Requests(
      prompts_BxP=prompts_BxP, prompt_lens_B=np.asarray([len(p) for p in prompt_ids], np.int32),
      max_new_tokens_B=np.full((batch,), max_new_tokens, np.int32),
      sampling=engine.as_sampling(sampling.temperature, sampling.top_k, sampling.top_p, batch),
      seeds_B=_seeds(seed, batch), stop_BxE=decode.stop_ids(target.config, batch, ignore_eos))
  layout = None
  if mesh is not None:
    decoder, requests, layout = engine.place_on_mesh(mesh, decoder, requests, shard_draft)
  executable, compile_seconds = engine.compiled_run(decoder, requests, capacity, layout)
  start = time.perf_counter()
  tokens, seq_lens, stats = jax.block_until_ready(executable(decoder, requests))
  wall = time.perf_counter() - start

  tokens, seq_lens, stats = jax.device_get((tokens, seq_lens, stats))
  token_ids = [tokens[b, len(p):seq_lens[b]].tolist() for b, p in enumerate(prompt_ids)]
  texts = [detokenize(target.tokenizer, ids) for ids in token_ids]
  spec = decoder.spec if decoder.drafter is not None else None
  return Result(texts=texts, token_ids=token_ids, stats=Stats.from_device(stats, wall, compile_seconds, spec),
                request_stats=[RequestStats.of_row(stats.row_rounds_B, stats.row_drafted_B, stats.row_accepted_B, b,
                                                   len(ids)) for b, ids in enumerate(token_ids)])


def stream(target: Model, prompts: str | Sequence[str | Sequence[int]], *, draft: Model | Heads | None = None,
           max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           draft_len: int | None = None, seed: int | Sequence[int] = 0, spec: SpecConfig | None = None,
           chat: bool = False, ignore_eos: bool = False, mesh: Mesh | None = None, shard_draft: bool = True,
           batch_size: int | None = None, segment_rounds: int = SEGMENT_ROUNDS) -> Stream:
  """Decodes like `generate`, handing out each prompt's text as it is accepted: iterate over the returned
  `Stream` for `Delta(index, text, token_ids, finished, stats)`s (a prompt's last delta has `finished` and
  its `RequestStats`); `stream.stats` holds the totals afterwards.

  With `batch_size` below the number of prompts, they are decoded by continuous batching: `batch_size` rows
  (slots), and when a prompt finishes the next one is prefilled into its slot. Prompt i samples with
  `seed + i` (or `seed[i]`) whatever its slot, so with a fixed K its tokens are those it gets decoded alone.
  The loop returns to the host every `segment_rounds` rounds, and whenever a prompt finishes while others
  wait. On a mesh, continuous batching needs a cache laid out by batch row (no kv-head split).
  """
  prompt_ids, decoder, sampling = _prepare(target, prompts, draft, temperature, top_k, top_p, draft_len, spec,
                                           chat, max_new_tokens, batch_size)
  seeds = _seeds(seed, len(prompt_ids)).tolist()
  if batch_size is not None and not (isinstance(batch_size, numbers.Integral) and batch_size >= 1):
    raise ValueError(f"batch_size must be an integer >= 1, got {batch_size}")
  slots = min(batch_size or len(prompt_ids), len(prompt_ids))
  layout = None
  if mesh is not None:
    decoder, layout = engine.place_decoder(mesh, decoder, slots, shard_draft)
  return Stream(decoder, target.tokenizer, prompt_ids, seeds, slots=slots, max_new_tokens=max_new_tokens,
                sampling=sampling, ignore_eos=ignore_eos, segment_rounds=segment_rounds, layout=layout)
