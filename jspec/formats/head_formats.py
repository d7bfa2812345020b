"""Draft heads in the formats they are published in, read and written.

- `eagle`: the EAGLE repository's EAGLE-1/2 heads (`cnets1.py`): a Llama `config.json` (with `bias`),
  `fc [h, 2h]` over `[embed ; feature]`, `layers.{i}.*` (layer 0 without `input_layernorm`), no final norm
  or LM head, `embed_tokens` optional.
- `eagle3`: its EAGLE-3 heads (`cnets.py`; SpecForge's and SGLang's): `fc [h, 3h]`, `midlayer.*` (q/k/v over
  2h, `hidden_norm`, `input_layernorm` on the embedding), `norm`, `lm_head [draft_vocab, h]`, `d2t`, `t2d`.
- `speculators`: vLLM's format (`speculators_model_type` eagle3, or eagle: EAGLE-1/HASS): the same tensors as
  `layers.{i}.*` (resp. `fusion_fc`, `transformer.*`), with the target layers and the verifier in its config.
- `medusa`: FasterDecoding's heads (`medusa_lm_head.*`: `{i}.{j}.linear`, `{i}.{layers}`) and vLLM's layout
  (`blocks.{i}.layers.{j}`, `lm_heads.{i}` or one shared `lm_head`).

Weights may be safetensors or PyTorch zip files (`jspec.core.tensor_files`: never unpickled as code).
Matrices are stored `[out, in]` there and `[in, out]` in jspec. What a head holds that jspec cannot run is
refused with one line naming it.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jspec.core.tensor_files import read_tensors
from jspec.drafters import Heads
from jspec.drafters.eagle import EagleDrafter, default_feature_layers
from jspec.drafters.medusa import MedusaDrafter
from jspec.model import hf, model
from jspec.model.config import ModelConfig

FORMATS = ("eagle", "eagle3", "speculators", "medusa")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")
LAYER_NAMES = {**hf.ATTENTION_NAMES, **hf.MLP_NAMES}  # jspec's name -> the module's, within a layer


@dataclasses.dataclass(frozen=True)
class Found:
  """A head directory's format, its config and the file its weights are in."""
  format: str
  config: dict
  weights: list[pathlib.Path]


def detect(path: pathlib.Path) -> Found | None:
  """The published head format of a directory, None when it holds none (a model, a jspec checkpoint)."""
  path = pathlib.Path(path)
  config_file = path / "config.json"
  try:
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON ({' '.join(str(e).split())})") from None
  medusa = [path / f for f in MEDUSA_FILES if (path / f).is_file()]
  if "medusa_num_heads" in config or config.get("model_type") == "medusa" or medusa:
    return Found("medusa", config, medusa[:1] or _weights(path))
  if "speculators_model_type" in config:
    return Found("speculators", config, _weights(path))
  architectures = " ".join(config.get("architectures") or [])
  if "draft_vocab_size" in config or "Eagle3" in architectures:
    return Found("eagle3", config, _weights(path))
  if config.get("num_hidden_layers") == 1 and ("bias" in config or "Eagle" in architectures or _has_fc(path)):
    return Found("eagle", config, _weights(path))
  return None


def _has_fc(path: pathlib.Path) -> bool:
  """An EAGLE head's input projection, where a one-layer Llama config leaves the kind open."""
  if (path / "pytorch_model.bin").is_file() and not (path / "model.safetensors").is_file():
    return True  # heads come as torch files; models (the other one-layer Llamas) as safetensors
  try:
    with safe_open(path / "model.safetensors", framework="numpy") as f:
      return "fc.weight" in f.keys()
  except (SafetensorError, OSError):
    return False


def _weights(path: pathlib.Path) -> list[pathlib.Path]:
  """The weight files of a head directory: an index's shards, or the one weights file."""
  for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
    if (path / index).is_file():
      return [path / f for f in sorted(set(json.loads((path / index).read_text())["weight_map"].values()))]
  found = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
  if not found:
    raise ValueError(f"{path}: a draft head's config.json but no weights ({' or '.join(WEIGHT_FILES)})")
  return found[:1]


class _Tensors:
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


