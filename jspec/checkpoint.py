"""jspec checkpoint directories: `config.json`, orbax `params/`, and `tokenizer.json`."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from tokenizers import Tokenizer

from jspec import model
from jspec.config import ModelConfig, default_dtype
from jspec.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class Model:
  config: ModelConfig
  params: model.Params
  tokenizer: Tokenizer


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split())[:300]


def save(m: Model, path: str | pathlib.Path, storage_dtype: str | None = None) -> None:
  """Writes a checkpoint directory; `storage_dtype="bfloat16"` halves it (load casts back to the config's)."""
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(m.config.to_json())
  m.tokenizer.save(str(path / "tokenizer.json"))
  save_params(m.params, path, storage_dtype)


def save_params(params: model.Params, path: pathlib.Path, storage_dtype: str | None = None) -> None:
  """Writes `path/params` with orbax, optionally cast to `storage_dtype`."""
  with ocp.StandardCheckpointer() as ckptr:
    params = params if storage_dtype is None else jax.tree.map(lambda x: x.astype(storage_dtype), params)
    ckptr.save(path / "params", params, force=True)
  # orbax leaves a marker that spells out the absolute path; a shipped checkpoint must not carry it.
  (path / "params" / "commit_success.txt").unlink(missing_ok=True)


def restore_params(path: pathlib.Path, init_fn, config: ModelConfig | None = None, mesh=None) -> model.Params:
  """Restores `path/params` into the structure, shapes and dtypes that `init_fn()` would produce.

  With a mesh, each array is restored straight into its shards (the rules of `jspec.sharding`, by
  `config`): no process ever holds the whole model.
  """
  abstract = jax.eval_shape(init_fn)
  if mesh is not None:
    from jspec import sharding
    shardings = sharding.named(mesh, sharding.param_specs(abstract, config, mesh))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  if not (path / "params").is_dir():
    raise ValueError(f"{path}: no params/ directory")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(path / "params", abstract)
  except Exception as e:  # orbax raises many types for missing or corrupt files
    raise ValueError(f"{path}: cannot restore parameters ({_one_line(e)})") from None
  return params if mesh is not None else jax.tree.map(jnp.asarray, params)


def read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise ValueError(f"{path.parent}: no {path.name}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON ({_one_line(e)})") from None


def load(path: str | pathlib.Path, dtype: str | None = None, mesh=None):
  """Loads a jspec checkpoint directory (a model, or drafter heads: `drafters.Heads`) or a Hugging Face
  model directory (llama, qwen2, mistral).

  Parameters and activations use `dtype`, by default fp32 on the CPU and bf16 on accelerators. With a
  `mesh` (`jspec.sharding.make_mesh`), jspec checkpoints restore directly into sharded arrays.
  Every problem is a one-line ValueError.
  """
  dtype = dtype or default_dtype()
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise ValueError(f"{path}: no such checkpoint directory")
  from jspec import hf  # hf imports this module for Model
  if hf.is_hf_dir(path):
    return hf.load_hf(path, dtype)
  from jspec import drafters  # drafters import this module for the helpers above
  if (path / drafters.HEADS_FILE).is_file():
    return drafters.load_heads(path, dtype, mesh)
  config = parse_config(read_json(path / "config.json"), dtype, path / "config.json")
  tokenizer = load_tokenizer(path)
  params = restore_params(path, lambda: model.init_params(config, jax.random.PRNGKey(0)), config, mesh)
  return Model(config=config, params=params, tokenizer=tokenizer)


def parse_config(fields: dict, dtype: str, where: pathlib.Path) -> ModelConfig:
  try:
    return ModelConfig.from_dict({**fields, "dtype": dtype})
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: invalid model config ({_one_line(e)})") from None
