"""Mixture-of-experts MLPs: a router picks each token's experts, and the experts run as grouped matmuls.

A sparse layer's parameters: `router [D,O]`, with sigmoid routing `router_bias [O]` (the correction bias
that only steers the choice), the experts' gated MLPs stacked `we_gate, we_up [O,D,Fe]`, `we_down [O,Fe,D]`,
and shared experts as an ordinary MLP (`w_gate`, `w_up`, `w_down` of `MoeConfig.shared_dim`) beside them.

Every token runs exactly its own `top_k` experts: the (token, expert) pairs are sorted by expert and each
expert's rows go through one `jax.lax.ragged_dot`, so nothing is padded to a capacity and no token is ever
dropped (a dropped token would change the target's distribution, and speculation would no longer be lossless).
Routing is per token, so a row's output does not depend on what else is in the batch. XLA for TPUs and GPUs
runs `ragged_dot` as a grouped matmul; XLA:CPU expands it into one masked matmul per expert.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jspec.model.config import MoeConfig

Params = dict


def route(h_TxD: jax.Array, layer: Params, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
  """Each token's experts and their weights, `([T,Ok] fp32, [T,Ok] int32)`, as transformers routes: in
  fp32, softmax (Mixtral, Qwen3-MoE) or sigmoid scores whose choice the correction bias steers among the
  best groups (GLM-4.5, DeepSeek-V3), optionally renormalized, then scaled."""
  logits_TxO = jnp.dot(h_TxD.astype(jnp.float32), layer["router"].astype(jnp.float32))
  if moe.routing == "softmax":
    scores_TxO = jax.nn.softmax(logits_TxO, axis=-1)
    choice_TxO = scores_TxO
  else:
    scores_TxO = jax.nn.sigmoid(logits_TxO)
    choice_TxO = scores_TxO + layer["router_bias"].astype(jnp.float32)
    if moe.groups > 1:  # a group's score: the sum of its two best experts'
      grouped = choice_TxO.reshape(choice_TxO.shape[0], moe.groups, -1)
      group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
      kept = jax.lax.top_k(group_scores, moe.top_groups)[1]
      in_kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(len(kept))[:, None], kept].set(True)
      choice_TxO = jnp.where(in_kept[:, :, None], grouped, -jnp.inf).reshape(choice_TxO.shape)
  experts_TxOk = jax.lax.top_k(choice_TxO, moe.top_k)[1]
  weights_TxOk = jnp.take_along_axis(scores_TxO, experts_TxOk, axis=-1)
  if moe.normalize:
    weights_TxOk = weights_TxOk / (weights_TxOk.sum(-1, keepdims=True) + 1e-20)
  return weights_TxOk * moe.scale, experts_TxOk


def experts(h_BxSxD: jax.Array, layer: Params, moe: MoeConfig, activation: Callable) -> jax.Array:
  """The routed experts' weighted sum for every token, [B,S,D] in `h`'s dtype (shared experts not included)."""
  h_TxD = h_BxSxD.reshape(-1, h_BxSxD.shape[-1])
  weights_TxOk, experts_TxOk = route(h_TxD, layer, moe)
  order = jnp.argsort(experts_TxOk.reshape(-1), stable=True)  # the (token, expert) pairs, by expert
  token = order // moe.top_k
  sizes_O = jnp.bincount(experts_TxOk.reshape(-1), length=moe.experts).astype(jnp.int32)
  x = h_TxD[token]
  hidden = activation(jax.lax.ragged_dot(x, layer["we_gate"], sizes_O)) * jax.lax.ragged_dot(x, layer["we_up"],
                                                                                             sizes_O)
  y = jax.lax.ragged_dot(hidden, layer["we_down"], sizes_O)
  y = y * weights_TxOk.reshape(-1)[order][:, None].astype(y.dtype)
  return jnp.zeros_like(h_TxD).at[token].add(y).reshape(h_BxSxD.shape)
