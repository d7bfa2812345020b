"""Suffix drafting: proposals from what earlier requests wrote, besides the row's own text.

Suffix decoding (Oliaro et al., arXiv 2411.04975; vLLM's `method: "suffix"`) drafts from a corpus of past
outputs, where outputs repeat across requests (tool calls, records of one schema, code of one kind). Here
the corpus lives in the loop's state on the device, shared by every row (`SuffixIndex`): a ring buffer of
the texts (prompt and output) of requests that ended, and for each match length n in 1..`MAX_MATCH` a hash
table from the hash of n tokens to the ring position after their latest occurrence that a whole draft of
its text follows. A request's text goes in when the next request takes its row (`retire`, in the insert
program), so the index lives as long as the engine; its shapes are fixed, so nothing compiles again as it
fills. A request that opts out (`Request.suffix_cache` False: the row's `share_B`) neither enters the index
nor drafts from it.

Each round a row looks up its last n tokens for the longest n whose latest occurrence still holds them (a
hash collision or an overwritten entry falls through to a shorter n), and its own context as the n-gram
drafter does; it proposes the K tokens after the longer of the two matches (its own on a tie). q is
one-hot at the proposal, so verification stays exact; a row with neither match proposes nothing, and when
no row has one the loop runs a plain step.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jspec.drafters.base import DraftContext, DraftWeights, Proposal
from jspec.drafters.ngram import NgramDrafter, lookup
from jspec.settings import SpecConfig

MAX_MATCH = 8  # the longest run of tokens looked up in the index
_MIX = 0x9E3779B1  # a hash step's multiplier (2^32 over the golden ratio, odd)


@flax.struct.dataclass
class SuffixIndex:
  """Past texts (C tokens, one after another in a ring) and where each n-gram's latest occurrence ends."""
  ring_C: jax.Array  # int32: token `a` of all written is at `a % C`
  table_NxH: jax.Array  # int32: for n = i + 1 tokens hashing to h, the absolute position after them; -1: none
  written: jax.Array  # int32 []: tokens written in all

  @property
  def size(self) -> int:
    return self.ring_C.shape[0]


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


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(NgramDrafter):
  """`ngram`'s lookup in the row's own context, and the index of earlier requests' texts."""
  cache_tokens: int = 1 << 16
  buckets: int = 1 << 16  # hash buckets per match length (a power of two): one entry each, the latest kept
  depth: int = 8  # the longest draft: an occurrence is indexed only if that many tokens of its text follow it
  kind = "suffix"

  @classmethod
  def for_pair(cls, target, draft: None, spec: SpecConfig) -> SuffixDrafter:
    tokens = spec.suffix_cache_tokens
    return cls(target.config.vocab_size, spec.max_ngram, tokens, 1 << (tokens - 1).bit_length(), spec.draft_len)

  def init(self, batch: int, capacity: int, draft_len: int) -> SuffixIndex:
    return SuffixIndex(jnp.zeros((self.cache_tokens,), jnp.int32),
                       jnp.full((MAX_MATCH, self.buckets), -1, jnp.int32), jnp.zeros((), jnp.int32))

  def retire(self, state: SuffixIndex, tokens_RxT: jax.Array, lens_R: jax.Array) -> SuffixIndex:
    """Writes the texts of rows that end (`tokens[r, :lens[r]]`) into the index, one after another."""
    width = tokens_RxT.shape[1]
    i_T = jnp.arange(width)
    for tokens_T, length in zip(tokens_RxT, lens_R):
      length = jnp.minimum(length, width)
      at_T = state.written + i_T  # absolute positions
      kept_T = (i_T < length) & (i_T >= length - state.size)  # a text longer than the ring keeps its end
      ring = state.ring_C.at[jnp.where(kept_T, at_T % state.size, state.size)].set(tokens_T, mode="drop")
      # The n tokens before position e are followed by token e, at absolute position at[e]: indexed where a
      # whole draft of the text follows (an occurrence at a text's end would propose the next text's start).
      hashes_TxN = suffix_hashes(tokens_T[None], i_T[None])[0]
      n_N = jnp.arange(1, MAX_MATCH + 1)
      valid_TxN = (i_T[:, None] >= n_N) & (i_T[:, None] + self.depth <= length)
      value_TxN = jnp.where(valid_TxN, at_T[:, None], -1)
      bucket_TxN = (hashes_TxN & jnp.uint32(self.buckets - 1)).astype(jnp.int32)
      table = state.table_NxH.at[jnp.broadcast_to(n_N - 1, bucket_TxN.shape), bucket_TxN].max(value_TxN)
      state = SuffixIndex(ring, table, state.written + length)
    return state

  def find(self, state: SuffixIndex, tokens_BxT: jax.Array, seq_lens_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(length [B], start [B]): the longest n whose n tokens end each row and were last seen in the index
    (0: none), and the absolute position after that occurrence."""
    hashes_BxN = suffix_hashes(tokens_BxT, seq_lens_B[:, None])[:, 0]
    n_N = jnp.arange(1, MAX_MATCH + 1)
    bucket_BxN = (hashes_BxN & jnp.uint32(self.buckets - 1)).astype(jnp.int32)
    after_BxN = state.table_NxH[n_N - 1, bucket_BxN]
    # Still in the ring, and the n tokens before it are the row's last n (i < n of them compared).
    ok_BxN = (after_BxN >= 0) & (after_BxN - n_N >= state.written - state.size) & (seq_lens_B[:, None] >= n_N)
    for i in range(MAX_MATCH):
      seen = state.ring_C[(after_BxN - 1 - i) % state.size]
      mine = jnp.take_along_axis(tokens_BxT, jnp.maximum(seq_lens_B - 1 - i, 0)[:, None], axis=1)
      ok_BxN &= (n_N <= i) | (seen == mine)
    length = jnp.max(jnp.where(ok_BxN, n_N, 0), axis=1)
    start = jnp.take_along_axis(after_BxN, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    return length, start

  def propose(self, weights: DraftWeights, state: SuffixIndex, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[SuffixIndex, Proposal]:
    num, tokens_BxT = keys_KxBx2.shape[0], context.tokens_BxT
    own_found, own_start, own_length = lookup(tokens_BxT, context.seq_lens_B, self.max_ngram)
    length, start = self.find(state, tokens_BxT, context.seq_lens_B)
    index = (length > jnp.where(own_found, own_length, 0)) & context.share_B
    # Past the ring's newest token lie stale ones: still a valid (if poor) proposal.
    past_BxK = state.ring_C[(start[:, None] + jnp.arange(num)) % state.size]
    tokens_BxK = jnp.where(index[:, None], past_BxK, self.own_tokens(tokens_BxT, own_start, num))
    return state, self.proposal(tokens_BxK, own_found | index)
