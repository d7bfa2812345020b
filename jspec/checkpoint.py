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
  with ocp.StandardCheckpointer() as ckptr:
    params = m.params if storage_dtype is None else jax.tree.map(lambda x: x.astype(storage_dtype), m.params)
    ckptr.save(path / "params", params, force=True)
  # orbax leaves a marker that spells out the absolute path; a shipped checkpoint must not carry it.
  (path / "params" / "commit_success.txt").unlink(missing_ok=True)


def load(path: str | pathlib.Path, dtype: str | None = None) -> Model:
  """Loads a jspec checkpoint directory or a Hugging Face model directory (llama, qwen2, mistral).

  Parameters and activations use `dtype`, by default fp32 on the CPU and bf16 on accelerators.
  Every problem is a one-line ValueError.
  """
  dtype = dtype or default_dtype()
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise ValueError(f"{path}: no such checkpoint directory")
  from jspec import hf  # hf imports this module for Model
  if hf.is_hf_dir(path):
    return hf.load_hf(path, dtype)
  try:
    config = ModelConfig.from_dict({**json.loads((path / "config.json").read_text()), "dtype": dtype})
  except FileNotFoundError:
    raise ValueError(f"{path}: no config.json") from None
  except (json.JSONDecodeError, TypeError, ValueError) as e:
    raise ValueError(f"{path}/config.json: invalid model config ({_one_line(e)})") from None
  tokenizer = load_tokenizer(path)
  abstract = jax.eval_shape(lambda: model.init_params(config, jax.random.PRNGKey(0)))
  if not (path / "params").is_dir():
    raise ValueError(f"{path}: no params/ directory")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(path / "params", abstract)
  except Exception as e:  # orbax raises many types for missing or corrupt files
    raise ValueError(f"{path}: cannot restore parameters ({_one_line(e)})") from None
  return Model(config=config, params=jax.tree.map(jnp.asarray, params), tokenizer=tokenizer)
