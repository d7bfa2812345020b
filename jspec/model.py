"""The Llama-family transformer as pure functions of a parameter pytree, and `Model`, a loaded one.

Parameters are a plain dict: `embed [V,D]`, `final_norm [D]`, optional `lm_head [D,V]`, and `layers`, a list
of N dicts (`attn_norm, wq [D,H*Dh], wk, wv [D,J*Dh], (bq, bk, bv), wo [H*Dh,D], mlp_norm, w_gate, w_up
[D,F], w_down [F,D]`). A list rather than stacked arrays keeps each layer's weights and cache their own
buffers inside the decode loop. (Shape letters: the legend in `jspec/__init__.py`.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jspec import attention
from jspec import cache as kvcache
from jspec.config import ModelConfig
from jspec.settings import CostModel

if TYPE_CHECKING:
  from tokenizers import Tokenizer

Params = dict


@dataclasses.dataclass(frozen=True)
class Model:
  """A model's shape, its weights, its tokenizer, and the cost models measured with it as a drafter (by
  drafter kind; a target's own checkpoint holds n-gram's, the drafter that reads only the context)."""
  config: ModelConfig
  params: Params
  tokenizer: Tokenizer
  cost_models: dict[str, CostModel] = dataclasses.field(default_factory=dict)


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (scaled normal), for tests and for training from scratch."""
  d, h, j, dh, f, v = (config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.mlp_dim,
                       config.vocab_size)
  dtype = config.jnp_dtype
  keys = iter(jax.random.split(key, 12 * config.n_layers + 2))
  dense = lambda shape, fan_in: (jax.random.normal(next(keys), shape) * fan_in ** -0.5).astype(dtype)
  layers = []
  for _ in range(config.n_layers):
    layer = dict(attn_norm=jnp.ones((d,), dtype), wq=dense((d, h * dh), d), wk=dense((d, j * dh), d),
                 wv=dense((d, j * dh), d), wo=dense((h * dh, d), h * dh) / (2 * config.n_layers) ** 0.5,
                 mlp_norm=jnp.ones((d,), dtype), w_gate=dense((d, f), d), w_up=dense((d, f), d),
                 w_down=dense((f, d), f) / (2 * config.n_layers) ** 0.5)
    if config.qkv_bias:
      layer.update(bq=dense((h * dh,), 1) * 0.1, bk=dense((j * dh,), 1) * 0.1, bv=dense((j * dh,), 1) * 0.1)
    layers.append(layer)
  params = dict(embed=dense((v, d), d), layers=layers, final_norm=jnp.ones((d,), dtype))
  if not config.tie_embeddings:
    params["lm_head"] = dense((d, v), d)
  return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x_BxSxHxDh: jax.Array, positions_BxS: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the rotate-half layout that Hugging Face checkpoints use."""
  half = x_BxSxHxDh.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = (positions_BxS[..., None].astype(jnp.float32) * freqs)[:, :, None, :]  # [B, S, 1, Dh/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x_BxSxHxDh.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxSxHxDh.dtype)


def logits_from_hidden(params: Params, hidden_BxSxD: jax.Array) -> jax.Array:
  """The LM head (tied or not), in fp32."""
  head_DxV = params["lm_head"] if "lm_head" in params else params["embed"].T
  return jnp.einsum("bsd,dv->bsv", hidden_BxSxD, head_DxV, preferred_element_type=jnp.float32)


def with_head(params: Params) -> Params:
  """`params` with an explicit `lm_head [D,V]`. A tied head read as `embed.T` inside the decode loop makes
  every multi-token LM head a transposed matmul, about 2x slower on XLA:CPU; the decode loops call this
  once, outside their while loop, which costs one copy of the embedding per request."""
  return params if "lm_head" in params else {**params, "lm_head": params["embed"].T}


# attend(layer_index, q, k_new, v_new) -> attention output [B,S,H,Dh]; it may update a cache on the side.
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def decoder(params: Params, x_BxSxD: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
            attend: AttendFn) -> jax.Array:
  """The decoder layers `params["layers"]` over input vectors; returns the residual stream [B,S,D]."""
  batch, seq, _ = x_BxSxD.shape
  for i, layer in enumerate(params["layers"]):
    h = rms_norm(x_BxSxD, layer["attn_norm"], config.norm_eps)
    q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    if config.qkv_bias:
      q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = rope(q.reshape(batch, seq, config.n_heads, config.head_dim), positions_BxS, config.rope_theta)
    k = rope(k.reshape(batch, seq, config.n_kv_heads, config.head_dim), positions_BxS, config.rope_theta)
    v = v.reshape(batch, seq, config.n_kv_heads, config.head_dim)
    out_BxSxHxDh = attend(i, q, k, v)
    x_BxSxD = x_BxSxD + out_BxSxHxDh.reshape(batch, seq, -1) @ layer["wo"]
    h = rms_norm(x_BxSxD, layer["mlp_norm"], config.norm_eps)
    x_BxSxD = x_BxSxD + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
  return x_BxSxD


def trunk(params: Params, tokens_BxS: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
          attend: AttendFn) -> jax.Array:
  """Embedding and decoder layers; returns the final-normed hidden state [B,S,D]."""
  x_BxSxD = decoder(params, params["embed"][tokens_BxS], positions_BxS, config, attend)
  return rms_norm(x_BxSxD, params["final_norm"], config.norm_eps)


def forward(params: Params, tokens_BxS: jax.Array, positions_BxS: jax.Array, cache: kvcache.KVCache,
            config: ModelConfig) -> tuple[jax.Array, jax.Array, kvcache.KVCache]:
  """One forward over S new tokens per row, written into the cache at each row's length.

  The same code serves prefill (S = padded prompt), one-token decode and verification (S = K+1).
  Returns `(logits [B,S,V] fp32, hidden [B,S,D], cache)` with `cache.lengths` advanced by S.
  """
  x_BxSxD, cache = cached_decoder(params, params["embed"][tokens_BxS], positions_BxS, cache, config)
  hidden = rms_norm(x_BxSxD, params["final_norm"], config.norm_eps)
  return logits_from_hidden(params, hidden), hidden, cache


def cached_decoder(params: Params, x_BxSxD: jax.Array, positions_BxS: jax.Array, cache: kvcache.KVCache,
                   config: ModelConfig) -> tuple[jax.Array, kvcache.KVCache]:
  """`decoder` over S new input vectors per row, written into the cache at each row's length."""
  ks, vs = list(cache.k), list(cache.v)

  def attend(i, q, k, v):
    ks[i] = kvcache.write(cache, ks[i], k)
    vs[i] = kvcache.write(cache, vs[i], v)
    return attention.cached_attention(q, ks[i], vs[i], cache.lengths, cache.heads_major)

  x_BxSxD = decoder(params, x_BxSxD, positions_BxS, config, attend)
  return x_BxSxD, cache.replace(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + x_BxSxD.shape[1])


def forward_full(params: Params, tokens_BxS: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """A full causal forward with no cache, positions 0..S-1: the reference for tests."""
  positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
  hidden = trunk(params, tokens_BxS, positions, config,
                  lambda i, q, k, v: attention.causal_attention(q, k, v))
  return logits_from_hidden(params, hidden), hidden


def prefill(params: Params, config: ModelConfig, cache: kvcache.KVCache, prompts_BxP: jax.Array,
            prompt_lens_B: jax.Array) -> tuple[jax.Array, kvcache.KVCache]:
  """Runs right-padded prompts through the model from an empty cache, batched; the cache then holds each
  row's `prompt_lens` tokens. Returns the hidden states [B,P,D] (head drafters read them) and the cache."""
  batch, width = prompts_BxP.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  _, hidden, cache = forward(params, prompts_BxP, positions, cache.rewind(jnp.zeros_like(cache.lengths)),
                             config)
  return hidden, cache.rewind(prompt_lens_B)
