"""Mixture-of-experts MLPs: a router picks each token's experts, and each token gets exactly their weighted sum.

A sparse layer's parameters: `router [D,O]`, with sigmoid routing `router_bias [O]` (the correction bias
that only steers the choice), the experts' gated MLPs stacked, `we_gate_up [O,D,2Fe]` and `we_down [O,Fe,D]`,
and shared experts as an ordinary MLP (`w_gate`, `w_up`, `w_down` of `MoeConfig.shared_dim`) beside them.

`we_gate_up` holds each expert's gate and up columns interleaved in blocks of `chunk(Fe)` (64): gate block
0, up block 0, gate block 1, ... A split over "model" into whole block pairs keeps each gate beside its up, and
each device's share stays a whole number of 128-lane tiles where Fe / devices is a multiple of 64 (Qwen3-30B-A3B's
768 over 4 devices: 384 columns). XLA's TPU grouped matmul needs its weight's output columns minor; a share
of separate gate columns (192) is laid out the other way by default, and XLA then copied every expert's gate
and up weights once per program: 15.6 GB of temporaries per device at that shape.

Every token's output is exactly the weighted sum of its own `top_k` experts: nothing is padded to a capacity
and no token is ever dropped (a dropped token would change the target's distribution, and speculation would no
longer be lossless). Routing is per token, so a row's output does not depend on what else is in the batch.
Two ways compute it, chosen for the platform the program is lowered for (`jax.lax.platform_dependent`):
- on TPUs, `grouped`: the (token, expert) pairs sorted by expert, each expert's rows through one
  `jax.lax.ragged_dot`, which XLA's TPU compiler runs as a grouped matmul;
- elsewhere, `every_expert`: every token through every expert, the unchosen ones weighted zero. XLA for GPUs
  and CPUs expands `ragged_dot` into a matmul of every (token, expert) pair against every expert (E times the
  work); this is k times less, and a decode step or a verify, memory-bound, reads every expert either way.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model.config import MoeConfig

Params = dict
CHUNK = 64
TOKENS_AT_ONCE = 512  # `every_expert`'s piece: at Qwen3-30B-A3B's shape, an H100 computes it in about the time
# it reads the experts


def chunk(expert_dim: int) -> int:
  """The columns of gate (then of up) that `we_gate_up` keeps together: 64, or all of them when 64 does not
  divide the expert's width."""
  return CHUNK if expert_dim % CHUNK == 0 else expert_dim


