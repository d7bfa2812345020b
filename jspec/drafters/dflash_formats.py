"""DFlash drafters in the layout z-lab publishes them in (z-lab/Qwen3-8B-DFlash-b16 and its kind; vLLM, SGLang
and SpecForge read and write the same), read and written:

- `config.json`: a Qwen3 config of the draft layers (`architectures` ["DFlashDraftModel"]) with `block_size`,
  `num_target_layers` and `dflash_config` {`target_layer_ids` (0-based: the output of those target layers),
  `mask_token_id`}; without target_layer_ids, z-lab's default for the target and draft layer counts.
- tensors: `fc.weight [D, L*D]`, `hidden_norm.weight`, `norm.weight`, and `layers.{i}.*` as a Qwen3 decoder
  layer (q/k norms); no embedding or LM head (the target's). An optional `model.` prefix is read too.

What the published variants add and jspec does not run (sliding or causal draft layers, a separate mask
embedding, DFlash 2) is refused in one line.
"""
from __future__ import annotations

import dataclasses
import pathlib

from jspec.drafters.base import Heads
from jspec.drafters.published import (
  Found,
  HeadTensors,
  f32,
  layer_config,
  layer_tensors,
  llama_config,
  read_layer,
  weight_files,
)

FORMATS = ("dflash",)
ARCHITECTURE = "DFlashDraftModel"


def default_feature_layers(target_layers: int, draft_layers: int) -> tuple[int, ...]:
  """z-lab's choice of target layers (`build_target_layer_ids`): one per draft layer, spread evenly from
  layer 1 to layer N - 3 (the middle one for a single draft layer); within the target's layers when it has
  fewer than 5."""
  if draft_layers == 1:
    return (target_layers // 2,)
  picks = (round(1 + i * (target_layers - 4) / (draft_layers - 1)) for i in range(draft_layers))
  return tuple(min(max(int(i), 0), target_layers - 1) for i in picks)


def detect(path: pathlib.Path, config: dict) -> Found | None:
  if "dflash_config" in config or ARCHITECTURE in (config.get("architectures") or []):
    return Found("dflash", config, weight_files(path))
  return None


def read(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  """A z-lab DFlash directory as `Heads` of drafter class `cls`."""
  fields = found.config
  method = fields.get("dflash_config") or {}
  architectures = fields.get("architectures") or [ARCHITECTURE]
  if architectures != [ARCHITECTURE]:
    raise ValueError(f"DFlash architecture {architectures}: jspec runs {ARCHITECTURE}")
  layer_types = set(fields.get("layer_types") or ["full_attention"])
  if layer_types != {"full_attention"} or method.get("use_swa") or method.get("causal") or fields.get("is_causal"):
    raise ValueError("DFlash draft layers with sliding windows or a causal mask: jspec runs full, non-causal ones")
  for name in ("output_multiplier", "final_logit_softcapping", "attention_sink_bias"):
    if method.get(name, fields.get(name)) not in (None, 1, 1.0, False):
      raise ValueError(f"a DFlash config with {name}: a variant jspec does not run")
  mask = method.get("mask_token_id", fields.get("mask_token_id"))
  block = fields.get("block_size", method.get("block_size"))
  if mask is None or block is None:
    raise ValueError("a DFlash config without mask_token_id or block_size")
  draft_layers = int(fields["num_hidden_layers"])
  layer_ids = method.get("target_layer_ids")
  if layer_ids is None:
    if "num_target_layers" not in fields:
      raise ValueError("a DFlash config with neither target_layer_ids nor num_target_layers")
    layer_ids = default_feature_layers(int(fields["num_target_layers"]), draft_layers)
  prefix = "model." if tensors.has("model.fc.weight") else ""
  config = layer_config({**fields, "model_type": "qwen3"}, dtype, tensors, f"{prefix}layers.0.")
  config = dataclasses.replace(config, qk_norm=True)
  params = {"fc": tensors.take(f"{prefix}fc.weight", True), "hidden_norm": tensors.take(f"{prefix}hidden_norm.weight"),
            "final_norm": tensors.take(f"{prefix}norm.weight"),
            "layers": [read_layer(tensors, f"{prefix}layers.{i}.", config, "input_layernorm")
                       for i in range(draft_layers)]}
  tensors.done()
  if params["fc"].shape[0] != len(layer_ids) * config.dim:
    raise ValueError(f"fc reads {params['fc'].shape[0]} features: not the {len(layer_ids)} target layers {layer_ids} "
                     f"of width {config.dim}")
  drafter = cls(config, tuple(int(i) for i in layer_ids), int(block), int(mask))
  return Heads(drafter, params, source="a DFlash drafter (z-lab layout)")


def write(heads: Heads, fmt: str, target, verifier: str) -> tuple[dict, dict]:
  """`heads` (a DFlash drafter's, for `target`) in z-lab's layout: its `config.json` and its tensors."""
  d, p = heads.drafter, heads.params
  c = d.config
  fields = {**llama_config(dataclasses.replace(c, qk_norm=False), c.n_layers), "architectures": [ARCHITECTURE],
            "model_type": "qwen3", "block_size": d.block_size, "num_target_layers": target.config.n_layers,
            "layer_types": ["full_attention"] * c.n_layers,
            "dflash_config": {"target_layer_ids": list(d.feature_layers), "mask_token_id": d.mask_token}}
  tensors = {"fc.weight": f32(p["fc"]).T, "hidden_norm.weight": f32(p["hidden_norm"]),
             "norm.weight": f32(p["final_norm"])}
  for i, layer in enumerate(p["layers"]):
    tensors.update(layer_tensors(layer, f"layers.{i}.", "input_layernorm"))
  return fields, tensors
