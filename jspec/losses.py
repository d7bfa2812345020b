"""The distillation loss that draft models and drafter heads are trained with."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
  """Mean over positions of KL(teacher || student), from logits [..., V]."""
  logp = jax.nn.log_softmax(teacher_logits, -1)
  logq = jax.nn.log_softmax(student_logits, -1)
  return jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1))
