"""What a cached query may see, and how its logits are capped: the rules the reference attention loop
(`jspec.model.attention`) and the Pallas kernels (`jspec.model.kernels.pallas_attention`) share."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked logits: finite, so a block that a row cannot see at all leaves no NaN in the online softmax (its
# weights vanish once a visible block raises the running max, and every query sees at least itself).
MASKED = -1e30


def scores(s: jax.Array, softcap: float | None) -> jax.Array:
  """Logits bounded to (-softcap, softcap) as Gemma 2 does, or as they are."""
  return s if softcap is None else softcap * jnp.tanh(s / softcap)


def visible(kpos: jax.Array, qpos: jax.Array, window: int) -> jax.Array:
  """Causal, and within the last `window` positions when window > 0 (as transformers' sliding window)."""
  return (kpos <= qpos) & ((kpos > qpos - window) if window else True)
