"""Prompt lookup (n-gram) drafting: no parameters, no state.

For each row, find the most recent earlier occurrence of its last m tokens (m from `max_ngram` down to 1)
in its own context and propose the K tokens that followed it. Everything is fixed-shape comparisons over
the token buffer, inside the jitted loop. q is one-hot at the proposal, so verification stays exact. A row
with no match proposes a placeholder and reports has_draft False; when no row matches, the loop runs a
plain target step instead of a verify.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.core.settings import SpecConfig
from jspec.drafters.base import DraftContext, Drafter, DraftWeights, Proposal


def lookup(tokens_BxT: jax.Array, seq_lens_B: jax.Array, max_ngram: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(found [B], start [B], length [B]): where the continuation of the most recent, longest earlier match
  begins, and that match's length."""
  batch, width = tokens_BxT.shape
  n = seq_lens_B[:, None]
  j_T = jnp.arange(width)
  found = jnp.zeros((batch,), bool)
  start = length = jnp.zeros((batch,), jnp.int32)
  for m in range(1, max_ngram + 1):  # longer matches overwrite shorter ones
    match_BxT = (j_T + m <= n - 1) & (n >= m + 1)  # a continuation exists and the match is earlier
    for i in range(m):
      shifted = jnp.concatenate([tokens_BxT[:, i:], jnp.zeros((batch, i), tokens_BxT.dtype)], 1)
      suffix_B = jnp.take_along_axis(tokens_BxT, jnp.maximum(n - m + i, 0), axis=1)
      match_BxT &= shifted == suffix_B
    hit = match_BxT.any(1)
    start = jnp.where(hit, jnp.max(jnp.where(match_BxT, j_T, -1), axis=1) + m, start).astype(jnp.int32)
    length = jnp.where(hit, m, length)
    found |= hit
  return found, start, length


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  vocab_size: int
  max_ngram: int = 3
  kind = "ngram"
  config = None  # no weights
  needs_weights = False
  can_skip_rounds = True  # the loop may replace a round with a plain target step

  @classmethod
  def for_pair(cls, target, draft: None, spec: SpecConfig) -> NgramDrafter:
    return cls(target.config.vocab_size, spec.max_ngram)

  def forwards(self, draft_len: int) -> int:
    return 0  # a lookup, no forward

  def propose(self, weights: DraftWeights, state: None, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[None, Proposal]:
    found, start, _ = lookup(context.tokens_BxT, context.seq_lens_B, self.max_ngram)
    return None, self.proposal(self.own_tokens(context.tokens_BxT, start, keys_KxBx2.shape[0]), found)

  @staticmethod
  def own_tokens(tokens_BxT: jax.Array, start_B: jax.Array, num: int) -> jax.Array:
    """[B, num]: each row's tokens from `start`. Past the committed text the buffer holds stale tokens:
    still a valid (if poor) proposal."""
    index = jnp.minimum(start_B[:, None] + jnp.arange(num), tokens_BxT.shape[1] - 1)
    return jnp.take_along_axis(tokens_BxT, index, axis=1)

  def proposal(self, tokens_BxK: jax.Array, found_B: jax.Array) -> Proposal:
    """The proposal of these tokens, q one-hot at each (verification stays exact)."""
    logits_BxKxV = jnp.where(jax.nn.one_hot(tokens_BxK, self.vocab_size, dtype=bool), 0.0, -jnp.inf)
    return Proposal(tokens_BxK, logits_BxKxV, found_B)
