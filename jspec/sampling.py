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

from jspec.settings import SamplingConfig


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


def _filter_top_k_top_p(logits_BxSxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Masks logits outside the top-k, then outside the smallest set whose probability reaches top-p."""
  vocab = logits_BxSxV.shape[-1]
  sorted_desc = -jnp.sort(-logits_BxSxV, axis=-1)
  k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None, None].astype(jnp.int32), axis=-1)
  logits_BxSxV = jnp.where(logits_BxSxV < kth, -jnp.inf, logits_BxSxV)
  sorted_desc = jnp.where(jnp.arange(vocab) < k[:, None, None], sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p_B[:, None, None]  # the first token is always kept
  threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BxSxV < threshold, -jnp.inf, logits_BxSxV)


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
  # Sorting V logits is the costly part; skip it when no row asks for it.
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
