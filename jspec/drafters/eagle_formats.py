"""EAGLE heads in the formats they are published in, read and written:

- `eagle`: the EAGLE repository's EAGLE-1/2 heads (`cnets1.py`): a Llama `config.json` (with `bias`),
  `fc [h, 2h]` over `[embed ; feature]`, `layers.{i}.*` (layer 0 without `input_layernorm`), no final norm
  or LM head, `embed_tokens` optional.
- `eagle3`: its EAGLE-3 heads (`cnets.py`; SpecForge's and SGLang's): `fc [h, 3h]`, `midlayer.*` (q/k/v over
  2h, `hidden_norm`, `input_layernorm` on the embedding), `norm`, `lm_head [draft_vocab, h]`, `d2t`, `t2d`.
- `speculators`: vLLM's format (`speculators_model_type` eagle3, or eagle: EAGLE-1/HASS): the same tensors as
  `layers.{i}.*` (resp. `fusion_fc`, `transformer.*`), with the target layers and the verifier in its config.

The readers build the drafter class they are given (`jspec.drafters.eagle.EagleDrafter`), which calls them.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jspec.drafters.base import Heads
from jspec.drafters.published import (
  Found,
  HeadTensors,
  f32,
  layer_config,
  layer_tensors,
  llama_config,
  read_layer,
  take_embed,
  weight_files,
)
from jspec.model.config import ModelConfig

FORMATS = ("eagle", "eagle3", "speculators")


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers of an n-layer target (0-based: the residual after each), as the
  EAGLE-3 implementations choose them: 1, n/2 - 1, n - 4 (distinct, within the target)."""
  picks = [min(max(i, 0), n_layers - 1) for i in (1, n_layers // 2 - 1, n_layers - 4)]
  return tuple(sorted(set(picks)))


def detect(path: pathlib.Path, config: dict) -> Found | None:
  """An EAGLE head's format, from its directory and config; None when it holds none."""
  if "speculators_model_type" in config:
    return Found("speculators", config, weight_files(path))
  architectures = " ".join(config.get("architectures") or [])
  if "draft_vocab_size" in config or "Eagle3" in architectures:
    return Found("eagle3", config, weight_files(path))
  if config.get("num_hidden_layers") == 1 and ("bias" in config or "Eagle" in architectures or _has_fc(path)):
    return Found("eagle", config, weight_files(path))
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


def read(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  """A published EAGLE head as `Heads` of drafter class `cls` (`source` names its format)."""
  read = {"eagle": _eagle1, "eagle3": _eagle3, "speculators": _speculators}[found.format]
  return read(cls, found, tensors, dtype)


def _eagle1_heads(cls: type, config: ModelConfig, tensors: HeadTensors, fc: str, layer_prefix, source: str,
                  first_norm: str | None = None) -> Heads:
  params: dict[str, Any] = {"fc": tensors.take(f"{fc}.weight", True)}
  fc_bias = tensors.has(f"{fc}.bias")
  if fc_bias:
    params["fc_bias"] = tensors.take(f"{fc}.bias")
  params["layers"] = [read_layer(tensors, layer_prefix(i), config, first_norm if i == 0 else "input_layernorm")
                      for i in range(config.n_layers)]
  own_embed = take_embed(tensors, "embed_tokens.weight", params)
  tensors.done()
  return Heads(cls(config, fc_bias=fc_bias, own_embed=own_embed), params, source=source)


def _eagle1(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  config = layer_config(found.config, dtype, tensors, "layers.0.")
  return _eagle1_heads(cls, config, tensors, "fc", lambda i: f"layers.{i}.", "an EAGLE-1/2 head (EAGLE repository)")


def _eagle3_heads(cls: type, config: ModelConfig, tensors: HeadTensors, layer_prefix, layer_ids: list[int] | None,
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
      "layers": [read_layer(tensors, layer_prefix(i), config, None if i == 0 else "input_layernorm")
                 for i in range(config.n_layers)]}
  fused = params["fuse"].shape[0] // config.dim
  if params["fuse"].shape[0] != fused * config.dim or (layer_ids is not None and len(layer_ids) != fused):
    raise ValueError(f"fc reads {params['fuse'].shape[0]} features: not the {len(layer_ids or ())} target layers "
                     f"{layer_ids} of width {config.dim}")
  own_embed = take_embed(tensors, "embed_tokens.weight", params)
  tensors.done()
  layers = () if layer_ids is None else tuple(i - 1 for i in layer_ids)
  if not layers and fused != 3:
    raise ValueError(f"fc fuses {fused} target layers and the config does not say which")
  drafter = cls(config, layers, draft_vocab, norm_before_residual=norm_before_residual, own_embed=own_embed)
  return Heads(drafter, params, source=source)


def _eagle3(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  fields = found.config
  if fields.get("target_hidden_size") not in (None, fields.get("hidden_size")):
    raise ValueError(f"a head of width {fields.get('hidden_size')} on a target of width "
                     f"{fields['target_hidden_size']}: jspec runs heads at their target's width")
  config = layer_config({**fields, "num_hidden_layers": 1}, dtype, tensors, "midlayer.")
  return _eagle3_heads(cls, config, tensors, lambda i: "midlayer.", None, False, "an EAGLE-3 head (EAGLE repository)")


def _speculators(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  fields, kind = found.config, found.config["speculators_model_type"]
  layer_fields = fields.get("transformer_layer_config") or {}
  if kind == "eagle3":
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
      if fields.get(flag):
        raise ValueError(f"speculators eagle3 with {flag}: not supported")
    if fields.get("target_hidden_size") not in (None, layer_fields.get("hidden_size")):
      raise ValueError(f"a head of width {layer_fields.get('hidden_size')} on a target of width "
                       f"{fields['target_hidden_size']}: jspec runs heads at their target's width")
    config = layer_config(layer_fields, dtype, tensors, "layers.0.")
    return _eagle3_heads(cls, config, tensors, lambda i: f"layers.{i}.", fields.get("eagle_aux_hidden_state_layer_ids"),
                         bool(fields.get("norm_before_residual")), "an EAGLE-3 head (speculators format)")
  if kind == "eagle":
    if fields.get("layernorms"):
      raise ValueError("speculators eagle with layernorms (an embedding norm): not supported")
    config = layer_config({**layer_fields, "num_hidden_layers": 1}, dtype, tensors, "transformer.")
    return _eagle1_heads(cls, config, tensors, "fusion_fc", lambda i: "transformer.",
                         "an EAGLE-1 head (speculators format)")
  raise ValueError(f"speculators_model_type {kind!r}: jspec reads eagle3 and eagle")


def write(heads: Heads, fmt: str, target, verifier: str) -> tuple[dict, dict]:
  """`heads` (an EAGLE drafter's, for `target`) in format `fmt`: its `config.json` and its tensors."""
  drafter = heads.drafter
  if drafter.extra_norms:
    raise ValueError("these EAGLE heads are in jspec's first layout (a norm before the first attention and a final "
                     "norm), which no published format has: train them again to export")
  writers = {("eagle", 1): _write_eagle1, ("eagle", 3): _write_eagle3_repo, ("eagle3", 3): _write_eagle3_repo,
             ("speculators", 3): _write_speculators}
  if (fmt, drafter.version) not in writers:
    written = [f for f, version in writers if version == drafter.version]
    raise ValueError(f"an EAGLE-{drafter.version} head cannot be written as {fmt}; it is written as "
                     f"{' or '.join(written)}")
  if drafter.is_eagle3 and not drafter.feature_layers:
    heads = dataclasses.replace(heads, drafter=type(drafter).for_pair(target, heads, None))
  return writers[(fmt, drafter.version)](heads, target, verifier)


def _write_eagle1(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  p, d = heads.params, heads.drafter
  tensors = {"fc.weight": f32(p["fc"]).T}
  if d.fc_bias:
    tensors["fc.bias"] = f32(p["fc_bias"])
  for i, layer in enumerate(p["layers"]):
    tensors.update(layer_tensors(layer, f"layers.{i}.", None if i == 0 else "input_layernorm"))
  if d.own_embed:
    tensors["embed_tokens.weight"] = f32(p["embed"])
  return {**llama_config(d.config, d.config.n_layers), "bias": d.fc_bias}, tensors


def _eagle3_tensors(heads: Heads, layer_prefix) -> dict[str, np.ndarray]:
  p, d = heads.params, heads.drafter
  ids = np.asarray(p["target_ids"], np.int64)
  t2d = np.zeros(d.config.vocab_size, bool)
  t2d[ids] = True
  first = layer_prefix(0)
  tensors = {"fc.weight": f32(p["fuse"]).T, f"{first}hidden_norm.weight": f32(p["hidden_norm"]),
             f"{first}input_layernorm.weight": f32(p["embed_norm"]), "norm.weight": f32(p["final_norm"]),
             "lm_head.weight": f32(p["lm_head"]).T, "d2t": ids - np.arange(len(ids)), "t2d": t2d}
  for i, layer in enumerate(p["layers"]):
    tensors.update(layer_tensors(layer, layer_prefix(i), None if i == 0 else "input_layernorm"))
  if d.own_embed:
    tensors["embed_tokens.weight"] = f32(p["embed"])
  return tensors


def _write_eagle3_repo(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  d = heads.drafter
  if d.config.n_layers != 1 or d.norm_before_residual or \
      d.feature_layers != default_feature_layers(target.config.n_layers):
    raise ValueError("the EAGLE repository's EAGLE-3 layout holds one layer reading the default target layers; "
                     "write this head as speculators")
  config = {**llama_config(d.config, 1), "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": d.draft_vocab, "target_hidden_size": d.config.dim}
  return config, _eagle3_tensors(heads, lambda i: "midlayer.")


def _write_speculators(heads: Heads, target, verifier: str) -> tuple[dict, dict]:
  d = heads.drafter
  layer_config = llama_config(d.config, d.config.n_layers)
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
