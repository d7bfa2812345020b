"""The Llama-family transformer as pure functions of a parameter pytree, and `Model`, a loaded one.

Parameters are a plain dict: `embed [V,D]`, `final_norm [D]`, optional `lm_head [D,V]`, and `layers`, a list
of N dicts (`attn_norm, wq [D,H*Dh], wk, wv [D,J*Dh], (bq, bk, bv), wo [H*Dh,D], mlp_norm, w_gate, w_up
[D,F], w_down [F,D]`; those seven may be quantized: `jspec.model.quantization`; a mixture-of-experts layer's
MLP: `jspec.model.moe`). A list rather than
stacked arrays keeps each layer's weights and cache their own buffers inside the decode loop. (Shape
letters: the legend in `jspec/__init__.py`.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jspec.core.settings import CostModel
from jspec.model import attention, moe, quantization, rope
from jspec.model import cache as kvcache
from jspec.model.config import ModelConfig

if TYPE_CHECKING:
  from tokenizers import Tokenizer

  from jspec.text.tokenizer import ChatTemplate

Params = dict


@dataclasses.dataclass(frozen=True)
class Model:
  """A model's shape, its weights, its tokenizer and chat template, and the cost models measured with it as
  a drafter (by drafter kind; a target's own checkpoint holds n-gram's, the drafter that reads only the
  context)."""
  config: ModelConfig
  params: Params
  tokenizer: Tokenizer
  cost_models: dict[str, CostModel] = dataclasses.field(default_factory=dict)
  chat_template: ChatTemplate | None = None


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (scaled normal), for tests and for training from scratch; the linear layers in
  `config.quantization` when it names a format."""
  d, h, j, dh, f, v = (config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.mlp_dim,
                       config.vocab_size)
  dtype = config.jnp_dtype
  keys = iter(jax.random.split(key, 16 * config.n_layers + 2))
  dense = lambda shape, fan_in: (jax.random.normal(next(keys), shape) * fan_in ** -0.5).astype(dtype)
  # A norm's weight is 1 either way it is stored: w, or 1 + w.
  norm = lambda size: jnp.full((size,), 0.0 if config.norm_plus_one else 1.0, dtype)
  mlp = lambda width: dict(w_gate=dense((d, width), d), w_up=dense((d, width), d),
                           w_down=dense((width, d), width) / (2 * config.n_layers) ** 0.5)
  layers = []
  for i in range(config.n_layers):
    layer = dict(attn_norm=norm(d), wq=dense((d, h * dh), d), wk=dense((d, j * dh), d),
                 wv=dense((d, j * dh), d), wo=dense((h * dh, d), h * dh) / (2 * config.n_layers) ** 0.5,
                 mlp_norm=norm(d))
    e = config.moe
    if e is None or not e.sparse(i):
      layer.update(mlp(f))
    else:
      o, fe = e.experts, e.expert_dim
      layer.update(router=dense((d, o), d), we_gate_up=dense((o, d, 2 * fe), d),
                   we_down=dense((o, fe, d), fe) / (2 * config.n_layers) ** 0.5)
      if e.shared_dim:
        layer.update(mlp(e.shared_dim))
      if e.routing == "sigmoid":
        layer["router_bias"] = dense((o,), 1) * 0.1
    if config.qkv_bias:
      layer.update(bq=dense((h * dh,), 1) * 0.1, bk=dense((j * dh,), 1) * 0.1, bv=dense((j * dh,), 1) * 0.1)
    if config.qk_norm:
      layer.update(q_norm=norm(dh), k_norm=norm(dh))
    if config.sandwich_norms:
      layer.update(post_attn_norm=norm(d), post_mlp_norm=norm(d))
    layers.append(layer)
  params = dict(embed=dense((v, d), d), layers=layers, final_norm=norm(d))
  if not config.tie_embeddings:
    params["lm_head"] = dense((d, v), d)
  return quantization.quantize_params(params, config.quantization)