def load_head(path: pathlib.Path, found: Found, dtype: str) -> Heads:
  """A published head as jspec `Heads` (`source` names its format)."""
  read = {"eagle": _eagle1, "eagle3": _eagle3, "speculators": _speculators, "medusa": _medusa}[found.format]
  return read(found, _Tensors(found, path, dtype), dtype)


def _layer_config(fields: dict, dtype: str, tensors: _Tensors, prefix: str) -> ModelConfig:
  """The head's layers' shape from its Llama/Qwen config; a q/k/v bias where its tensors have one."""
  fields = {"model_type": "llama", **fields, "attention_bias": False}
  try:
    config = hf.config_from_hf(fields, dtype)
  except KeyError as e:
    raise ValueError(f"head config without {e}") from None
  return dataclasses.replace(config, qkv_bias=tensors.has(f"{prefix}self_attn.q_proj.bias"))


def _layer(tensors: _Tensors, prefix: str, config: ModelConfig, input_norm: str | None) -> dict:
  """One decoder layer's weights in jspec's names; `input_norm`: the tensor that is its `attn_norm`."""
  layer = {ours: tensors.take(f"{prefix}{theirs}.weight", True) for ours, theirs in LAYER_NAMES.items()}
  layer["mlp_norm"] = tensors.take(f"{prefix}post_attention_layernorm.weight")
  if input_norm is not None:
    layer["attn_norm"] = tensors.take(f"{prefix}{input_norm}.weight")
  if config.qk_norm:
    layer.update(q_norm=tensors.take(f"{prefix}self_attn.q_norm.weight"),
                 k_norm=tensors.take(f"{prefix}self_attn.k_norm.weight"))
  if config.qkv_bias:
    layer.update({ours: tensors.take(f"{prefix}{theirs}.bias") for ours, theirs in hf.BIAS_NAMES.items()})
  return layer


def _embed(tensors: _Tensors, name: str, params: dict) -> bool:
  """Takes the head's own embedding when it carries one."""
  if tensors.has(name):
    params["embed"] = tensors.take(name)
    return True
  return False


def _eagle1_heads(config: ModelConfig, tensors: _Tensors, fc: str, layer_prefix, source: str,
                  first_norm: str | None = None) -> Heads:
  params: dict[str, Any] = {"fc": tensors.take(f"{fc}.weight", True)}
  fc_bias = tensors.has(f"{fc}.bias")
  if fc_bias:
    params["fc_bias"] = tensors.take(f"{fc}.bias")
  params["layers"] = [_layer(tensors, layer_prefix(i), config, first_norm if i == 0 else "input_layernorm")
                      for i in range(config.n_layers)]
  own_embed = _embed(tensors, "embed_tokens.weight", params)
  tensors.done()
  return Heads(EagleDrafter(config, fc_bias=fc_bias, own_embed=own_embed), params, source=source)


def _eagle1(found: Found, tensors: _Tensors, dtype: str) -> Heads:
  config = _layer_config(found.config, dtype, tensors, "layers.0.")
  return _eagle1_heads(config, tensors, "fc", lambda i: f"layers.{i}.", "an EAGLE-1/2 head (EAGLE repository)")


