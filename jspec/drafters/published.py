"""What the published draft-head formats share, read and written (each drafter's own formats live beside it:
`eagle_formats`, `medusa_formats`): the directory's config and weight files, its tensors taken one by one,
and decoder layers in the Llama names these formats use.

Weights may be safetensors or PyTorch zip files (`jspec.core.tensor_files`: never unpickled as code).
Matrices are stored `[out, in]` there and `[in, out]` in jspec. What a head holds that jspec cannot run is
refused with one line naming it.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np

from jspec.core.tensor_files import read_tensors
from jspec.model import hf_config
from jspec.model.config import ModelConfig

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_NAMES = {**hf_config.ATTENTION_NAMES, **hf_config.MLP_NAMES}  # jspec's name -> the module's, within a layer


@dataclasses.dataclass(frozen=True)
class Found:
  """A head directory's format, its config and the files its weights are in."""
  format: str
  config: dict
  weights: list[pathlib.Path]


def read_config(path: pathlib.Path) -> dict:
  """A directory's `config.json` ({} without one); invalid JSON is a one-line ValueError."""
  config_file = pathlib.Path(path) / "config.json"
  try:
    return json.loads(config_file.read_text()) if config_file.is_file() else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON ({' '.join(str(e).split())})") from None


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
  """The weight files of a head directory: an index's shards, or the one weights file."""
  for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
    if (path / index).is_file():
      return [path / f for f in sorted(set(json.loads((path / index).read_text())["weight_map"].values()))]
  found = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
  if not found:
    raise ValueError(f"{path}: a draft head's config.json but no weights ({' or '.join(WEIGHT_FILES)})")
  return found[:1]


class HeadTensors:
  """A head's tensors by name, taken one by one; the names left over at the end are a format jspec
  misread or a part it does not run, and refused."""

  def __init__(self, found: Found, where: pathlib.Path, dtype: str):
    self.where, self.dtype, self.tensors = where, np.dtype(dtype), {}
    for f in found.weights:
      self.tensors.update(read_tensors(f))
    self.used: set[str] = set()

  def has(self, name: str) -> bool:
    return name in self.tensors

  def raw(self, name: str) -> np.ndarray:
    if name not in self.tensors:
      raise ValueError(f"{self.where}: tensor {name} is missing")
    self.used.add(name)
    return self.tensors[name]

  def take(self, name: str, transpose: bool = False) -> jnp.ndarray:
    x = self.raw(name).astype(self.dtype)
    return jnp.asarray(x.T if transpose else x)

  def done(self) -> None:
    left = sorted(set(self.tensors) - self.used)
    if left:
      raise ValueError(f"{self.where}: tensors jspec does not run: {', '.join(left[:6])}"
                       + (f" and {len(left) - 6} more" if len(left) > 6 else ""))


def layer_config(fields: dict, dtype: str, tensors: HeadTensors, prefix: str) -> ModelConfig:
  """The head's layers' shape from its Llama/Qwen config; a q/k/v bias where its tensors have one."""
  fields = {"model_type": "llama", **fields, "attention_bias": False}
  try:
    config = hf_config.config_from_hf(fields, dtype)
  except KeyError as e:
    raise ValueError(f"head config without {e}") from None
  return dataclasses.replace(config, qkv_bias=tensors.has(f"{prefix}self_attn.q_proj.bias"))


def read_layer(tensors: HeadTensors, prefix: str, config: ModelConfig, input_norm: str | None) -> dict:
  """One decoder layer's weights in jspec's names; `input_norm`: the tensor that is its `attn_norm`."""
  layer = {ours: tensors.take(f"{prefix}{theirs}.weight", True) for ours, theirs in LAYER_NAMES.items()}
  layer["mlp_norm"] = tensors.take(f"{prefix}post_attention_layernorm.weight")
  if input_norm is not None:
    layer["attn_norm"] = tensors.take(f"{prefix}{input_norm}.weight")
  if config.qk_norm:
    layer.update(q_norm=tensors.take(f"{prefix}self_attn.q_norm.weight"),
                 k_norm=tensors.take(f"{prefix}self_attn.k_norm.weight"))
  if config.qkv_bias:
    layer.update({ours: tensors.take(f"{prefix}{theirs}.bias") for ours, theirs in hf_config.BIAS_NAMES.items()})
  return layer


def take_embed(tensors: HeadTensors, name: str, params: dict) -> bool:
  """Takes the head's own embedding when it carries one."""
  if tensors.has(name):
    params["embed"] = tensors.take(name)
    return True
  return False


def f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


def llama_config(config: ModelConfig, layers: int) -> dict:
  """The head's layers as a Llama `config.json` says them."""
  if config.qk_norm or config.sandwich_norms or config.activation != "silu":
    raise ValueError("only Llama- and Qwen2-shaped head layers export")
  fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
            "intermediate_size": config.mlp_dim, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "num_hidden_layers": layers,
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "vocab_size": config.vocab_size,
            "tie_word_embeddings": False, "attention_bias": config.qkv_bias, "torch_dtype": "float32"}
  if config.rope_scaling is not None:
    s = config.rope_scaling
    fields["rope_scaling"] = {"rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                              "high_freq_factor": s.high_freq_factor,
                              "original_max_position_embeddings": s.original_max_position_embeddings}
  return fields


def layer_tensors(layer: dict, prefix: str, input_norm: str | None) -> dict[str, np.ndarray]:
  out = {f"{prefix}{theirs}.weight": f32(layer[ours]).T for ours, theirs in LAYER_NAMES.items()}
  out[f"{prefix}post_attention_layernorm.weight"] = f32(layer["mlp_norm"])
  if input_norm is not None:
    out[f"{prefix}{input_norm}.weight"] = f32(layer["attn_norm"])
  for norm in ("q_norm", "k_norm"):
    if norm in layer:
      out[f"{prefix}self_attn.{norm}.weight"] = f32(layer[norm])
  for ours, theirs in hf_config.BIAS_NAMES.items():
    if ours in layer:
      out[f"{prefix}{theirs}.bias"] = f32(layer[ours])
  return out