def rms_norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
  """RMSNorm over the last axis, in fp32; the weight scales by w, or by 1 + w (`norm_plus_one`)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + config.norm_eps)
  return (x32 * (weight.astype(jnp.float32) + config.norm_plus_one)).astype(x.dtype)


def _softcap(x: jax.Array, cap: float | None) -> jax.Array:
  return x if cap is None else cap * jnp.tanh(x / cap)


def logits_from_hidden(params: Params, hidden_BxSxD: jax.Array, config: ModelConfig) -> jax.Array:
  """The LM head (tied or not), in fp32, soft-capped when the config says so."""
  head_DxV = params["lm_head"] if "lm_head" in params else params["embed"].T
  return _softcap(jnp.einsum("bsd,dv->bsv", hidden_BxSxD, head_DxV, preferred_element_type=jnp.float32),
                  config.final_softcap)


def with_head(params: Params) -> Params:
  """`params` with an explicit `lm_head [D,V]`. A tied head read as `embed.T` inside the decode loop makes
  every multi-token LM head a transposed matmul, much slower on XLA:CPU (docs/cpu-performance.md);
  `jspec.decoding.decoder.make_decoder` calls this once per decoder, which keeps one copy of the embedding."""
  return params if "lm_head" in params else {**params, "lm_head": params["embed"].T}


def embed(params: Params, tokens_BxS: jax.Array, config: ModelConfig) -> jax.Array:
  x_BxSxD = params["embed"][tokens_BxS]
  return x_BxSxD * jnp.asarray(config.dim ** 0.5, x_BxSxD.dtype) if config.scale_embeddings else x_BxSxD


def attention_options(config: ModelConfig, layer: int) -> dict:
  """What `jspec.model.attention` needs to know of a layer: its window, soft-cap and logit scale."""
  return dict(window=config.window(layer), softcap=config.attn_softcap,
              scale=None if config.query_scale is None else config.query_scale ** -0.5)


def _rope(config: ModelConfig, layer: int, x_BxSxHxDh: jax.Array, positions_BxS: jax.Array,
          rope_len_B: jax.Array | None) -> jax.Array:
  if config.window(layer) and config.local_rope_theta is not None:  # local layers: their own base, unscaled
    return rope.apply(x_BxSxHxDh, positions_BxS, config.local_rope_theta, config.rotary_dim, None, None)
  return rope.apply(x_BxSxHxDh, positions_BxS, config.rope_theta, config.rotary_dim, config.rope_scaling,
                    rope_len_B)


# attend(layer_index, q, k, v) -> attention output [B,S,H,Dh]; it may update a cache on the side.
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def _activation(config: ModelConfig) -> Callable[[jax.Array], jax.Array]:
  return jax.nn.silu if config.activation == "silu" else lambda x: jax.nn.gelu(x, approximate=True)


def _mlp(layer: Params, h_BxSxD: jax.Array, config: ModelConfig) -> jax.Array:
  """The layer's MLP: dense, or routed experts plus any shared ones."""
  out = moe.experts(h_BxSxD, layer, config.moe, _activation(config)) if "router" in layer else None
  if "w_gate" not in layer:
    return out
  linear = quantization.linear
  dense = linear(_activation(config)(linear(h_BxSxD, layer["w_gate"])) * linear(h_BxSxD, layer["w_up"]),
                 layer["w_down"])
  return dense if out is None else out + dense


def _project(layer: Params, i: int, name: str, h_BxSxA: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
             rope_len_B: jax.Array | None) -> jax.Array:
  """Layer i's queries ("q"), keys ("k", both normed and rotated where the config says) or values ("v") of
  its inputs, [B,S,heads,Dh]."""
  x = quantization.linear(h_BxSxA, layer[f"w{name}"])
  if config.qkv_bias:
    x = x + layer[f"b{name}"]
  x = x.reshape(*x.shape[:2], config.n_heads if name == "q" else config.n_kv_heads, config.head_dim)
  if name == "v":
    return x
  if config.qk_norm:
    x = rms_norm(x, layer[f"{name}_norm"], config)
  return _rope(config, i, x, positions_BxS, rope_len_B)