def interleave(gate_OxDxFe: jax.Array, up_OxDxFe: jax.Array) -> jax.Array:
  """`we_gate_up [O,D,2Fe]` from the gate and up weights (any array library's arrays)."""
  o, d, fe = gate_OxDxFe.shape
  c = chunk(fe)
  xp = np if isinstance(gate_OxDxFe, np.ndarray) else jnp  # numpy as a checkpoint is read
  both = xp.stack([gate_OxDxFe.reshape(o, d, fe // c, c), up_OxDxFe.reshape(o, d, fe // c, c)], axis=3)
  return both.reshape(o, d, 2 * fe)


def gate_and_up(gate_up_XxF2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The gate and up parts of `we_gate_up` (or of its output rows), each [..., Fe]."""
  fe = gate_up_XxF2.shape[-1] // 2
  c = chunk(fe)
  both = gate_up_XxF2.reshape(*gate_up_XxF2.shape[:-1], fe // c, 2, c)
  return both[..., 0, :].reshape(*gate_up_XxF2.shape[:-1], fe), both[..., 1, :].reshape(*gate_up_XxF2.shape[:-1], fe)


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
      by_group = choice_TxO.reshape(choice_TxO.shape[0], moe.groups, -1)
      group_scores = jax.lax.top_k(by_group, 2)[0].sum(-1)
      kept = jax.lax.top_k(group_scores, moe.top_groups)[1]
      in_kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(len(kept))[:, None], kept].set(True)
      choice_TxO = jnp.where(in_kept[:, :, None], by_group, -jnp.inf).reshape(choice_TxO.shape)
  experts_TxOk = jax.lax.top_k(choice_TxO, moe.top_k)[1]
  weights_TxOk = jnp.take_along_axis(scores_TxO, experts_TxOk, axis=-1)
  if moe.normalize:
    weights_TxOk = weights_TxOk / (weights_TxOk.sum(-1, keepdims=True) + 1e-20)
  return weights_TxOk * moe.scale, experts_TxOk


def experts(h_BxSxD: jax.Array, layer: Params, moe: MoeConfig, activation: Callable) -> jax.Array:
  """The routed experts' weighted sum for every token, [B,S,D] in `h`'s dtype (shared experts not included)."""
  h_TxD = h_BxSxD.reshape(-1, h_BxSxD.shape[-1])
  weights_TxOk, experts_TxOk = route(h_TxD, layer, moe)
  weights = {name: layer[name] for name in ("we_gate_up", "we_down")}
  out = jax.lax.platform_dependent(h_TxD, weights_TxOk, experts_TxOk, weights,
                                   tpu=functools.partial(grouped, activation=activation),
                                   default=functools.partial(every_expert, activation=activation))
  return out.reshape(h_BxSxD.shape)


def grouped(h_TxD: jax.Array, weights_TxOk: jax.Array, experts_TxOk: jax.Array, layer: Params,
            activation: Callable) -> jax.Array:
  """The (token, expert) pairs sorted by expert, each expert's rows in one group of a `ragged_dot`."""
  top_k, experts = experts_TxOk.shape[1], layer["we_down"].shape[0]
  order = jnp.argsort(experts_TxOk.reshape(-1), stable=True)
  token = order // top_k
  sizes_O = jnp.bincount(experts_TxOk.reshape(-1), length=experts).astype(jnp.int32)
  gate, up = gate_and_up(jax.lax.ragged_dot(h_TxD[token], layer["we_gate_up"], sizes_O))
  y = jax.lax.ragged_dot(activation(gate) * up, layer["we_down"], sizes_O)
  y = y * weights_TxOk.reshape(-1)[order][:, None].astype(y.dtype)
  return jnp.zeros_like(h_TxD).at[token].add(y)


def every_expert(h_TxD: jax.Array, weights_TxOk: jax.Array, experts_TxOk: jax.Array, layer: Params,
                 activation: Callable) -> jax.Array:
  """`_every_expert`, over at most `TOKENS_AT_ONCE` tokens at a time: a prefill's hidden rows for every
  expert would otherwise take E times a dense MLP's memory (8 rows of 2,048 tokens through Qwen3-30B-A3B's 128
  experts: 6.4 GB a layer). A decode step or a verify runs in one piece."""
  tokens = h_TxD.shape[0]
  if tokens <= TOKENS_AT_ONCE:
    return _every_expert(h_TxD, weights_TxOk, experts_TxOk, layer, activation)
  pieces = -(-tokens // TOKENS_AT_ONCE)
  split = lambda x: jnp.pad(x, [(0, pieces * TOKENS_AT_ONCE - tokens)] + [(0, 0)] * (x.ndim - 1)).reshape(
      pieces, TOKENS_AT_ONCE, *x.shape[1:])  # padded tokens weigh zero
  out = jax.lax.map(lambda piece: _every_expert(*piece, layer, activation),
                    (split(h_TxD), split(weights_TxOk), split(experts_TxOk)))
  return out.reshape(-1, h_TxD.shape[-1])[:tokens]


def _every_expert(h_TxD: jax.Array, weights_TxOk: jax.Array, experts_TxOk: jax.Array, layer: Params,
                  activation: Callable) -> jax.Array:
  """Every token through every expert; the chosen experts' hidden rows scaled by their weights and the others'
  zeroed before `we_down`, so one contraction over experts and columns sums them. Expert-major activations
  ([O,T,...]) let the matmuls read the stacked weights as they lie (token-major ones made XLA's GPU compiler
  copy them)."""
  gate, up = gate_and_up(jnp.einsum("td,odf->otf", h_TxD, layer["we_gate_up"]))
  rows = jnp.arange(h_TxD.shape[0])[:, None]
  weights_OxT = jnp.zeros((h_TxD.shape[0], layer["we_down"].shape[0]), jnp.float32).at[rows, experts_TxOk].set(
      weights_TxOk).T[..., None]
  hidden = jnp.where(weights_OxT > 0, activation(gate) * up * weights_OxT.astype(gate.dtype), 0)
  return jnp.einsum("otf,ofd->td", hidden, layer["we_down"]).astype(h_TxD.dtype)
