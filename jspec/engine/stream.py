"""A list of prompts decoded on an `Engine`, its deltas yielded as rounds are accepted: `jspec.stream` and the
CLI's continuous batching."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from jspec.core.settings import SamplingConfig
from jspec.decoding.decoder import Decoder
from jspec.engine.engine import Engine
from jspec.engine.requests import Delta, Request
from jspec.engine.segments import SEGMENT_ROUNDS
from jspec.speculation.stats import Stats
from jspec.text.constraints import Constraint


class Stream:
  """Decodes a list of prompts on an `Engine`: iterating yields `Delta`s as rounds are accepted (`index`:
  the prompt's position); afterwards `stats` holds the totals."""

  def __init__(self, decoder: Decoder, tokenizer, prompt_ids: Sequence[Sequence[int]], *, slots: int,
               max_new_tokens: int, sampling: SamplingConfig | Sequence[SamplingConfig], seeds: Sequence[int],
               ignore_eos: bool, segment_rounds: int = SEGMENT_ROUNDS,
               constraint: Constraint | Sequence[Constraint | None] | None = None):
    samplings = [sampling] * len(prompt_ids) if isinstance(sampling, SamplingConfig) else list(sampling)
    rows = constraint if isinstance(constraint, list | tuple) else [constraint] * len(prompt_ids)
    self.requests = [Request(list(p), max_new_tokens, s, seed, ignore_eos=ignore_eos, constraint=c)
                     for p, s, seed, c in zip(prompt_ids, samplings, seeds, rows)]
    self.decoder, self.slots = decoder, slots  # rows of the batch (the decoder was made for this many)
    widest = max(len(p) for p in prompt_ids)
    self.engine = Engine(decoder, tokenizer, slots=slots, max_len=min(widest + max_new_tokens, decoder.context_len),
                         segment_rounds=segment_rounds, narrow=False)
    for req in self.requests:
      self.engine.check(req)
    self.stats: Stats | None = None

  @property
  def compile_seconds(self) -> float:
    return self.engine.compile_seconds

  def __iter__(self) -> Iterator[Delta]:
    for i, req in enumerate(self.requests):
      self.engine.add(req, i)
    while self.engine.has_work:
      yield from self.engine.step()
    self.stats = self.engine.stats
