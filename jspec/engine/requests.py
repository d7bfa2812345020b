"""What crosses the engine's boundary, and what it keeps of each request: a `Request` in, `Delta`s out, and a
request's host-side state while it runs (`Running`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from jspec.core.settings import SamplingConfig
from jspec.decoding.batches import GREEDY
from jspec.engine.text import TextOutput
from jspec.speculation import logprobs
from jspec.speculation.logprobs import Logprobs, TokenLogprob
from jspec.speculation.stats import DecodeStats, RequestStats
from jspec.text import automaton, constraints
from jspec.text.constraints import Constraint


@dataclasses.dataclass(frozen=True)
class Request:
  """One request as the engine takes it. `stop`: strings that end the text (checked on the text; the
  stop string is not returned); `stop_ids`: tokens that end it besides the target's EOS tokens (which
  `ignore_eos` drops); `speculate` False decodes this request plainly; `constraint` restricts its output
  (`jspec.generate` says how); `stream`: someone watches its text arrive (short segments while it runs).
  `logprobs`: each emitted token's log-probability with that many of the most likely tokens at its position
  (`jspec.speculation.logprobs`; at most the engine's `max_logprobs`); `prompt_logprobs`: the prompt's, likewise.
  `suffix_cache` False keeps the request's text to itself: it does not join the index of texts that the
  `suffix` drafter keeps across requests, and its drafts come from its own text only."""
  prompt_ids: Sequence[int]
  max_new_tokens: int
  sampling: SamplingConfig = GREEDY
  seed: int = 0
  stop: Sequence[str] = ()
  stop_ids: Sequence[int] = ()
  ignore_eos: bool = False
  speculate: bool = True
  constraint: Constraint | None = None
  stream: bool = False
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  suffix_cache: bool = True


@dataclasses.dataclass(frozen=True)
class Delta:
  """New output of one request since its last delta. The last delta of a request has `finished` set, its
  `finish_reason` ("stop": an EOS, a stop token or a stop string; "length": max_new_tokens; "abort") and
  its statistics."""
  index: Hashable  # the request's id
  text: str
  token_ids: list[int]
  finished: bool = False
  stats: RequestStats | None = None
  finish_reason: str | None = None
  logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asks
  prompt_logprobs: list[TokenLogprob] | None = None  # in the request's first delta, when it asks


@dataclasses.dataclass
class Running:
  """The host's side of a request that has started (in a slot, or waiting again after a preemption)."""
  id: Hashable
  request: Request  # after a preemption: the prompt with the tokens emitted before it, and fewer new tokens
  text: TextOutput
  stop_ids: frozenset[int]
  admitted: int = 0  # admission order: the youngest is preempted first
  tables: constraints.Tables | None = None  # the constraint, started after the tokens emitted so far
  emitted: list[int] = dataclasses.field(default_factory=list)  # tokens of `request`'s output handed out
  rounds: int = 0  # rounds of the segments set going for it
  unread_rounds: int = 0  # of those, the rounds whose tokens the host has not read
  cached: int = 0  # prompt tokens its prefill found in the prefix cache
  prompt_logprobs: list[TokenLogprob] | None = None  # scored at its start, until its first delta

  @property
  def sent(self) -> int:
    return len(self.emitted)

  def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
    """The prompt's log-probabilities, once: for the request's first delta."""
    scored, self.prompt_logprobs = self.prompt_logprobs, None
    return scored

  def resumed(self) -> Running:
    """The request to restart after a preemption: its prompt and output so far, recomputed."""
    req = self.request
    tables = self.tables if self.tables is None else automaton.advanced(self.tables, self.emitted)
    request = dataclasses.replace(req, prompt_ids=[*req.prompt_ids, *self.emitted],
                                  max_new_tokens=req.max_new_tokens - len(self.emitted), prompt_logprobs=None)
    return dataclasses.replace(self, request=request, tables=tables, emitted=[], rounds=0, unread_rounds=0)

  def advance(self, row: int, new_ids: list[int], done: bool, scores: Logprobs | None,
              stats: DecodeStats | None) -> Delta | None:
    """Its delta for the tokens a segment committed in its row (`scores`: the segment's log-probabilities
    from where its tokens began), or None when it has none and goes on; a finished one (a stop string, a stop
    token, or its length) is its last."""
    self.emitted.extend(new_ids)
    text, stopped = self.text.push(new_ids, final=done)
    top = self.request.logprobs
    scored = None if top is None else logprobs.read(scores, row, 0, new_ids, top)
    if stopped or done:
      reason = "stop" if stopped or (new_ids and new_ids[-1] in self.stop_ids) else "length"
      return self.finish(row, text, new_ids, reason, scored, stats)
    if new_ids:
      return Delta(self.id, text, new_ids, logprobs=scored, prompt_logprobs=self.take_prompt_logprobs())
    return None

  def finish(self, row: int, text: str, new_ids: list[int], reason: str, scored: list[TokenLogprob] | None,
             stats: DecodeStats | None) -> Delta:
    """Its last delta, with its statistics (from the loop's, `stats`, for its row)."""
    request_stats = None if stats is None else RequestStats.of_row(stats, row, self.sent)
    return Delta(self.id, text, new_ids, True, request_stats, reason, scored, self.take_prompt_logprobs())
