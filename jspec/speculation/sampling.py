"""Logits -> the distribution we sample from, with temperature, top-k and top-p as per-row arrays.

Rows with temperature 0 get the one-hot of the argmax. Greedy decoding is then just sampling from a one-hot,
and the same rejection rule serves both: a one-hot p accepts a draft token iff it is the argmax, and its
residual is the argmax again. When the whole batch is greedy, the loops skip the distributions altogether
and work on argmaxes (`next_token`, `verify.verify_greedy`), which give the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.core.settings import SamplingConfig


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [B] float32; 0 = greedy
  top_k: jax.Array  # [B] int32; 0 = off
  top_p: jax.Array  # [B] float32; 1 = off


def sampling_arrays(sampling: SamplingConfig | Sequence[SamplingConfig], batch: int) -> SamplingParams:
  """Per-row sampling arrays from one setting for every row, or one per row."""
  rows = [sampling] * batch if isinstance(sampling, SamplingConfig) else list(sampling)
  if len(rows) != batch:
    raise ValueError(f"got sampling settings for {len(rows)} rows, not {batch}")
  return SamplingParams(temperature=np.asarray([s.temperature for s in rows], np.float32),
                        top_k=np.asarray([s.top_k for s in rows], np.int32),
                        top_p=np.asarray([s.top_p for s in rows], np.float32))


def _ordered_keys(logits: jax.Array) -> jax.Array:
  """uint32 keys in the order of the float32 logits (-inf lowest, -0 equal to 0): their bits, sign-flipped."""
  logits = logits.astype(jnp.float32)
  bits = lax.bitcast_convert_type(jnp.where(logits == 0, 0.0, logits), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_above(keys: jax.Array, weights: jax.Array, target_BxS: jax.Array) -> jax.Array:
  """Per [B,S] position, the largest key u whose heavier entries (keys > u) weigh at least `target`
  (0 if none does), found bit by bit from the top: 32 masked sums over V rather than a sort of V, which
  XLA:CPU runs far slower (docs/cpu-performance.md)."""
  def bit(i, found):
    candidate = found | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    heavier = jnp.sum(jnp.where(keys > candidate[..., None], weights, 0), axis=-1)
    return jnp.where(heavier >= target_BxS, candidate, found)
  return lax.fori_loop(0, 32, bit, jnp.zeros(keys.shape[:-1], jnp.uint32))


def _filter_top_k_top_p(logits_BxSxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Masks logits outside the top-k (ties with the k-th kept), then outside the smallest set of the most
  probable whose probability reaches top-p (ties with its least probable kept)."""
  vocab = logits_BxSxV.shape[-1]
  keys = _ordered_keys(logits_BxSxV)
  k_BxS = jnp.broadcast_to(jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)[:, None], keys.shape[:-1])
  # Each search runs only when a row asks for it; else 0, which every key is above.
  search = lambda asked, *args: lax.cond(asked, _largest_key_above,
                                         lambda *_: jnp.zeros(keys.shape[:-1], jnp.uint32), *args)
  kth = search(jnp.any(top_k_B > 0), keys, jnp.ones((), jnp.float32), k_BxS.astype(jnp.float32))
  logits_BxSxV = jnp.where(keys > kth[..., None], logits_BxSxV, -jnp.inf)
  p_BxS = jnp.broadcast_to(top_p_B[:, None], keys.shape[:-1])
  last = search(jnp.any(top_p_B < 1.0), keys, jax.nn.softmax(logits_BxSxV, axis=-1), p_BxS)
  return jnp.where((keys > last[..., None]) | (p_BxS[..., None] >= 1.0), logits_BxSxV, -jnp.inf)


def argmax(logits: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis, `[..., V] -> [...]` int32 (the first maximal index), as a max and a
  min: XLA:CPU's (value, index) pair reduction is several times slower over a few rows of logits, on
  every round's critical path (docs/cpu-performance.md)."""
  best = logits.max(-1, keepdims=True)
  index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.min(jnp.where(logits == best, index, logits.shape[-1] - 1), axis=-1)


def _processed(logits_BxSxV: jax.Array, params: SamplingParams) -> jax.Array:
  """fp32 logits at each row's temperature (1 for greedy rows), outside its top-k and top-p masked."""
  logits_BxSxV = logits_BxSxV.astype(jnp.float32)
  temperature = params.temperature[:, None, None]
  scaled = logits_BxSxV / jnp.where(temperature > 0, temperature, 1.0)
  filtering = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1.0)
  # Filtering is the costly part (32 passes over V each for top-k and top-p); skip it when no row asks for it.
  return lax.cond(filtering, _filter_top_k_top_p, lambda x, *_: x, scaled, params.top_k, params.top_p)


def probabilities(logits_BxSxV: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution each row samples from at each of S positions, fp32 [B,S,V]."""
  greedy = jax.nn.one_hot(argmax(logits_BxSxV), logits_BxSxV.shape[-1], dtype=jnp.float32)
  return jnp.where(params.temperature[:, None, None] > 0, jax.nn.softmax(_processed(logits_BxSxV, params), -1),
                   greedy)


def log_probabilities(logits_BxSxV: jax.Array, params: SamplingParams) -> jax.Array:
  """The log-probabilities a client is told of, fp32 [B,S,V]: those of the distribution a sampled row draws
  from (-inf outside its top-k and top-p), and of the model's own distribution for a greedy row (whose
  sampling distribution is a one-hot)."""
  raw = logits_BxSxV.astype(jnp.float32)
  return jax.nn.log_softmax(jnp.where(params.temperature[:, None, None] > 0, _processed(raw, params), raw), -1)


def is_greedy(params: SamplingParams) -> jax.Array:
  """True when every row decodes greedily: sampling is then an argmax, with no distributions or draws."""
  return jnp.all(params.temperature == 0)


def sample(keys_Bx2: jax.Array, probs_BxV: jax.Array) -> jax.Array:
  """One token per row from its own key, so a row's draws do not depend on the rest of the batch."""
  logp = jnp.log(probs_BxV)
  return jax.vmap(lambda key, lp: jax.random.categorical(key, lp))(keys_Bx2, logp).astype(jnp.int32)


def next_token(keys_Bx2: jax.Array, logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """Samples one token per row from its logits; an argmax when the whole batch is greedy."""
  return lax.cond(is_greedy(params), lambda: argmax(logits_BxV),
                  lambda: sample(keys_Bx2, probabilities(logits_BxV[:, None], params)[:, 0]))
