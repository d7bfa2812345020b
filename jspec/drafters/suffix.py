"""Suffix drafting: proposals from what other requests wrote, besides the row's own text.

Suffix decoding (Oliaro et al., arXiv 2411.04975; vLLM's `method: "suffix"`) drafts from a corpus of past
outputs, where outputs repeat across requests (tool calls, records of one schema, code of one kind). Here
the corpus lives in the loop's state on the device, shared by every row (`SuffixIndex`), in two parts:

- the texts (prompt and output) of requests that ended, one after another in a ring buffer; a request's
  text goes in when the next request takes its row (`retire`, in the insert program), so they outlive the
  rows and last as long as the engine;
- the outputs of the rows running now, read where the loop keeps them (the token buffer): each round's
  committed tokens are indexed as they come (`observe`), so concurrent requests (a server's, or one
  static batch's rows) draft from each other.

For each part and each match length n in 1..`MAX_MATCH`, a hash table maps the hash of n tokens to the
position after their latest occurrence that a whole draft of its text follows. Shapes are fixed, so nothing
compiles again as the index fills. A request that opts out (`Request.suffix_cache` False: the row's
`share_B`) neither enters the index nor drafts from it.

Each round a row looks up its last n tokens in both parts for the longest n whose entry still holds them
(a hash collision, an overwritten ring entry or a row that took a new request falls through to a shorter
n), and its own context as the n-gram drafter does; it proposes the K tokens after the longest of the
three matches (its own, then a running row's, on a tie) if that is `min_match` tokens or more. q is one-hot
at the proposal, so verification stays exact; a row with no match proposes nothing, and when no row has one
the loop runs a plain step.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jspec.core.settings import SpecConfig
from jspec.drafters.base import DraftContext, DraftWeights, Proposal
from jspec.drafters.ngram import NgramDrafter, lookup

MAX_MATCH = 8  # the longest run of tokens looked up in the index
_MIX = 0x9E3779B1  # a hash step's multiplier (2^32 over the golden ratio, odd)


# Shapes outside the package's legend: the ring holds `cache_tokens` tokens, and each table has a row per match
# length (MAX_MATCH) and a power-of-two number of buckets. Arrays with a last axis of match lengths are named
# without shape suffixes, their shapes said beside them.
MATCH_LENGTHS = np.arange(1, MAX_MATCH + 1, dtype=np.int32)


@flax.struct.dataclass
class SuffixIndex:
  """Past texts (one after another in a ring) and where each n-gram's latest occurrence ends, in them and
  in the running rows' outputs."""
  ring: jax.Array  # int32 [cache_tokens]: token `a` of all written is at `a % cache_tokens`
  past: jax.Array  # int32 [MAX_MATCH, buckets]: for n tokens hashing to h, the ring position after them; -1: none
  written: jax.Array  # int32 []: tokens written in all
  # int32 [MAX_MATCH, buckets]: for n tokens hashing to h, b * T + e, position e of running row b's text
  # following them; -1: none
  running: jax.Array

  @property
  def size(self) -> int:
    return self.ring.shape[0]


def _mix(h: jax.Array, token: jax.Array) -> jax.Array:
  return (h ^ token.astype(jnp.uint32)) * jnp.uint32(_MIX)


def suffix_hashes(tokens_BxT: jax.Array, ends_BxE: jax.Array) -> jax.Array:
  """[B, E, MAX_MATCH] uint32: the hash of the n tokens before each end (n = 1..MAX_MATCH, the last first);
  positions before the text read as token 0 (their hashes are never trusted: the caller masks n > end)."""
  h = jnp.zeros(ends_BxE.shape, jnp.uint32)
  out = []
  for n in range(1, MAX_MATCH + 1):
    at = jnp.maximum(ends_BxE - n, 0)
    h = _mix(h, jnp.take_along_axis(tokens_BxT, at, axis=1))
    out.append(h)
  return jnp.stack(out, -1)