def _eagle3_heads(config: ModelConfig, tensors: _Tensors, layer_prefix, layer_ids: list[int] | None,
                  norm_before_residual: bool, source: str) -> Heads:
  """EAGLE-3's tensors (`layer_prefix(i)`: where layer i's are) as jspec heads. `layer_ids`: the target
  layers as the formats count them (the input of layer i, so jspec's i - 1); None: the defaults."""
  if layer_ids is not None and min(layer_ids) < 1:
    raise ValueError(f"target layer ids {layer_ids}: id 0 (the embeddings) is not a layer jspec reads")
  lm_head = tensors.raw("lm_head.weight")
  draft_vocab = lm_head.shape[0]
  if tensors.has("d2t"):
    target_ids = np.arange(draft_vocab) + tensors.raw("d2t").astype(np.int64)
  elif draft_vocab == config.vocab_size:
    target_ids = np.arange(draft_vocab)
  else:
    raise ValueError(f"a draft vocabulary of {draft_vocab} tokens without d2t to map it to the target's")
  if tensors.has("t2d"):  # the same map the other way: read, and checked against d2t
    t2d = tensors.raw("t2d").astype(bool)
    if t2d.shape != (config.vocab_size,) or set(np.flatnonzero(t2d)) != set(target_ids.tolist()):
      raise ValueError("t2d does not mark the tokens d2t maps to")
  if target_ids.min() < 0 or target_ids.max() >= config.vocab_size or len(set(target_ids)) != draft_vocab:
    raise ValueError(f"d2t maps the draft vocabulary outside the target's {config.vocab_size} tokens")
  first = layer_prefix(0)
  params: dict[str, Any] = {
      "fuse": tensors.take("fc.weight", True), "hidden_norm": tensors.take(f"{first}hidden_norm.weight"),
      "embed_norm": tensors.take(f"{first}input_layernorm.weight"), "final_norm": tensors.take("norm.weight"),
      "lm_head": tensors.take("lm_head.weight", True), "target_ids": jnp.asarray(target_ids, jnp.int32),
      "layers": [_layer(tensors, layer_prefix(i), config, None if i == 0 else "input_layernorm")
                 for i in range(config.n_layers)]}
  fused = params["fuse"].shape[0] // config.dim
  if params["fuse"].shape[0] != fused * config.dim or (layer_ids is not None and len(layer_ids) != fused):
    raise ValueError(f"fc reads {params['fuse'].shape[0]} features: not the {len(layer_ids or ())} target layers "
                     f"{layer_ids} of width {config.dim}")
  own_embed = _embed(tensors, "embed_tokens.weight", params)
  tensors.done()
  layers = () if layer_ids is None else tuple(i - 1 for i in layer_ids)
  if not layers and fused != 3:
    raise ValueError(f"fc fuses {fused} target layers and the config does not say which")
  drafter = EagleDrafter(config, layers, draft_vocab, norm_before_residual=norm_before_residual, own_embed=own_embed)
  return Heads(drafter, params, source=source)


def _eagle3(found: Found, tensors: _Tensors, dtype: str) -> Heads:
  fields = found.config
  if fields.get("target_hidden_size") not in (None, fields.get("hidden_size")):
    raise ValueError(f"a head of width {fields.get('hidden_size')} on a target of width "
                     f"{fields['target_hidden_size']}: jspec runs heads at their target's width")
  config = _layer_config({**fields, "num_hidden_layers": 1}, dtype, tensors, "midlayer.")
  return _eagle3_heads(config, tensors, lambda i: "midlayer.", None, False, "an EAGLE-3 head (EAGLE repository)")


def _speculators(found: Found, tensors: _Tensors, dtype: str) -> Heads:
  fields, kind = found.config, found.config["speculators_model_type"]
  layer_fields = fields.get("transformer_layer_config") or {}
  if kind == "eagle3":
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
      if fields.get(flag):
        raise ValueError(f"speculators eagle3 with {flag}: not supported")
    if fields.get("target_hidden_size") not in (None, layer_fields.get("hidden_size")):
      raise ValueError(f"a head of width {layer_fields.get('hidden_size')} on a target of width "
                       f"{fields['target_hidden_size']}: jspec runs heads at their target's width")
    config = _layer_config(layer_fields, dtype, tensors, "layers.0.")
    return _eagle3_heads(config, tensors, lambda i: f"layers.{i}.", fields.get("eagle_aux_hidden_state_layer_ids"),
                         bool(fields.get("norm_before_residual")), "an EAGLE-3 head (speculators format)")
  if kind == "eagle":
    if fields.get("layernorms"):
      raise ValueError("speculators eagle with layernorms (an embedding norm): not supported")
    config = _layer_config({**layer_fields, "num_hidden_layers": 1}, dtype, tensors, "transformer.")
    return _eagle1_heads(config, tensors, "fusion_fc", lambda i: "transformer.", "an EAGLE-1 head (speculators format)")
  raise ValueError(f"speculators_model_type {kind!r}: jspec reads eagle3 and eagle")


