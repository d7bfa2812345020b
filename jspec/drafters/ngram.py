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

from jspec.drafters.base import Proposal
from jspec.sampling import SamplingParams


def lookup(tokens_BxT: jax.Array, seq_lens_B: jax.Array, max_ngram: int) -> tuple[jax.Array, jax.Array]:
  """(found [B], start [B]): where the continuation of the most recent, longest earlier match begins."""
  batch, width = tokens_BxT.shape
  n = seq_lens_B[:, None]
  j_T = jnp.arange(width)
  found = jnp.zeros((batch,), bool)
  start = jnp.zeros((batch,), jnp.int32)
  for m in range(1, max_ngram + 1):  # longer matches overwrite shorter ones
    match_BxT = (j_T + m <= n - 1) & (n >= m + 1)  # a continuation exists and the match is earlier
    for i in range(m):
      shifted = jnp.concatenate([tokens_BxT[:, i:], jnp.zeros((batch, i), tokens_BxT.dtype)], 1)
      suffix_B = jnp.take_along_axis(tokens_BxT, jnp.maximum(n - m + i, 0), axis=1)
      match_BxT &= shifted == suffix_B
    hit = match_BxT.any(1)
    start = jnp.where(hit, jnp.max(jnp.where(match_BxT, j_T, -1), axis=1) + m, start).astype(jnp.int32)
    found |= hit
  return found, start


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  vocab_size: int
  max_ngram: int = 3
  kind: str = "ngram"
  config = None  # no weights
  can_skip_rounds = True  # the loop may replace a round with a plain target step

  def init(self, batch: int, capacity: int, draft_len: int) -> None:
    return None

  def prefill(self, params, target_params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD) -> None:
    return None

  def propose(self, params, target_params, state, tokens_BxT, seq_lens_B, keys_KxBx2,
              sampling: SamplingParams) -> tuple[None, Proposal]:
    num = keys_KxBx2.shape[0]
    found, start = lookup(tokens_BxT, seq_lens_B, self.max_ngram)
    # Past the committed text the buffer holds stale tokens: still a valid (if poor) proposal.
    index = jnp.minimum(start[:, None] + jnp.arange(num), tokens_BxT.shape[1] - 1)
    tokens_BxK = jnp.take_along_axis(tokens_BxT, index, axis=1)
    logits_BxKxV = jnp.where(jax.nn.one_hot(tokens_BxK, self.vocab_size, dtype=bool), 0.0, -jnp.inf)
    return None, Proposal(tokens_BxK, logits_BxKxV, found)

  def observe(self, params, target_params, state, tokens_BxT, hidden_BxSxD, n_B, new_n_B) -> None:
    return None
