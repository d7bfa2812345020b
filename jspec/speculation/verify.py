"""Speculative verification: accept a prefix of the draft and emit one more token (Leviathan et al. 2023).

Draft token x_i, drawn from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At the first
rejection the replacement is drawn from norm(max(0, p_i - q_i)); if all K are accepted, a bonus token is
drawn from p_{K+1}. The emitted tokens are then distributed exactly as the target's p. With one-hot p
(greedy rows) this accepts while the draft equals the argmax, and emits the argmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.speculation.sampling import argmax, sample


def accepted_prefix(accepted_BxK: jax.Array) -> jax.Array:
  """[B] int32: how many leading proposals of each row were accepted."""
  return jnp.sum(jnp.cumprod(accepted_BxK, axis=1), axis=1).astype(jnp.int32)


def verify(keys_Bx2: jax.Array, draft_BxK: jax.Array, q_BxKxV: jax.Array,
           p_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Returns `(n_accepted [B], next_token [B])`: the row emits drafts [0, n) then next_token."""
  batch, num_draft = draft_BxK.shape
  accept_key, residual_key = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(keys_Bx2), 1, 0)
  p_x = jnp.take_along_axis(p_BxK1xV[:, :num_draft], draft_BxK[..., None], axis=-1)[..., 0]
  q_x = jnp.take_along_axis(q_BxKxV, draft_BxK[..., None], axis=-1)[..., 0]
  u_BxK = jax.vmap(lambda k: jax.random.uniform(k, (num_draft,)))(accept_key)
  accepted_BxK = u_BxK * q_x < p_x  # u < p/q without dividing; q(x) > 0 since x was drawn from q
  n_accepted = accepted_prefix(accepted_BxK)

  # Padding q with a zero row makes the residual after K acceptances p_{K+1} itself: the bonus token.
  q_pad = jnp.concatenate([q_BxKxV, jnp.zeros_like(q_BxKxV[:, :1])], axis=1)
  at = n_accepted[:, None, None]
  p_n = jnp.take_along_axis(p_BxK1xV, at, axis=1)[:, 0]
  return n_accepted, sample(residual_key, residual(p_n, jnp.take_along_axis(q_pad, at, axis=1)[:, 0]))


def residual(p_BxV: jax.Array, q_BxV: jax.Array) -> jax.Array:
  """norm(max(0, p - q)): what a token is drawn from after a draft from q is rejected. A zero residual
  means p == q, where rejection has probability 0: p itself then."""
  left = jnp.maximum(p_BxV - q_BxV, 0.0)
  total = left.sum(-1, keepdims=True)
  return jnp.where(total > 0, left / jnp.where(total > 0, total, 1.0), p_BxV)


def verify_greedy(draft_BxK: jax.Array, target_logits_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`verify` for a batch where every row is greedy (one-hot p and q), computed from argmaxes alone."""
  best_BxK1 = argmax(target_logits_BxK1xV)
  n_accepted = accepted_prefix(draft_BxK == best_BxK1[:, :-1])
  return n_accepted, jnp.take_along_axis(best_BxK1, n_accepted[:, None], axis=1)[:, 0]


# Medusa's defaults (Cai et al. 2024): accept x when p(x) > min(EPSILON, DELTA * exp(-entropy(p))).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3


def verify_typical(keys_Bx2: jax.Array, draft_BxK: jax.Array, p_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Medusa's typical acceptance: LOSSY. Accepts each draft token the target finds plausible enough, then
  samples the next token from p. The output no longer follows p exactly; greedy rows (one-hot p) still
  accept only the argmax, so greedy output is unchanged."""
  num_draft = draft_BxK.shape[1]
  p_x = jnp.take_along_axis(p_BxK1xV[:, :num_draft], draft_BxK[..., None], axis=-1)[..., 0]
  p = p_BxK1xV[:, :num_draft]
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  accepted_BxK = p_x > jnp.minimum(TYPICAL_EPSILON, TYPICAL_DELTA * jnp.exp(-entropy))
  n_accepted = accepted_prefix(accepted_BxK)
  p_n = jnp.take_along_axis(p_BxK1xV, n_accepted[:, None, None], axis=1)[:, 0]
  return n_accepted, sample(keys_Bx2, p_n)
