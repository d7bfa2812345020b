"""The requests in a slot whose prompts are not all in their pages yet (chunked prefill): how much of each is
in, the time its chunks took, and the widths a chunk may run at.

A paged prefill reads its prompt at the engine's prompt width and runs a prompt bucket of it from where its
pages end (0, a cached prefix, or the chunks so far): its program depends on that bucket alone, so a prefix
hit or a chunk uses the programs whole prompts use. Chunks are whole pages where the budget allows.
"""
from __future__ import annotations

from collections.abc import Iterator

from jspec.decoding import batches
from jspec.engine.requests import Running
from jspec.model.cache import PAGE_SIZE


class Prefills:
  """Slots prefilling, at most `max_tokens` prompt tokens a step (None: whole prompts, no chunks). Chunks go
  into pages: unless `paged`, prompts go whole."""

  def __init__(self, max_tokens: int | None, paged: bool = True):
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
      raise ValueError(f"max_prefill_tokens must be an integer >= 1, got {max_tokens}")
    self.max_tokens = max_tokens = max_tokens if paged else None
    buckets = sorted({batches.prompt_bucket(n) for n in range(1, (max_tokens or 0) + 1)})
    buckets = [w for w in buckets if w <= (max_tokens or 0)]
    self.chunk_widths = [w for w in buckets if w % PAGE_SIZE == 0] or buckets
    self._slots: dict[int, list] = {}  # slot -> [its Running, prompt tokens in its pages]
    self._seconds: dict[int, float] = {}  # slot -> its chunks' time, counted with its prefill

  def __contains__(self, slot: int) -> bool:
    return slot in self._slots

  def __len__(self) -> int:
    return len(self._slots)

  def __iter__(self) -> Iterator[int]:
    return iter(list(self._slots))

  def run(self, slot: int) -> Running:
    return self._slots[slot][0]

  def done(self, slot: int) -> int:
    """Prompt tokens of `slot`'s request in its pages."""
    return self._slots[slot][1]

  def runs(self) -> dict[int, Running]:
    return {b: run for b, (run, _) in self._slots.items()}

  def oldest_first(self) -> list[int]:
    return sorted(self._slots, key=lambda b: self._slots[b][0].admitted)

  def pending(self) -> int:
    """Prompt tokens still to prefill."""
    return sum(len(run.request.prompt_ids) - done for run, done in self._slots.values())

  def start(self, slot: int, run: Running, cached: int) -> None:
    """`run` takes `slot`, the first `cached` tokens of its prompt in its pages."""
    run.cached = cached
    self._slots[slot] = [run, cached]

  def restart(self, slot: int) -> None:
    """`slot`'s request prefills from its prompt's start (its cached prefix given up)."""
    self._slots[slot][1] = self._slots[slot][0].cached = 0

  def advanced(self, slot: int, tokens: int, seconds: float) -> None:
    """A chunk of `tokens` went into `slot`'s pages in `seconds`."""
    self._slots[slot][1] += tokens
    self._seconds[slot] = self._seconds.get(slot, 0.0) + seconds

  def end(self, slot: int) -> float:
    """`slot` prefilled (or ended): the time its chunks took."""
    self._slots.pop(slot, None)
    return self._seconds.pop(slot, 0.0)

  def prompt_lens(self, max_len: int) -> list[int]:
    """A prompt length per prefill width: a prompt bucket, up to the widest a step prefills."""
    longest = batches.prompt_bucket(min(max_len - 1, self.max_tokens or max_len))
    return sorted({min(batches.prompt_bucket(n), max_len - 1) for n in range(1, longest + 1)})

  def chunk(self, budget: float, rest: int) -> int:
    """The width of a prompt's next chunk, its rest `rest` tokens: the widest chunk width within `budget` that
    leaves the last two tokens for the insert; failing that, all of that with a whole step's budget (a program
    of its own), else none this step."""
    limit = int(min(budget, rest - 2))
    fits = [w for w in self.chunk_widths if w <= limit]
    return fits[-1] if fits else limit if budget == self.max_tokens else 0