def _entries(table: jax.Array, hashes: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The table entries of these hashes (`[..., MAX_MATCH]`, n tokens each) as a scatter's indices; invalid
  ones out of range (a scatter with mode="drop" skips them)."""
  buckets = table.shape[1]
  bucket = jnp.where(valid, (hashes & jnp.uint32(buckets - 1)).astype(jnp.int32), buckets)
  return jnp.broadcast_to(MATCH_LENGTHS - 1, bucket.shape), bucket


def _longest_match(table: jax.Array, source: jax.Array, holds, tokens_BxT: jax.Array,
                   seq_lens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(length [B], after [B]): for each row, the longest n (0: none) whose table entry `after` (a position in
  `source`, the 1-D text the table indexes) is set, `holds(after, n)`, and follows the row's last n tokens;
  and that entry."""
  hashes = suffix_hashes(tokens_BxT, seq_lens_B[:, None])[:, 0]  # [B, MAX_MATCH], as `after` and `ok`
  after = table[_entries(table, hashes, True)]
  ok = (after >= 0) & holds(after, MATCH_LENGTHS) & (seq_lens_B[:, None] >= MATCH_LENGTHS)
  for i in range(MAX_MATCH):  # the i-th token before the entry is the row's (i < n of them compared)
    seen = source[(after - 1 - i) % source.shape[0]]
    mine = jnp.take_along_axis(tokens_BxT, jnp.maximum(seq_lens_B - 1 - i, 0)[:, None], axis=1)
    ok &= (MATCH_LENGTHS <= i) | (seen == mine)
  length = jnp.max(jnp.where(ok, MATCH_LENGTHS, 0), axis=1)
  return length, jnp.take_along_axis(after, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(NgramDrafter):
  """`ngram`'s lookup in the row's own context, and the index of other requests' texts."""
  cache_tokens: int = 1 << 16
  buckets: int = 1 << 16  # hash buckets per match length (a power of two): one entry each, the latest kept
  depth: int = 8  # the longest draft: an occurrence is indexed only if that many tokens of its text follow it
  # The shortest match (of any source) proposed from: one token's latest continuation is rarely the next
  # text, and its rejected drafts cost verifies and pull the adaptive policy's K down (BENCHMARKS.md).
  min_match: int = 2
  kind = "suffix"

  @classmethod
  def for_pair(cls, target, draft: None, spec: SpecConfig) -> SuffixDrafter:
    tokens = spec.suffix_cache_tokens
    return cls(target.config.vocab_size, spec.max_ngram, tokens, 1 << (tokens - 1).bit_length(), spec.draft_len)

  def init(self, batch: int, capacity: int, draft_len: int) -> SuffixIndex:
    running = min(self.buckets, 1 << (batch * capacity - 1).bit_length())  # a bucket per running token at most
    return SuffixIndex(jnp.zeros((self.cache_tokens,), jnp.int32),
                       jnp.full((MAX_MATCH, self.buckets), -1, jnp.int32), jnp.zeros((), jnp.int32),
                       jnp.full((MAX_MATCH, running), -1, jnp.int32))

  def retire(self, state: SuffixIndex, tokens_RxT: jax.Array, lens_R: jax.Array) -> SuffixIndex:
    """Writes the texts of rows that end (`tokens[r, :lens[r]]`) into the ring, one after another."""
    width = tokens_RxT.shape[1]
    i_T = jnp.arange(width)
    for tokens_T, length in zip(tokens_RxT, lens_R):
      length = jnp.minimum(length, width)
      at_T = state.written + i_T  # absolute positions
      kept_T = (i_T < length) & (i_T >= length - state.size)  # a text longer than the ring keeps its end
      ring = state.ring.at[jnp.where(kept_T, at_T % state.size, state.size)].set(tokens_T, mode="drop")
      # The n tokens before position e are followed by token e, at absolute position at[e]: indexed where a
      # whole draft of the text follows (an occurrence at a text's end would propose the next text's start).
      # Positions only grow, so the largest is the latest.
      valid = (i_T[:, None] >= MATCH_LENGTHS) & (i_T[:, None] + self.depth <= length)  # [T, MAX_MATCH]
      hashes = suffix_hashes(tokens_T[None], i_T[None])[0]
      past = state.past.at[_entries(state.past, hashes, valid)].max(
          jnp.broadcast_to(at_T[:, None], valid.shape), mode="drop")
      state = state.replace(ring=ring, past=past, written=state.written + length)
    return state

  def observe(self, weights: DraftWeights, state: SuffixIndex, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> SuffixIndex:
    """Indexes the running rows' occurrences that a whole draft now follows: the round took row b from n_B
    tokens to `context.seq_lens_B`, at most S more."""
    tokens_BxT = context.tokens_BxT
    ends_BxS = n_B[:, None] - self.depth + 1 + jnp.arange(hidden_BxSxD.shape[1])  # newly followed by a draft
    followed_BxS = (ends_BxS + self.depth <= context.seq_lens_B[:, None]) & context.share_B[:, None]
    valid = followed_BxS[..., None] & (ends_BxS[..., None] >= MATCH_LENGTHS)  # [B, S, MAX_MATCH]
    at_BxS = jnp.arange(tokens_BxT.shape[0])[:, None] * tokens_BxT.shape[1] + ends_BxS
    entries = _entries(state.running, suffix_hashes(tokens_BxT, jnp.maximum(ends_BxS, 0)), valid)
    running = state.running.at[entries].set(jnp.broadcast_to(at_BxS[..., None], valid.shape), mode="drop")
    return state.replace(running=running)

  def find(self, state: SuffixIndex, tokens_BxT: jax.Array, seq_lens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(length [B], start [B]): the longest n whose n tokens end each row and were last seen in the ring
    (0: none), and the absolute position after that occurrence."""
    return _longest_match(state.past, state.ring, lambda after, n: after - n >= state.written - state.size,
                          tokens_BxT, seq_lens_B)

  def find_running(self, state: SuffixIndex, tokens_BxT: jax.Array,
                   seq_lens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(length [B], at [B]): the same in the running rows' outputs, `at` a position in `tokens_BxT`
    flattened (row b's position e at b * T + e; a row since given to another request fails the comparison)."""
    flat = tokens_BxT.reshape(-1)
    return _longest_match(state.running, flat, lambda after, n: after < flat.shape[0], tokens_BxT, seq_lens_B)

  def propose(self, weights: DraftWeights, state: SuffixIndex, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[SuffixIndex, Proposal]:
    num, tokens_BxT, lens_B = keys_KxBx2.shape[0], context.tokens_BxT, context.seq_lens_B
    long_enough = lambda length: jnp.where(length >= self.min_match, length, 0)
    own_found, own_start, own_length = lookup(tokens_BxT, lens_B, self.max_ngram)
    own_length = long_enough(jnp.where(own_found, own_length, 0))
    running_length, running_at = self.find_running(state, tokens_BxT, lens_B)
    running_length = long_enough(running_length)
    past_length, past_start = self.find(state, tokens_BxT, lens_B)
    own = own_length > 0
    running = (running_length > own_length) & context.share_B
    past = (long_enough(past_length) > jnp.maximum(own_length, running_length)) & context.share_B
    i_K = jnp.arange(num)
    # A whole draft follows a running row's occurrence; past the ring's newest token lie stale ones: still a
    # valid (if poor) proposal.
    tokens_BxK = jnp.where(past[:, None], state.ring[(past_start[:, None] + i_K) % state.size],
                           jnp.where(running[:, None], tokens_BxT.reshape(-1)[running_at[:, None] + i_K],
                                     self.own_tokens(tokens_BxT, own_start, num)))
    return state, self.proposal(tokens_BxK, own | running | past)
