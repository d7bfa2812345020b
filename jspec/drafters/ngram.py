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

from jspec.sampling import SamplingParams


def lookup(tokens_BxL: jax.Array, seq_lens_B: jax.Array, max_ngram: int) -> tuple[jax.Array, jax.Array]:
  """(found [B], start [B]): where the continuation of the most recent, longest earlier match begins."""
  batch, width = tokens_BxL.shape
  n = seq_lens_B[:, None]
  j_L = jnp.arange(width)
  found = jnp.zeros((batch,), bool)
  start = jnp.zeros((batch,), jnp.int32)
  for m in range(1, max_ngram + 1):  # longer matches overwrite shorter ones
    match_BxL = (j_L + m <= n - 1) & (n >= m + 1)  # a continuation exists and the match is earlier
    for i in range(m):
      shifted = jnp.concatenate([tokens_BxL[:, i:], jnp.zeros((batch, i), tokens_BxL.dtype)], 1)
      suffix_B = jnp.take_along_axis(tokens_BxL, jnp.maximum(n - m + i, 0), axis=1)
      match_BxL &= shifted == suffix_B
    hit = match_BxL.any(1)
    start = jnp.where(hit, jnp.max(jnp.where(match_BxL, j_L, -1), axis=1) + m, start).astype(jnp.int32)
    found |= hit
  return found, start


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  vocab_size: int
  max_ngram: int = 3
  kind: str = "ngram"
  can_skip_rounds = True  # class attribute: the loop may replace a round with a plain target step

  def init(self, batch: int, capacity: int, draft_len: int) -> None:
    return None

  def prefill(self, params, target_params, state, prompts_BxP, prompt_lens_B, hidden_BxPxD) -> None:
    return None

  def propose(self, params, target_params, state, tokens_BxL, seq_lens_B, keys_GxBx2, sampling: SamplingParams):
    num = keys_GxBx2.shape[0]
    found, start = lookup(tokens_BxL, seq_lens_B, self.max_ngram)
    # Past the committed text the buffer holds stale tokens: still a valid (if poor) proposal.
    index = jnp.minimum(start[:, None] + jnp.arange(num), tokens_BxL.shape[1] - 1)
    tokens_BxG = jnp.take_along_axis(tokens_BxL, index, axis=1)
    logits_BxGxV = jnp.where(jax.nn.one_hot(tokens_BxG, self.vocab_size, dtype=bool), 0.0, -jnp.inf)
    return None, tokens_BxG, logits_BxGxV, found

  def observe(self, params, target_params, state, tokens_BxL, hidden_BxSxD, n_B, new_n_B) -> None:
    return None
