"""Segmented decoding driven from the host: streaming, and continuous batching of many prompts over slots.

The batch has a fixed number of rows (slots). The decode loop runs in segments (`jspec.decode.run` with
`max_rounds`), each one executable call that keeps the whole loop on the device; between segments the host
reads the new tokens of every row and hands them out as text deltas. A finished row ends its segment early
while prompts are waiting, and the next prompt is prefilled into its slot (`jspec.decode.insert`): its
cache rows, drafter state, sampling values and seed. A prompt's tokens depend only on its own row, so they
are those it would get decoded alone (with a fixed K; adaptive K is chosen for the whole batch, which
changes which tokens a sampled row draws, never their distribution).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

from jspec import engine, request, sharding
from jspec.decode import Decoder
from jspec.settings import SamplingConfig
from jspec.stats import RequestStats, Stats
from jspec.tokenizer import IncrementalDetokenizer

# Rounds per segment (one host visit) when streaming: few enough host visits that they cost little
# throughput (docs/streaming.md), often enough that text appears every few tens of milliseconds. A segment
# also ends when a row finishes, so continuous batching does not wait for it.
SEGMENT_ROUNDS = 16


@dataclasses.dataclass(frozen=True)
class Delta:
  """New output of one prompt since its last delta. The last delta of a prompt has `finished` set and the
  prompt's statistics."""
  index: int  # the prompt's position in the request
  text: str
  token_ids: list[int]
  finished: bool = False
  stats: RequestStats | None = None


class Stream:
  """Iterating yields `Delta`s as rounds are accepted; afterwards `stats` holds the totals."""

  def __init__(self, decoder: Decoder, tokenizer, prompt_ids: Sequence[Sequence[int]], *, slots: int,
               max_new_tokens: int, sampling: SamplingConfig | Sequence[SamplingConfig], seeds: Sequence[int],
               ignore_eos: bool, segment_rounds: int = SEGMENT_ROUNDS):
    if not (isinstance(segment_rounds, int) and segment_rounds >= 1):
      raise ValueError(f"segment_rounds must be an integer >= 1, got {segment_rounds}")
    self.decoder, self.tokenizer = decoder, tokenizer
    self.prompt_ids, self.seeds = [list(p) for p in prompt_ids], list(seeds)
    self.sampling = [sampling] * len(self.prompt_ids) if isinstance(sampling, SamplingConfig) else list(sampling)
    self.slots = slots  # rows of the batch (the decoder was made for this many), at most one per prompt
    self.max_new_tokens, self.ignore_eos = max_new_tokens, ignore_eos
    self.segment_rounds = segment_rounds
    widest = request.prompt_bucket(max(len(p) for p in self.prompt_ids))
    self.capacity = request.capacity(widest, max_new_tokens, decoder.headroom)
    self.stats: Stats | None = None
    self.compile_seconds = 0.0
    self._executables: dict = {}

  def _requests(self, indices: Sequence[int]) -> request.Requests:
    requests = request.make_requests(self.decoder, [self.prompt_ids[i] for i in indices], self.max_new_tokens,
                                     sampling=[self.sampling[i] for i in indices],
                                     seed=[self.seeds[i] for i in indices], ignore_eos=self.ignore_eos,
                                     capacity_slots=self.capacity)
    layout = self.decoder.layout
    return requests if layout is None else sharding.place(requests, layout.mesh)

  def _call(self, name: str, jitted, *args, **static):
    """Runs `jitted` through its executable for these shapes. The stream keeps the executables it used:
    finding one in the engine's cache hashes every argument's shape and static field, which costs more
    than a segment's call."""
    key = (name, args[-2].prompts_BxP.shape if name == "insert" else None)
    if key not in self._executables:
      executable, seconds = engine.compiled(name, lambda: jitted.lower(*args, **static), args, **static)
      self._executables[key] = executable
      self.compile_seconds += seconds
    return self._executables[key](*args)

  def __iter__(self) -> Iterator[Delta]:
    decoder = self.decoder
    begin = time.perf_counter()
    pending = collections.deque(range(self.slots, len(self.prompt_ids)))
    slot_prompt: list[int | None] = list(range(self.slots))
    text = [IncrementalDetokenizer(self.tokenizer) for _ in range(self.slots)]
    sent = [0] * self.slots  # tokens of the slot's prompt already handed out
    state = self._call("prefill", engine.start, decoder, self._requests(slot_prompt))
    segment = jnp.int32(self.segment_rounds)
    while True:
      state = self._call("segment", engine.resume, decoder, state, segment, jnp.asarray(bool(pending)))
      tokens, seq_lens, done, row_stats = jax.device_get((state.tokens_BxT, state.seq_lens_B, state.done_B, (
          state.stats.row_rounds_B, state.stats.row_drafted_B, state.stats.row_accepted_B)))
      for b, index in enumerate(slot_prompt):
        if index is None:
          continue
        start = len(self.prompt_ids[index]) + sent[b]
        new_ids = tokens[b, start:seq_lens[b]].tolist()
        sent[b] += len(new_ids)
        delta = text[b].push(new_ids)
        if not done[b]:
          if new_ids:
            yield Delta(index, delta, new_ids)
          continue
        yield Delta(index, delta + text[b].flush(), new_ids, finished=True,
                    stats=RequestStats.of_row(*row_stats, row=b, emitted_tokens=sent[b]))
        slot_prompt[b] = None
        if pending:  # the next prompt takes the free slot
          slot_prompt[b] = pending.popleft()
          text[b], sent[b] = IncrementalDetokenizer(self.tokenizer), 0
          state = self._call("insert", engine.insert, decoder, state, self._requests([slot_prompt[b]]),
                             jnp.int32(b))
      if all(i is None for i in slot_prompt):
        break
    wall = time.perf_counter() - begin - self.compile_seconds
    spec = decoder.spec if decoder.drafter is not None else None
    self.stats = Stats.from_device(jax.device_get(state.stats), wall, self.compile_seconds, spec)
