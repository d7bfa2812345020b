"""The host's side of a paged KV cache (`jspec.cache`): which pages of the pool are free, which each slot
holds, and the page table the device reads.

Page `NULL_PAGE` is scratch: every table entry of an idle slot, and of a slot's pages not yet given, points
at it, so what an idle row writes lands where nothing is read. A slot is given pages before it writes into
them (`grow`, ahead of each segment), so a running row reads only its own.
"""
from __future__ import annotations

import numpy as np

from jspec.cache import PAGE_SIZE

NULL_PAGE = 0


def pages_for(tokens: int) -> int:
  """Pages that hold `tokens` slots."""
  return -(-tokens // PAGE_SIZE)


class PageTable:
  """`pages` usable pages (the pool holds one more, `NULL_PAGE`) shared by `slots` rows of up to
  `pages_per_row` pages each."""

  def __init__(self, pages: int, slots: int, pages_per_row: int):
    if pages < 1:
      raise ValueError(f"a paged cache needs at least one page, got {pages}")
    self.pages, self.pages_per_row = pages, pages_per_row
    self.table = np.full((slots, pages_per_row), NULL_PAGE, np.int32)
    self._free = list(range(pages, NULL_PAGE, -1))  # a stack: the lowest page is given first
    self._held = [0] * slots
    self.changed = True  # the table differs from the device's copy

  @property
  def num_free(self) -> int:
    return len(self._free)

  def held(self, slot: int) -> int:
    return self._held[slot]

  def grow(self, slot: int, tokens: int) -> bool:
    """Gives `slot` the pages it lacks to hold `tokens` slots (at most a row's); False, giving none, when
    too few are free."""
    needed = min(pages_for(tokens), self.pages_per_row) - self._held[slot]
    if needed <= 0:
      return True
    if needed > len(self._free):
      return False
    held = self._held[slot]
    self.table[slot, held:held + needed] = [self._free.pop() for _ in range(needed)]
    self._held[slot] += needed
    self.changed = True
    return True

  def release(self, slot: int) -> None:
    """Frees every page of `slot`; its table row points at the scratch page again."""
    held = self._held[slot]
    self._free.extend(int(p) for p in self.table[slot, :held][::-1])
    self.table[slot] = NULL_PAGE
    self._held[slot] = 0
    self.changed = self.changed or held > 0
