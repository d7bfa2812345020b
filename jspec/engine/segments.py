"""The shape of the engine's segments (one executable call, one host visit each): the batch widths they run
at, the rounds each runs, and a segment set going on the device, not yet read."""
from __future__ import annotations

import dataclasses

from jspec.decoding import programs
from jspec.engine.requests import Running

# Rounds per segment (one host visit): few enough host visits that they cost little throughput
# (BENCHMARKS.md, "Streaming"), often enough that text appears every few tens of milliseconds.
SEGMENT_ROUNDS = 16
STREAM_ROUNDS = 1  # the fewest rounds of a young streamed request's segments after its first (BENCHMARKS.md)


@dataclasses.dataclass
class Segment:
  """A segment set going on the device, not yet read: what it will report, and the requests its rows held."""
  report: programs.Report
  runs: list[Running | None]
  rounds: int
  dispatched: float  # when it was set going (time.perf_counter)


def widths(slots: int, narrow: bool) -> tuple[int, ...]:
  """The widths a segment runs over: the narrowest that holds every busy row (requests take the lowest free
  slot, so the busy rows stay low); each is a program to compile. Not `narrow` (a mesh, which splits rows, or
  a batch job, whose narrow stretch is only its tail): every row."""
  return tuple(sorted({min(1 << k, slots) for k in range(slots.bit_length() + 1)})) if narrow else (slots,)


def rounds(running: list[Running | None], waiting: bool, segment_rounds: int, stream_rounds: int) -> int:
  """The next segment's rounds: while none waits for a slot and a streamed request is young (has run
  fewer than `segment_rounds` rounds), as many as the youngest has run so far, at least one (its first
  token comes right after its prefill) and after that at least `stream_rounds`: its text arrives after
  1, 2, 4, 8, ... rounds, the first soon and each host visit a smaller share of the time than the one
  before. Else `segment_rounds` (fewer host visits: batch work, a stream's later text, and a saturated
  batch, whose throughput the waiting requests need)."""
  streams = [r.rounds for r in running if r is not None and r.request.stream]
  if waiting or not streams:
    return segment_rounds
  youngest = min(streams)
  return 1 if youngest == 0 else min(segment_rounds, max(stream_rounds, youngest))


def static(width: int, window: int, plain: bool = False) -> dict:
  """The segment program's static arguments: its width, the most tokens a row commits in a longest segment
  (`window`: those whose log-probabilities it hands back), and `plain` when it only takes plain steps."""
  return {"width": width, "window": window, "plain": True} if plain else {"width": width, "window": window}