def _medusa(found: Found, tensors: _Tensors, dtype: str) -> Heads:
  fields = found.config
  vllm = tensors.has("blocks.0.layers.0.weight")
  heads = int(fields.get("medusa_num_heads") or fields.get("num_heads") or 0)
  layers = int(fields.get("medusa_num_layers") or fields.get("num_hidden_layers") or 0)
  if not heads or not layers:
    raise ValueError("a Medusa config without medusa_num_heads/num_heads and medusa_num_layers/num_hidden_layers")
  if vllm and fields.get("truncated_vocab_size") not in (None, fields.get("vocab_size")) or tensors.has("token_map"):
    raise ValueError("Medusa heads over a truncated vocabulary (token_map): not supported")
  block = (lambda i, j: f"blocks.{i}.layers.{j}") if vllm else (lambda i, j: f"{i}.{j}.linear")
  w = [[tensors.take(f"{block(i, j)}.weight", True) for j in range(layers)] for i in range(heads)]
  dim = w[0][0].shape[0]
  b = [[tensors.take(f"{block(i, j)}.bias") if tensors.has(f"{block(i, j)}.bias") else jnp.zeros(dim, w[0][0].dtype)
        for j in range(layers)] for i in range(heads)]
  params: dict[str, Any] = {"w": jnp.stack([jnp.stack(r) for r in w]), "b": jnp.stack([jnp.stack(r) for r in b])}
  if vllm and tensors.has("lm_head.weight"):  # one head shared by all (`original_lm_head`)
    heads_VxD = [tensors.raw("lm_head.weight")]
  else:
    heads_VxD = [tensors.raw(f"lm_heads.{i}.weight" if vllm else f"{i}.{layers}.weight") for i in range(heads)]
  params["lm_head"] = jnp.asarray(np.stack([h.astype(tensors.dtype).T for h in heads_VxD]))
  tensors.done()
  vocab = params["lm_head"].shape[-1]
  config = ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=dim, mlp_dim=dim,
                       dtype=dtype)
  source = "Medusa heads (vLLM layout)" if vllm else "Medusa heads (FasterDecoding)"
  return Heads(MedusaDrafter(config, heads, layers, own_heads=len(heads_VxD)), params, source=source)


# -- export ----------------------------------------------------------------------------------------------------

def export(heads: Heads, fmt: str, out: pathlib.Path, target, verifier: str) -> pathlib.Path:
  """Writes jspec heads for `target` (a `Model`) in a published format, naming `verifier` (the target's name
  or path as the serving system will load it) where the format records one."""
  drafter = heads.drafter
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
  writers = {("eagle", 1): _write_eagle1, ("eagle", 3): _write_eagle3_repo, ("eagle3", 3): _write_eagle3_repo,
             ("speculators", 3): _write_speculators, ("medusa", 0): _write_medusa}
  version = 0 if isinstance(drafter, MedusaDrafter) else getattr(drafter, "version", None)
  if getattr(drafter, "extra_norms", False):
    raise ValueError("these EAGLE heads are in jspec's first layout (a norm before the first attention and a final "
                     "norm), which no published format has: train them again to export")
  if (fmt, version) not in writers:
    what = {0: "Medusa heads", 1: "an EAGLE-1 head", 3: "an EAGLE-3 head"}.get(version, f"{drafter.kind} heads")
    raise ValueError(f"{what} cannot be written as {fmt}: eagle takes EAGLE-1 and EAGLE-3 heads, eagle3 and "
                     f"speculators EAGLE-3 heads, medusa Medusa heads")
  if isinstance(drafter, EagleDrafter) and drafter.is_eagle3 and not drafter.feature_layers:
    drafter = EagleDrafter.for_pair(target, heads, None)
    heads = dataclasses.replace(heads, drafter=drafter)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  config, tensors = writers[(fmt, version)](heads, target, verifier)
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
  return out


def _f32(x) -> np.ndarray:
  return np.asarray(x, np.float32)


def _llama_config(config: ModelConfig, layers: int) -> dict:
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


