"""The host's side of a paged KV cache (`jspec.model.cache`): which pages of the pool are free, which each slot
holds, the page table the device reads, and the prefix cache.

The engine's pool holds the pages that the memory budget sizes, shared by its slots. A request is admitted
when pages for its prompt and a segment's tokens are free; before each segment every running row is given
the pages it may write into during it; when the pool runs out the youngest request is preempted (its pages
freed, it waits at the head of the queue, and later resumes from its prompt and the tokens it has emitted,
recomputed), as vLLM does.

Page `NULL_PAGE` is scratch: every table entry of an idle slot, and of a slot's pages not yet given, points
at it, so what an idle row writes lands where nothing is read. A slot is given pages before it writes into
them (`grow`, ahead of each segment), so a running row reads only its own, or shared ones it never writes.

Prefix caching (as vLLM's): a full page whose tokens are final is registered under the hash of every
token up to its end (`page_hashes`); a new request shares the pages of its longest registered prefix
(`share`) and prefills only the rest (a page keyed with the tokens after it that a drafter's cache reads
there: `Drafter.prefix_lookahead`); one whose prompt shares more with a request being prefilled waits a step
for those pages (the `n` choices of a prompt prefill it once). Pages count their holders; a registered page
no slot holds stays cached until a page is needed and none is free, then the least recently used goes.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jspec.model.cache import PAGE_SIZE

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


class KVPages:
  """The paged cache as the engine asks it (vLLM's KV cache manager over its block pool): a slot's pages for a
  request, the prefix's found in the prefix cache and the rest given fresh (`allocate`), grown ahead of each
  segment (`grow`), and let go (`free`), its full final pages cached. A page is keyed with the `lookahead`
  tokens after it that a drafter's cache reads there (`Drafter.prefix_lookahead`). Counts the prompt tokens
  looked up in the prefix cache and those found there.

  With `shards` > 1 (a pool split over a mesh's data axis, `jspec.model.cache.take_pages`) the slots and the
  pages split into that many shards in order, each a pool of its own with its own scratch page: shard d's
  slots hold only its pages (numbered from d * (pages / shards + 1) in the table the device reads), and find
  only its cached prefixes."""

  def __init__(self, pages: int, slots: int, pages_per_row: int, prefix_caching: bool = True, lookahead: int = 0,
               shards: int = 1):
    if slots % shards or pages % shards:
      raise ValueError(f"{slots} slots and {pages} pages do not split into {shards} shards")
    self._pools = [PageTable(pages // shards, slots // shards, pages_per_row) for _ in range(shards)]
    self.prefix_caching, self.lookahead = prefix_caching, lookahead
    self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up, and found cached

  def _pool(self, slot: int) -> tuple[PageTable, int]:
    """The shard's pool that holds `slot`, and the slot's index in it."""
    per_shard = self._pools[0].table.shape[0]
    return self._pools[slot // per_shard], slot % per_shard

  def shard(self, slot: int) -> int:
    return slot // self._pools[0].table.shape[0]

  @property
  def pages(self) -> int:
    """Usable pages (each shard's pool holds one more, its `NULL_PAGE`)."""
    return sum(p.pages for p in self._pools)

  @property
  def shard_pages(self) -> int:
    """Usable pages of one shard: the most one slot may hold."""
    return self._pools[0].pages

  @property
  def pool_size(self) -> int:
    """Pages of the device's pool: every shard's, scratch pages included."""
    return self.pages + len(self._pools)

  @property
  def num_free(self) -> int:
    return sum(p.num_free for p in self._pools)

  @property
  def table(self) -> np.ndarray:
    """[slots, pages_per_row]: the pool page of each slot's pages (its shard's `NULL_PAGE` where none is given)."""
    return np.concatenate([p.table + d * (p.pages + 1) for d, p in enumerate(self._pools)])

  def held(self, slot: int) -> int:
    pool, s = self._pool(slot)
    return pool.held(s)

  def final_pages(self, tokens: Sequence[int], margin: int = 2) -> list[bytes]:
    """The hashes of the full pages of `tokens` whose entries are final in every cache: the target's holds
    all but the last token, and a drafter's cache may trail it by `margin` (a prefill leaves a head
    drafter's at len - 2)."""
    return page_hashes(tokens[:max(len(tokens) - margin, 0) + self.lookahead], self.lookahead)

  def allocate(self, slot: int, prompt: Sequence[int], tokens: int) -> int | None:
    """Gives an empty slot the cached pages of `prompt`'s longest cached prefix and the pages that hold its
    first `tokens` slots; returns the prefix's tokens, or None (nothing given) when the pool cannot hold it yet."""
    pool, slot = self._pool(slot)
    shared = pool.match(self.final_pages(prompt)) if self.prefix_caching else []
    pool.share(slot, shared)
    if not pool.grow(slot, tokens):
      pool.release(slot)
      return None
    if self.prefix_caching:
      self.prefix_queries += len(prompt)
    return len(shared) * PAGE_SIZE

  def grow(self, slot: int, tokens: int) -> bool:
    """Gives `slot` the pages it lacks to hold `tokens` slots; False, giving none, when too few are free."""
    pool, slot = self._pool(slot)
    return pool.grow(slot, tokens)

  def unshare(self, slot: int, tokens: int) -> bool:
    """Gives `slot` fresh pages for its first `tokens` slots in place of the cached prefix's it shares, if the
    pool has them besides those: True if it did."""
    pool, slot = self._pool(slot)
    if pages_for(tokens) > pool.num_free:
      return False
    pool.release(slot)
    pool.grow(slot, tokens)
    return True

  def started(self, slot: int, prompt: Sequence[int], cached: int) -> None:
    """`slot`'s request prefilled its prompt, `cached` tokens of it from the prefix cache: its full pages
    are cached for the requests after it."""
    self.prefix_hits += cached
    if self.prefix_caching:
      pool, slot = self._pool(slot)
      pool.register(slot, self.final_pages(prompt))

  def free(self, slot: int, tokens: Sequence[int] | None = None, margin: int = 2) -> None:
    """Lets go of `slot`'s pages, first caching the full ones that `tokens` (its text, whose entries are final
    but for the last `margin`) fills; None: its prompt is not all in its pages, so none is cached."""
    pool, slot = self._pool(slot)
    if self.prefix_caching and tokens is not None:
      pool.register(slot, self.final_pages(tokens, margin))
    pool.release(slot)

  def shares_more(self, prompt: Sequence[int], others: Sequence[Sequence[int]]) -> bool:
    """Whether the pages of a prompt being prefilled (one of `others`) will hold more of `prompt` than the
    prefix cache does now (the `n` choices of one prompt, or requests with one system prompt, arriving
    together)."""
    if not self.prefix_caching or not others:
      return False
    mine = self.final_pages(prompt)
    cached = max(len(pool.match(mine)) for pool in self._pools)
    shared = lambda theirs: next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                                 min(len(mine), len(theirs)))
    return any(shared(self.final_pages(other)) > cached for other in others)

  def _scratch(self, slots: Sequence[int]) -> np.ndarray:
    """Each slot's shard's scratch page."""
    return np.asarray([self.shard(s) * (self.shard_pages + 1) + NULL_PAGE for s in slots], np.int32)

  def rows(self, slot: int | None, count: int) -> np.ndarray:
    """The page table rows of `count` slots from `slot`; None: the rows of slots from 0 with no pages (idle)."""
    if slot is None:
      return np.repeat(self._scratch(range(count))[:, None], self._pools[0].table.shape[1], 1)
    return self.table[slot:slot + count].astype(np.int32)

  def changed_table(self, unready: Sequence[int]) -> np.ndarray | None:
    """The page table for the device when it changed since the last call (else None), with the rows of the
    `unready` slots (prefilling, not decoding yet) pointing at the scratch page, so that no segment writes
    into their pages."""
    if not any(pool.changed for pool in self._pools):
      return None
    table = self.table
    unready = list(unready)
    table[unready] = self._scratch(unready)[:, None]
    for pool in self._pools:
      pool.changed = False
    return table
