"""Hugging Face model directories, read without torch: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, and the
mixtures of experts qwen3_moe, mixtral and glm4_moe (their experts stacked, [O,D,Fe] and [O,Fe,D]).

Reads `config.json` (transformers 4's `rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`),
`generation_config.json` (more stop tokens), the safetensors files tensor by tensor with the `safetensors`
package, `tokenizer.json`, and the chat template. Each family becomes one `ModelConfig`: its differences are
fields, not code. HF checkpoints store q/k projections in the rotate-half RoPE layout that `jspec.model.rope`
uses, so weights map over with a transpose and no permutation.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can read it)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jspec.core.tensor_files import FLOAT8, read_float8
from jspec.model import model, quantization, sharding
from jspec.model.config import ModelConfig
from jspec.model.hf_config import ATTENTION_NAMES, BIAS_NAMES, MLP_NAMES, MOE_NAMES, config_from_hf
from jspec.model.model import Model
from jspec.model.moe import interleave
from jspec.text.tokenizer import load_chat_template, load_tokenizer


def is_hf_dir(path: pathlib.Path) -> bool:
  try:
    return "model_type" in json.loads((pathlib.Path(path) / "config.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False


class _Tensors:
  """The tensors of a checkpoint's safetensors files, read one at a time (memory-mapped), by name."""

  def __init__(self, path: pathlib.Path):
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    self.path, self.where, self.handles = path, {}, {}  # each file opened (memory-mapped) once
    for f in files:
      if not (path / f).is_file():
        raise ValueError(f"{path}: missing weights file {f}")
      try:
        self.handles[path / f] = handle = safe_open(path / f, framework="numpy")
        self.where.update({name: path / f for name in handle.keys()})
      except SafetensorError as e:
        raise ValueError(f"{path / f}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    # The language model's tensors sit under a prefix: "model.", "language_model.model.", ...
    self.prefix = next((n[:-len("embed_tokens.weight")] for n in self.where if n.endswith("embed_tokens.weight")),
                       "model.")
    self.head = next((n for n in self.where if n.endswith("lm_head.weight")), None)

  def get(self, name: str, dtype=None) -> np.ndarray:
    """A tensor, cast to `dtype` (None: as stored)."""
    if name not in self.where:
      raise ValueError(f"{self.path}: tensor {name} is missing from the safetensors files")
    handle = self.handles[self.where[name]]
    if handle.get_slice(name).get_dtype() in FLOAT8:
      x = read_float8(self.where[name], name)
    else:
      x = handle.get_tensor(name)
    return x if dtype is None else x.astype(dtype, copy=False)

  def take(self, name: str, dtype, transpose: bool = False) -> np.ndarray:
    x = self.get(name, dtype)
    return x.T if transpose else x  # HF stores matrices as [out, in]; jspec as [in, out]

  def linear(self, module: str, dtype, fmt: str | None) -> np.ndarray | quantization.QArray:
    """A linear layer's weight as jspec holds it, [in, out]: stored quantized (a `weight_scale`, or a
    block-wise `weight_scale_inv`, beside it) as it is, or read in `dtype` and quantized to `fmt` if given."""
    for scale in (f"{module}.weight_scale", f"{module}.weight_scale_inv"):
      if scale in self.where:
        values_IxO, scale = self.get(f"{module}.weight").T, self.get(scale, np.float32)
        if scale.size not in (1, values_IxO.shape[1]):  # per block: [O/128, I/128] as stored
          scale = scale.T
        return quantization.from_stored(jnp.asarray(values_IxO), scale)
    w_IxO = self.get(f"{module}.weight", dtype).T
    return w_IxO if fmt is None else quantization.quantize(jnp.asarray(w_IxO), fmt)


def _layer_names(config: ModelConfig) -> dict[str, str]:
  """jspec's name -> HF's for every per-layer weight but the fused ones of phi3."""
  names = {"attn_norm": "input_layernorm"}
  if config.sandwich_norms:  # Gemma: "post_attention" is the attention output's norm, not the MLP's input
    names.update(post_attn_norm="post_attention_layernorm", mlp_norm="pre_feedforward_layernorm",
                 post_mlp_norm="post_feedforward_layernorm")
  else:
    names["mlp_norm"] = "post_attention_layernorm"
  if config.qk_norm:
    names.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
  return names


def load_hf(path: str | pathlib.Path, dtype: str = "float32", mesh=None, quantize: str | None = None) -> Model:
  """A Hugging Face model directory as a `Model`. Each tensor is read, cast to `dtype` (quantized weights stay
  as stored; float linear layers are quantized to `quantize` if given) and, with a `mesh`, placed in its
  shards before the next is read: no second host copy of the model."""
  path = pathlib.Path(path).absolute()
  hf = json.loads((path / "config.json").read_text())
  generation = path / "generation_config.json"
  config = config_from_hf(hf, dtype, json.loads(generation.read_text()) if generation.is_file() else None)
  if quantize is not None and config.quantization not in (None, quantize):
    raise ValueError(f"{path}: its weights are stored in {config.quantization}; it loads as it is, not as {quantize}")
  config = dataclasses.replace(config, quantization=quantize or config.quantization)
  tokenizer = load_tokenizer(path)
  tensors = _Tensors(path)
  np_dtype = np.dtype(config.jnp_dtype)
  specs = None
  if mesh is not None:
    abstract = jax.eval_shape(lambda: model.init_params(config, jax.random.PRNGKey(0)))
    specs = sharding.param_specs(abstract, config, mesh)

  def place(x: np.ndarray, spec_path: tuple) -> jax.Array:
    if specs is None:
      return jax.tree.map(jnp.asarray, x)
    spec = specs
    for key in spec_path:
      spec = spec[key]
    if quantization.is_qarray(spec) and not quantization.is_qarray(x):
      spec = spec.qvalue  # a layer the checkpoint keeps in float among quantized ones
    return sharding.place(x, mesh, spec)

  take = lambda name, transpose: tensors.take(name, np_dtype, transpose)
  layers = []
  for i in range(config.n_layers):
    layer = _read_layer(tensors, i, config, hf["model_type"], np_dtype, quantize)
    layers.append({name: place(x, ("layers", i, name)) for name, x in layer.items()})
  params: dict[str, Any] = dict(
      embed=place(take(f"{tensors.prefix}embed_tokens.weight", False), ("embed",)), layers=layers,
      final_norm=place(take(f"{tensors.prefix}norm.weight", False), ("final_norm",)))
  if not config.tie_embeddings:
    params["lm_head"] = place(take(tensors.head or "lm_head.weight", True), ("lm_head",))
  return Model(config=config, params=params, tokenizer=tokenizer, chat_template=load_chat_template(path))


def _read_layer(tensors: _Tensors, i: int, config: ModelConfig, family: str, np_dtype, quantize: str | None) -> dict:
  """Decoder layer `i`'s weights as jspec names them (linear layers as `_Tensors.linear` reads them)."""
  pre = f"{tensors.prefix}layers.{i}."
  take = lambda name, transpose: tensors.take(name, np_dtype, transpose)
  layer = {ours: take(f"{pre}{theirs}.weight", False) for ours, theirs in _layer_names(config).items()}
  linear = lambda module: tensors.linear(pre + module, np_dtype, quantize)
  q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  if f"{pre}self_attn.qkv_proj.weight" in tensors.where:  # phi3: q | k | v rows, gate | up rows
    qkv, gate_up, cols = linear("self_attn.qkv_proj"), linear("mlp.gate_up_proj"), quantization.columns
    layer.update(wq=cols(qkv, 0, q), wk=cols(qkv, q, q + kv), wv=cols(qkv, q + kv, q + 2 * kv),
                 wo=linear("self_attn.o_proj"), w_gate=cols(gate_up, 0, config.mlp_dim),
                 w_up=cols(gate_up, config.mlp_dim, 2 * config.mlp_dim), w_down=linear("mlp.down_proj"))
  else:
    layer.update({ours: linear(theirs) for ours, theirs in ATTENTION_NAMES.items()})
    if config.moe is None or not config.moe.sparse(i):
      layer.update({ours: linear(theirs) for ours, theirs in MLP_NAMES.items()})
    else:
      layer.update(_experts(tensors, pre, config, family, take))
  if config.qkv_bias:
    layer.update({ours: take(f"{pre}{theirs}.bias", False) for ours, theirs in BIAS_NAMES.items()})
  return layer


def load_mtp_layer(path: str | pathlib.Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
  """The first multi-token-prediction layer a checkpoint ships (`num_nextn_predict_layers` of them, stored as
  decoder layers after the last: GLM-4.5's and DeepSeek-V3's layout). Returns its config (the model's, with one
  layer, sparse where that layer is) and its weights: the decoder layer, `enorm` and `hnorm` (the norms of the
  next token's embedding and of the hidden state), `eh_proj [2D,D]` over the two, `final_norm`
  (`shared_head.norm`), and `embed` / `lm_head` where its copies differ from the model's."""
  path = pathlib.Path(path).absolute()
  hf = json.loads((path / "config.json").read_text())
  config = config_from_hf(hf, dtype)
  if not hf.get("num_nextn_predict_layers"):
    raise ValueError(f"{path}: no MTP layers (num_nextn_predict_layers is {hf.get('num_nextn_predict_layers', 0)});"
                     f" train some: python -m jspec.train drafter --kind mtp")
  n, tensors, np_dtype = config.n_layers, _Tensors(path), np.dtype(config.jnp_dtype)
  pre = f"{tensors.prefix}layers.{n}."
  take = lambda name, transpose=False: tensors.take(name, np_dtype, transpose)
  params = dict(layers=[_read_layer(tensors, n, config, hf["model_type"], np_dtype, None)],
                enorm=take(pre + "enorm.weight"), hnorm=take(pre + "hnorm.weight"),
                eh_proj=take(pre + "eh_proj.weight", True), final_norm=take(pre + "shared_head.norm.weight"))
  for ours, theirs, model_copy, transpose in (("embed", "embed_tokens", f"{tensors.prefix}embed_tokens.weight", False),
                                              ("lm_head", "shared_head.head",
                                               tensors.head or f"{tensors.prefix}embed_tokens.weight", True)):
    if f"{pre}{theirs}.weight" in tensors.where and not np.array_equal(tensors.get(f"{pre}{theirs}.weight"),
                                                                       tensors.get(model_copy)):
      params[ours] = take(f"{pre}{theirs}.weight", transpose)
  moe = config.moe and dataclasses.replace(config.moe, dense_layers=() if config.moe.sparse(n) else (0,))
  one = dataclasses.replace(config, n_layers=1, sliding_windows=config.sliding_windows[-1:], moe=moe)
  return one, jax.tree.map(jnp.asarray, params)


def _experts(tensors: _Tensors, pre: str, config: ModelConfig, family: str, take) -> dict[str, np.ndarray]:
  """A sparse layer's router, stacked experts [O,D,Fe] / [O,Fe,D], correction bias and shared experts."""
  names, moe = MOE_NAMES[family], config.moe
  out = {"router": take(f"{pre}{names['router']}.weight", True)}
  stacked = {ours: np.stack([take(f"{pre}{names['experts']}.{e}.{names[ours]}.weight", True)
                             for e in range(moe.experts)]) for ours in ("we_gate", "we_up", "we_down")}
  out.update(we_gate_up=interleave(stacked["we_gate"], stacked["we_up"]), we_down=stacked["we_down"])
  if moe.routing == "sigmoid":
    out["router_bias"] = take(f"{pre}{names['router']}.e_score_correction_bias", False)
  if moe.shared_dim:
    out.update({ours: take(f"{pre}mlp.shared_experts.{theirs.split('.')[-1]}.weight", True)
                for ours, theirs in MLP_NAMES.items()})
  return out


def _llama_only(c: ModelConfig) -> None:
  """A Hugging Face export is a Llama directory: refuse what Llama cannot say."""
  features = dict(moe="experts", qkv_bias="a q/k/v bias", sandwich_norms="sandwich norms", qk_norm="q/k norms",
                  scale_embeddings="scaled embeddings", sliding_windows="sliding windows",
                  attn_softcap="soft-capping", final_softcap="soft-capping", local_rope_theta="local RoPE bases",
                  query_scale="a query scale", norm_plus_one="(1 + w) norms")
  for name, what in features.items():
    if getattr(c, name):
      raise ValueError(f"a Hugging Face export is a Llama directory, which has no {what}; this model has them")
  if c.activation != "silu" or c.partial_rotary_factor != 1 or (c.rope_scaling and c.rope_scaling.type != "llama3"):
    raise ValueError("a Hugging Face export is a Llama directory: SwiGLU, full RoPE, llama3 scaling at most")


def save_hf(m: Model, path: str | pathlib.Path) -> None:
  """Writes a jspec model as a Hugging Face Llama directory (`config.json`, `model.safetensors`,
  `tokenizer.json`) that `transformers.AutoModelForCausalLM.from_pretrained` loads, in float32."""
  c = m.config
  _llama_only(c)
  if c.quantization is not None:
    raise ValueError(f"a Hugging Face export is written in float32; this model's weights are {c.quantization}")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  rope = {"rope_theta": c.rope_theta, "rope_scaling": None}
  if c.rope_scaling is not None:
    s = c.rope_scaling
    rope["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                            "high_freq_factor": s.high_freq_factor,
                            "original_max_position_embeddings": s.original_max_position_embeddings}
  eos = list(c.stop_ids) if len(c.stop_ids) > 1 else c.eos_id
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.dim, "intermediate_size": c.mlp_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps, **rope,
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": c.bos_id, "eos_token_id": eos, "torch_dtype": "float32"}
  if c.mask_id is not None:  # a parallel draft model, as PARD writes one
    hf.update(pard_token=c.mask_id, spd_type="pard")
  (path / "config.json").write_text(json.dumps(hf, indent=2))
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  tensors = {"model.embed_tokens.weight": f32(m.params["embed"]), "model.norm.weight": f32(m.params["final_norm"])}
  for i, layer in enumerate(m.params["layers"]):
    for ours, theirs in {**_layer_names(c), **ATTENTION_NAMES, **MLP_NAMES}.items():
      x = f32(layer[ours])
      tensors[f"model.layers.{i}.{theirs}.weight"] = x if x.ndim == 1 else f32(x.T)
  if not c.tie_embeddings:
    tensors["lm_head.weight"] = f32(np.asarray(m.params["lm_head"]).T)
  save_file(tensors, str(path / "model.safetensors"))
  m.tokenizer.save(str(path / "tokenizer.json"))
