"""The losses drafters are trained with (pure JAX, beside the drafters that define theirs with them, so
decoding never imports the training stack)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
  """Mean over positions of KL(teacher || student), from logits [..., V]."""
  logp = jax.nn.log_softmax(teacher_logits, -1)
  logq = jax.nn.log_softmax(student_logits, -1)
  return jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1))


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Elementwise smooth L1 (Huber with delta 1): quadratic within 1 of the target, linear beyond."""
  error = jnp.abs(pred - target)
  return jnp.where(error < 1.0, 0.5 * error ** 2, error - 0.5)