def keys_values(layer: Params, i: int, h_BxSxA: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
                rope_len_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Layer i's keys and values of its inputs, [B,S,J,Dh] each, as its attention writes them into a cache."""
  return (_project(layer, i, "k", h_BxSxA, positions_BxS, config, rope_len_B),
          _project(layer, i, "v", h_BxSxA, positions_BxS, config, rope_len_B))


def layer_stack(params: Params, x_BxSxD: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
                attend: AttendFn, rope_len_B: jax.Array | None = None, outputs: list | None = None,
                first_input_BxSxA: jax.Array | None = None) -> jax.Array:
  """The decoder layers `params["layers"]` over input vectors; returns the residual stream [B,S,D].

  `rope_len_B`: each row's final length, which only dynamic-NTK RoPE reads (default: the positions given).
  `outputs`, when given, receives the residual stream after each layer. A layer without `attn_norm` attends
  from the residual stream itself (EAGLE's first layer); `first_input_BxSxA`, when given, is what the first
  layer's q/k/v read instead (EAGLE-3's normed embedding and feature side by side, A = 2D).
  """
  batch, seq, _ = x_BxSxD.shape
  for i, layer in enumerate(params["layers"]):
    h = rms_norm(x_BxSxD, layer["attn_norm"], config) if "attn_norm" in layer else x_BxSxD
    if i == 0 and first_input_BxSxA is not None:
      h = first_input_BxSxA
    q = _project(layer, i, "q", h, positions_BxS, config, rope_len_B)
    k, v = keys_values(layer, i, h, positions_BxS, config, rope_len_B)
    out = quantization.linear(attend(i, q, k, v).reshape(batch, seq, -1), layer["wo"])
    if config.sandwich_norms:
      out = rms_norm(out, layer["post_attn_norm"], config)
    x_BxSxD = x_BxSxD + out
    out = _mlp(layer, rms_norm(x_BxSxD, layer["mlp_norm"], config), config)
    if config.sandwich_norms:
      out = rms_norm(out, layer["post_mlp_norm"], config)
    x_BxSxD = x_BxSxD + out
    if outputs is not None:
      outputs.append(x_BxSxD)
  return x_BxSxD


def full_attention(config: ModelConfig) -> AttendFn:
  """Attention over the whole sequence given (no cache), with each layer's options."""
  return lambda i, q, k, v: attention.causal_attention(q, k, v, **attention_options(config, i))


def trunk(params: Params, tokens_BxS: jax.Array, positions_BxS: jax.Array, config: ModelConfig,
          attend: AttendFn) -> jax.Array:
  """Embedding and decoder layers; returns the final-normed hidden state [B,S,D]."""
  x_BxSxD = layer_stack(params, embed(params, tokens_BxS, config), positions_BxS, config, attend)
  return rms_norm(x_BxSxD, params["final_norm"], config)


def features(hidden_BxSxD: jax.Array, outputs: list, feature_layers: tuple[int, ...]) -> jax.Array:
  """What a forward hands a drafter: the final-normed hidden state, or with `feature_layers` the residual
  streams after those layers side by side, [B,S,len(feature_layers)*D] (EAGLE-3's low, middle and high)."""
  return jnp.concatenate([outputs[i] for i in feature_layers], -1) if feature_layers else hidden_BxSxD


def forward(params: Params, tokens_BxS: jax.Array, positions_BxS: jax.Array, cache: kvcache.KVCache,
            config: ModelConfig, tree_BxSxA: jax.Array | None = None,
            feature_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, kvcache.KVCache]:
  """One forward over S new tokens per row, written into the cache at each row's length.

  The same code serves prefill (S = padded prompt), one-token decode and verification (S = K+1, or a
  draft tree's entries with their ancestor mask `tree_BxSxA` and positions base + depth; `jspec.speculation.tree`).
  Returns `(logits [B,S,V] fp32, hidden [B,S,D], cache)` with `cache.lengths` advanced by S; `hidden` is
  as `features` makes it.
  """
  outputs = []
  x_BxSxD, cache = cached_layer_stack(params, embed(params, tokens_BxS, config), positions_BxS, cache, config,
                                      tree_BxSxA, outputs)
  hidden = rms_norm(x_BxSxD, params["final_norm"], config)
  return logits_from_hidden(params, hidden, config), features(hidden, outputs, feature_layers), cache


def cached_layer_stack(params: Params, x_BxSxD: jax.Array, positions_BxS: jax.Array, cache: kvcache.KVCache,
                       config: ModelConfig, tree_BxSxA: jax.Array | None = None, outputs: list | None = None,
                       first_input_BxSxA: jax.Array | None = None) -> tuple[jax.Array, kvcache.KVCache]:
  """`layer_stack` over S new input vectors per row, written into the cache at each row's length."""
  ks, vs = list(cache.k), list(cache.v)

  def attend(i, q, k, v):
    ks[i] = kvcache.write(cache, ks[i], k)
    vs[i] = kvcache.write(cache, vs[i], v)
    return attention.cached_attention(q, ks[i], vs[i], cache.lengths, cache.heads_major, tree_BxSxA=tree_BxSxA,
                                      kernel=cache.kernel, page_table_BxR=cache.page_table,
                                      page_shards=cache.page_shards, rows_sharding=cache.rows_sharding,
                                      **attention_options(config, i))

  x_BxSxD = layer_stack(params, x_BxSxD, positions_BxS, config, attend, cache.rope_len, outputs, first_input_BxSxA)
  return x_BxSxD, cache.replace(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + x_BxSxD.shape[1])


def forward_full(params: Params, tokens_BxS: jax.Array, config: ModelConfig,
                 feature_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
  """A full causal forward with no cache, positions 0..S-1 (the reference for tests): logits and `features`."""
  positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
  outputs = []
  x_BxSxD = layer_stack(params, embed(params, tokens_BxS, config), positions, config, full_attention(config),
                        outputs=outputs)
  hidden = rms_norm(x_BxSxD, params["final_norm"], config)
  return logits_from_hidden(params, hidden, config), features(hidden, outputs, feature_layers)


def prefill(params: Params, config: ModelConfig, cache: kvcache.KVCache, prompts_BxP: jax.Array,
            prompt_lens_B: jax.Array, feature_layers: tuple[int, ...] = (), start_B: jax.Array | None = None,
            width: int | None = None) -> tuple[jax.Array, kvcache.KVCache]:
  """Runs right-padded prompts through the model, batched; the cache then holds each row's `prompt_lens`
  tokens. With `start_B`, the cache already holds each row's first `start` tokens (a cached prefix) and
  only the `width` (static) from there run. Returns the features of the tokens run [B,W,D'] (head drafters
  read them) and the cache."""
  batch, prompt_width = prompts_BxP.shape
  start_B = jnp.zeros((batch,), jnp.int32) if start_B is None else start_B
  positions = start_B[:, None] + jnp.arange(width or prompt_width)
  tokens = jnp.take_along_axis(prompts_BxP, jnp.minimum(positions, prompt_width - 1), axis=1)
  _, hidden, cache = forward(params, tokens, positions, cache.rewind(start_B), config, feature_layers=feature_layers)
  return hidden, cache.rewind(prompt_lens_B)
