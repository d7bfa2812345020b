"""The host's side of a paged KV cache (`jspec.cache`): which pages of the pool are free, which each slot
holds, the page table the device reads, and the prefix cache.

Page `NULL_PAGE` is scratch: every table entry of an idle slot, and of a slot's pages not yet given, points
at it, so what an idle row writes lands where nothing is read. A slot is given pages before it writes into
them (`grow`, ahead of each segment), so a running row reads only its own, or shared ones it never writes.

Prefix caching (as vLLM's): a full page whose tokens are final is registered under the hash of every
token up to its end (`page_hashes`); a new request shares the pages of its longest registered prefix
(`share`) and prefills only the rest. Pages count their holders; a registered page no slot holds stays
cached until a page is needed and none is free, then the least recently used goes.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jspec.cache import PAGE_SIZE

NULL_PAGE = 0


def pages_for(tokens: int) -> int:
  """Pages that hold `tokens` slots."""
  return -(-tokens // PAGE_SIZE)


def page_hashes(tokens: Sequence[int], lookahead: int = 0) -> list[bytes]:
  """The hash of each full page of `tokens` followed by `lookahead` more of them, chained: page i's covers
  every token up to its end, and the `lookahead` after it."""
  ids = np.asarray(tokens, np.int64)
  digest, hashes = b"", []
  for i in range((len(ids) - lookahead) // PAGE_SIZE):
    end = (i + 1) * PAGE_SIZE
    digest = hashlib.blake2b(digest + ids[end - PAGE_SIZE:end].tobytes(), digest_size=16).digest()
    hashes.append(hashlib.blake2b(digest + ids[end:end + lookahead].tobytes(), digest_size=16).digest()
                  if lookahead else digest)
  return hashes


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
    self._holders = np.zeros(pages + 1, np.int32)
    self._page_of: dict[bytes, int] = {}  # the prefix cache
    self._hash_of: dict[int, bytes] = {}
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, held by none: LRU first
    self.changed = True  # the table differs from the device's copy

  @property
  def num_free(self) -> int:
    """Pages a slot may be given: free ones and cached ones no slot holds."""
    return len(self._free) + len(self._idle)

  def held(self, slot: int) -> int:
    return self._held[slot]

  def _take(self) -> int:
    if self._free:
      return self._free.pop()
    page, _ = self._idle.popitem(last=False)  # the least recently used cached page
    del self._page_of[self._hash_of.pop(page)]
    return page

  def grow(self, slot: int, tokens: int) -> bool:
    """Gives `slot` the pages it lacks to hold `tokens` slots (at most a row's); False, giving none, when
    too few are free."""
    needed = min(pages_for(tokens), self.pages_per_row) - self._held[slot]
    if needed <= 0:
      return True
    if needed > self.num_free:
      return False
    held = self._held[slot]
    for i in range(held, held + needed):
      self.table[slot, i] = page = self._take()
      self._holders[page] = 1
    self._held[slot] += needed
    self.changed = True
    return True

  def release(self, slot: int) -> None:
    """Lets go of every page of `slot` (a cached one stays cached); its table row points at the scratch
    page again."""
    held = self._held[slot]
    for page in self.table[slot, :held][::-1].tolist():
      self._holders[page] -= 1
      if self._holders[page] == 0:
        if page in self._hash_of:
          self._idle[page] = None
        else:
          self._free.append(page)
    self.table[slot] = NULL_PAGE
    self._held[slot] = 0
    self.changed = self.changed or held > 0

  def match(self, hashes: Sequence[bytes]) -> list[int]:
    """The cached pages of the longest prefix of `hashes`."""
    pages = []
    for h in hashes:
      page = self._page_of.get(h)
      if page is None:
        break
      pages.append(page)
    return pages

  def share(self, slot: int, pages: Sequence[int]) -> None:
    """Gives an empty `slot` cached `pages` as its first (it must never write into them)."""
    assert self._held[slot] == 0
    for i, page in enumerate(pages):
      self.table[slot, i] = page
      self._holders[page] += 1
      self._idle.pop(page, None)
    self._held[slot] = len(pages)
    self.changed = self.changed or bool(pages)

  def register(self, slot: int, hashes: Sequence[bytes]) -> None:
    """Caches `slot`'s first pages under `hashes` (their tokens final); a hash already cached keeps its page."""
    for page, h in zip(self.table[slot, :min(len(hashes), self._held[slot])].tolist(), hashes):
      if h not in self._page_of and page not in self._hash_of:
        self._page_of[h], self._hash_of[page] = page, h
