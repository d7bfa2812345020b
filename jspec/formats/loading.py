"""`jspec.load`: one entry point above the checkpoint formats (jspec model or heads directories, published
draft heads, Hugging Face model directories)."""
from __future__ import annotations

import dataclasses
import pathlib

import jax

from jspec.core import registry, shipped
from jspec.core.settings import DTYPES, WEIGHT_FORMATS
from jspec.drafters import Heads
from jspec.drafters.mtp import MtpDrafter, read_mtp
from jspec.formats import checkpoint, head_formats
from jspec.model import hf, hf_config, model, quantization
from jspec.model.config import default_dtype
from jspec.model.model import Model
from jspec.text import tokenizer


def load(path: str | pathlib.Path, dtype: str | None = None, mesh=None, quantize: str | None = None,
         mtp: bool = False) -> Model | Heads:
  """A model (a jspec checkpoint, a Hugging Face model directory of a family in `jspec.model.hf_config.FAMILIES`, or a
  shipped pair's name such as "code" for its target), or Medusa/EAGLE heads (`Heads`): jspec's own, or
  published ones in a format of `jspec.formats.head_formats` (EAGLE, EAGLE-3, speculators, Medusa).

  Parameters and activations use `dtype` ("float32" or "bfloat16"), by default fp32 on the CPU and bf16 on
  accelerators. With a `mesh` (`jspec.make_mesh`), each array is placed in its shards as it is read.
  Quantized checkpoints load as stored; `quantize` ("int8", "fp8", "fp8-block": `jspec.model.quantization`)
  quantizes a float one's linear layers (a Hugging Face directory's layer by layer, as they are read).
  `mtp`: instead of the model, the multi-token-prediction layer a Hugging Face checkpoint ships, as heads of
  the mtp drafter (`jspec.drafters.mtp`). Every problem is a one-line ValueError.
  """
  if dtype not in (None, *DTYPES):
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
  if quantize not in (None, *WEIGHT_FORMATS):
    raise ValueError(f"unknown weight format {quantize!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
  path = shipped.resolve(path).absolute()
  if not path.is_dir():
    raise ValueError(f"{path}: no such checkpoint directory")
  if mtp:
    if not hf.is_hf_dir(path):
      raise ValueError(f"{path}: MTP layers are read from a Hugging Face checkpoint; this is not one")
    loaded = read_mtp(path, dtype or default_dtype())  # placed on a mesh when decoding
  elif checkpoint.is_heads_dir(path):
    loaded = checkpoint.load_heads(path, dtype, mesh)
  elif (found := head_formats.detect(path)) is not None:
    loaded = head_formats.load_head(path, found, dtype or default_dtype())  # placed on a mesh when decoding
  elif hf.is_hf_dir(path):
    return hf.load_hf(path, dtype or default_dtype(), mesh, quantize)
  else:
    loaded = checkpoint.load_model(path, dtype, mesh)
  return quantized(loaded, quantize, path)


def quantized(loaded: Model | Heads, fmt: str | None, where: str | pathlib.Path = "") -> Model | Heads:
  """A model or heads with their linear layers (attention and MLP) in `fmt`; None, or the format they are
  already stored in: as they are. Medusa's heads, which have none, are refused."""
  stored = loaded.config.quantization if isinstance(loaded, Model) else loaded.drafter.config.quantization
  if fmt is None or fmt == stored:
    return loaded
  if stored is not None:
    raise ValueError(f"{where}: its weights are stored in {stored}; it loads as it is, not as {fmt}")
  quantize = lambda params: quantization.quantize_params(params, fmt)
  abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(loaded.params))
  params = jax.eval_shape(quantize, loaded.params) if abstract else quantize(loaded.params)
  if isinstance(loaded, Model):
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, quantization=fmt), params=params)
  if not quantization.is_quantized(params):
    raise ValueError(f"{where}: {loaded.drafter.kind} heads have no attention or MLP layers to quantize")
  drafter = dataclasses.replace(loaded.drafter, config=dataclasses.replace(loaded.drafter.config, quantization=fmt))
  return dataclasses.replace(loaded, drafter=drafter, params=params)


def load_shapes(path: str | pathlib.Path, dtype: str | None = None, quantize: str | None = None,
                mtp: bool = False) -> Model | Heads:
  """A model or heads with their parameters' shapes only (`jax.ShapeDtypeStruct`s), from a checkpoint
  directory (the weights are not read) or a bare `config.json` (jspec's or Hugging Face's) or
  `drafter.json`: what the memory plan needs (`jspec.planning.memory`). A model keeps the `tokenizer.json` beside its
  config, if any: a draft with another tokenizer than its target's holds more cache (`jspec.text.vocab_map`).
  `quantize`, `mtp` (an MTP layer for the model there, sharing its embedding and LM head): as `load`'s."""
  if mtp:
    drafter = MtpDrafter.for_target(_shapes(path, dtype).config)
    return quantized(Heads(drafter, jax.eval_shape(drafter.init_params, jax.random.PRNGKey(0))), quantize, path)
  return quantized(_shapes(path, dtype), quantize, path)


def _shapes(path: str | pathlib.Path, dtype: str | None) -> Model | Heads:
  dtype = dtype or default_dtype()
  if dtype not in DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
  path = shipped.resolve(path).absolute()
  found = head_formats.detect(path) if path.is_dir() and not checkpoint.is_heads_dir(path) else None
  if found is not None:  # a published head: read (they are small beside their target), then only shapes kept
    heads = head_formats.load_head(path, found, dtype)
    return dataclasses.replace(heads, params=jax.eval_shape(lambda: heads.params))
  if path.is_dir():
    path = path / (checkpoint.HEADS_FILE if checkpoint.is_heads_dir(path) else "config.json")
  fields = checkpoint.read_json(path)
  if not isinstance(fields, dict):
    raise ValueError(f"{path}: not a JSON object")
  init = jax.random.PRNGKey(0)
  if "kind" in fields:  # drafter.json
    heads_config = checkpoint.parse_config(fields.get("config", {}), dtype, path)
    if fields["kind"] not in registry.DRAFTERS:
      raise ValueError(f"{path}: unknown drafter kind {fields['kind']!r}")
    drafter = registry.drafter_class(fields["kind"]).from_metadata(heads_config, fields)
    return Heads(drafter, jax.eval_shape(drafter.init_params, init))
  try:
    config = (hf_config.config_from_hf(fields, dtype) if "model_type" in fields
              else checkpoint.parse_config(fields, dtype, path))
  except KeyError as e:
    raise ValueError(f"{path}: config without {e}") from None
  tok = tokenizer.load_tokenizer(path.parent) if (path.parent / "tokenizer.json").is_file() else None
  return Model(config, jax.eval_shape(lambda k: model.init_params(config, k), init), tokenizer=tok)
