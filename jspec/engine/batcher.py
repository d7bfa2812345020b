"""Requests as rows of the loop's batch: checked against what the engine can hold (`check`), their constraints
compiled (`tables`) into automata of one bucket for the running batch (`constraint_shape`), and made the
`Batch` of the rows they take (`batch`), page tables included."""
from __future__ import annotations

import numpy as np

from jspec.core.settings import SamplingConfig
from jspec.decoding import batches
from jspec.decoding.decoder import Decoder
from jspec.engine.pages import KVPages
from jspec.engine.requests import Request
from jspec.model import sharding
from jspec.speculation import logprobs
from jspec.text import automaton, constraints

MAX_STOP_IDS = 8  # stop token ids a request may add to the target's EOS tokens (a compiled width)


class Batcher:
  """The rows of an engine's batch: `capacity` slots each, prompts read at `prompt_width` (a paged prefill's),
  up to `max_logprobs` top log-probabilities a request may ask for, pages from `kv_pages` (None: contiguous
  rows)."""

  def __init__(self, decoder: Decoder, tokenizer, max_len: int, prompt_width: int, capacity: int,
               max_logprobs: int, kv_pages: KVPages | None):
    if not (isinstance(max_logprobs, int) and 0 <= max_logprobs <= logprobs.MAX_TOP):
      raise ValueError(f"max_logprobs must be an integer in [0, {logprobs.MAX_TOP}], got {max_logprobs}")
    self.decoder, self.tokenizer, self.max_len = decoder, tokenizer, max_len
    self.prompt_width, self.capacity, self.max_logprobs, self.kv_pages = prompt_width, capacity, max_logprobs, kv_pages
    self.eos = tuple(decoder.target_config.stop_ids)
    self.stop_width = len(self.eos) + MAX_STOP_IDS
    # The running batch's constraint automata are (states, classes) tables of this bucket, or absent while
    # no row is constrained; a constrained request that needs a bigger bucket grows it (a new program).
    self.constraint_shape: tuple[int, int] | None = None

  def check(self, req: Request) -> None:
    """Raises a one-line ValueError for a request these rows cannot hold (the pool's pages aside)."""
    batches.check_prompts(self.decoder, [req.prompt_ids], req.max_new_tokens, self.max_len)
    if not isinstance(req.sampling, SamplingConfig):
      raise ValueError("sampling must be a SamplingConfig")
    batches.seed_array([req.seed], 1)
    if len(req.stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(req.stop_ids)}")
    vocab = self.decoder.target_config.vocab_size
    if any(not 0 <= int(t) < vocab for t in req.stop_ids):
      raise ValueError(f"stop token ids must be in [0, {vocab})")
    if not all(isinstance(s, str) for s in req.stop):
      raise ValueError("stop strings must be strings")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(req, name)
      if value is not None and not self.max_logprobs:
        raise ValueError(f"{name}: this engine records no log-probabilities (max_logprobs=0)")
      if value is not None and not (isinstance(value, int) and 0 <= value <= self.max_logprobs):
        raise ValueError(f"{name} must be an integer in [0, {self.max_logprobs}] (the engine's max_logprobs), "
                         f"got {value}")
    self.tables(req)

  def tables(self, req: Request) -> constraints.Tables | None:
    """The request's compiled constraint (cached), or None."""
    if req.constraint is None:
      return None
    config = self.decoder.target_config
    vocabulary = constraints.Vocabulary.of(self.tokenizer, config.stop_ids, config.vocab_size)
    return constraints.compile_rows([req.constraint], vocabulary, 1, req.ignore_eos)[0]

  def stop_ids(self, req: Request) -> list[int]:
    """The tokens that end `req`: the target's EOS tokens (unless it ignores them) and its own."""
    return list(() if req.ignore_eos else self.eos) + [int(t) for t in req.stop_ids]

  def fit_constraints(self, state, tables: constraints.Tables | None, constrained: bool):
    """`state` with its automata sized for a request about to start with `tables`: grown to a bucket that holds
    them, or, with none and no constrained row running (`constrained`), dropped (the unconstrained program)."""
    shape = self.constraint_shape
    if tables is None and not constrained:
      shape = None
    elif tables is not None:
      shape = tuple(max(a, b) for a, b in zip(shape or (0, 0), automaton.bucket([tables])))
    if shape != self.constraint_shape and state is not None:
      state = state.replace(constraint=None if shape is None else automaton.pad(
          state.constraint, shape, len(state.seq_lens_B), self.decoder.target_config.vocab_size))
    self.constraint_shape = shape
    return state

  def batch(self, reqs: list[Request], tables: list[constraints.Tables | None] | None = None,
            slot: int | None = None, cached: int = 0, width: int | None = None) -> batches.Batch:
    """The batch of `reqs` (with `tables`, default none) for the rows from `slot` (default: idle rows); with
    `width`, one request's prefill runs `width` tokens from `cached` (those before are in its pages)."""
    stop_ids = [self.stop_ids(r) for r in reqs]
    tables = tables or [None] * len(reqs)
    batch = batches.make_batch(
        self.decoder, [r.prompt_ids for r in reqs], max(r.max_new_tokens for r in reqs),
        sampling=[r.sampling for r in reqs], seed=[r.seed for r in reqs], stop_ids=stop_ids,
        capacity_slots=self.capacity, stop_width=self.stop_width, speculate=[r.speculate for r in reqs],
        share=[r.suffix_cache for r in reqs], constraints=tables if any(t is not None for t in tables) else None,
        constraint_shape=self.constraint_shape, width=self.prompt_width if width is not None else None,
        logprobs=[r.logprobs is not None for r in reqs] if self.max_logprobs else None,
        top_logprobs=self.max_logprobs)
    batch = batch.replace(max_new_tokens_B=np.asarray([r.max_new_tokens for r in reqs], np.int32))
    if self.kv_pages is not None:
      batch = batch.replace(page_table_BxR=self.kv_pages.rows(slot, len(reqs)), pages=self.kv_pages.pool_size)
    if width is not None:
      batch = batch.replace(cached_B=np.full((1,), cached, np.int32), prefill_width=width)
    layout = self.decoder.layout
    return batch if layout is None else sharding.place(batch, layout.mesh)