def _layer_tensors(layer: dict, prefix: str, input_norm: str | None) -> dict[str, np.ndarray]:
  out = {f"{prefix}{theirs}.weight": _f32(layer[ours]).T for ours, theirs in LAYER_NAMES.items()}
  out[f"{prefix}post_attention_layernorm.weight"] = _f32(layer["mlp_norm"])
  if input_norm is not None:
    out[f"{prefix}{input_norm}.weight"] = _f32(layer["attn_norm"])
  for ours, theirs in hf.BIAS_NAMES.items():
    if ours in layer:
      out[f"{prefix}{theirs}.bias"] = _f32(layer[ours])
  return out


def _write_eagle1(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  p, d = heads.params, heads.drafter
  tensors = {"fc.weight": _f32(p["fc"]).T}
  if d.fc_bias:
    tensors["fc.bias"] = _f32(p["fc_bias"])
  for i, layer in enumerate(p["layers"]):
    tensors.update(_layer_tensors(layer, f"layers.{i}.", None if i == 0 else "input_layernorm"))
  if d.own_embed:
    tensors["embed_tokens.weight"] = _f32(p["embed"])
  return {**_llama_config(d.config, d.config.n_layers), "bias": d.fc_bias}, tensors


def _eagle3_tensors(heads: Heads, layer_prefix) -> dict[str, np.ndarray]:
  p, d = heads.params, heads.drafter
  ids = np.asarray(p["target_ids"], np.int64)
  t2d = np.zeros(d.config.vocab_size, bool)
  t2d[ids] = True
  first = layer_prefix(0)
  tensors = {"fc.weight": _f32(p["fuse"]).T, f"{first}hidden_norm.weight": _f32(p["hidden_norm"]),
             f"{first}input_layernorm.weight": _f32(p["embed_norm"]), "norm.weight": _f32(p["final_norm"]),
             "lm_head.weight": _f32(p["lm_head"]).T, "d2t": ids - np.arange(len(ids)), "t2d": t2d}
  for i, layer in enumerate(p["layers"]):
    tensors.update(_layer_tensors(layer, layer_prefix(i), None if i == 0 else "input_layernorm"))
  if d.own_embed:
    tensors["embed_tokens.weight"] = _f32(p["embed"])
  return tensors


def _write_eagle3_repo(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  d = heads.drafter
  if d.config.n_layers != 1 or d.norm_before_residual or \
      d.feature_layers != default_feature_layers(target.config.n_layers):
    raise ValueError("the EAGLE repository's EAGLE-3 layout holds one layer reading the default target layers; "
                     "write this head as speculators")
  config = {**_llama_config(d.config, 1), "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": d.draft_vocab, "target_hidden_size": d.config.dim}
  return config, _eagle3_tensors(heads, lambda i: "midlayer.")


def _write_speculators(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  d = heads.drafter
  layer_config = _llama_config(d.config, d.config.n_layers)
  config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config, "draft_vocab_size": d.draft_vocab,
            "norm_before_residual": d.norm_before_residual, "target_hidden_size": d.config.dim,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in d.feature_layers],
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
  return config, _eagle3_tensors(heads, lambda i: f"layers.{i}.")


def _write_medusa(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  """vLLM's layout (its `MedusaModel`), biases kept (`medusa_fc_bias`), the target's LM head written once
  (`original_lm_head`) when the heads share it."""
  p, d = heads.params, heads.drafter
  tensors = {}
  for i in range(d.num_heads):
    for j in range(d.num_layers):
      tensors[f"blocks.{i}.layers.{j}.weight"] = _f32(p["w"][i, j]).T
      tensors[f"blocks.{i}.layers.{j}.bias"] = _f32(p["b"][i, j])
    if d.own_heads > 1:
      tensors[f"lm_heads.{i}.weight"] = _f32(p["lm_head"][i]).T
  if d.own_heads <= 1:
    head = p["lm_head"][0] if d.own_heads else model.with_head(target.params)["lm_head"]
    tensors["lm_head.weight"] = _f32(head).T
  config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": d.num_heads,
            "num_hidden_layers": d.num_layers, "hidden_size": d.config.dim, "vocab_size": d.config.vocab_size,
            "truncated_vocab_size": d.config.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": d.own_heads <= 1, "medusa_num_heads": d.num_heads, "medusa_num_layers": d.num_layers,
            "base_model_name_or_path": verifier}
  return config, tensors
