"""jspec checkpoint directories, read and written.

A model directory holds `config.json`, orbax `params/` and `tokenizer.json`; a heads directory (Medusa or
EAGLE) holds `drafter.json` (kind and shape) and `params/`, and borrows the target's embedding, LM head and
tokenizer. Either may hold `cost_model.json`: the cost models measured with it, by drafter kind
(`jspec.core.settings.CostModel`, with the fastest measured tree shape; written by `python -m jspec.bench
--suite cost --write` and `--suite tree --write`).
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jspec.core import registry
from jspec.core.settings import CostModel
from jspec.drafters import Heads
from jspec.model import model, quantization, sharding
from jspec.model.config import ModelConfig, default_dtype
from jspec.model.model import Model
from jspec.text.tokenizer import load_chat_template, load_tokenizer, save_chat_template

HEADS_FILE = "drafter.json"
COST_FILE = "cost_model.json"


def one_line(e: Exception) -> str:
  return " ".join(str(e).split())[:300]


def read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise ValueError(f"{path.parent}: no {path.name}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON ({one_line(e)})") from None


def is_heads_dir(path: pathlib.Path) -> bool:
  return (pathlib.Path(path) / HEADS_FILE).is_file()


def save(m: Model, path: str | pathlib.Path, storage_dtype: str | None = None) -> None:
  """Writes a model directory; `storage_dtype="bfloat16"` halves it (load casts back to the config's)."""
  path = _make_dir(path)
  (path / "config.json").write_text(m.config.to_json())
  m.tokenizer.save(str(path / "tokenizer.json"))
  save_chat_template(m.chat_template, path)
  _save_params(m.params, path, storage_dtype)
  write_cost_models(path, m.cost_models)


def save_heads(heads: Heads, path: str | pathlib.Path, storage_dtype: str | None = None) -> None:
  path = _make_dir(path)
  d = heads.drafter
  meta = {"kind": d.kind, "config": json.loads(d.config.to_json()), **d.metadata()}
  (path / HEADS_FILE).write_text(json.dumps(meta, indent=2) + "\n")
  _save_params(heads.params, path, storage_dtype)
  write_cost_models(path, heads.cost_models)


def load_model(path: str | pathlib.Path, dtype: str | None = None, mesh=None) -> Model:
  """A model directory; with a `mesh`, parameters restore straight into their shards."""
  path = pathlib.Path(path).absolute()
  config = parse_config(read_json(path / "config.json"), dtype, path / "config.json")
  tokenizer = load_tokenizer(path)
  params = _restore_params(path, lambda: model.init_params(config, jax.random.PRNGKey(0)), config, mesh)
  return Model(config=config, params=params, tokenizer=tokenizer, cost_models=read_cost_models(path),
               chat_template=load_chat_template(path))


def load_heads(path: str | pathlib.Path, dtype: str | None = None, mesh=None) -> Heads:
  path = pathlib.Path(path).absolute()
  meta = read_json(path / HEADS_FILE)
  config = parse_config(meta.get("config", {}), dtype, path / HEADS_FILE)
  kind = meta.get("kind")
  if kind not in registry.DRAFTERS:
    raise ValueError(f"{path / HEADS_FILE}: unknown drafter kind {kind!r}")
  try:
    drafter = registry.drafter_class(kind).from_metadata(config, meta)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path / HEADS_FILE}: invalid {kind} heads ({one_line(e)})") from None
  init = lambda: quantization.quantize_params(drafter.init_params(jax.random.PRNGKey(0)), config.quantization)
  params = _restore_params(path, init, config, mesh)
  return Heads(drafter, params, read_cost_models(path))


def read_cost_models(path: pathlib.Path) -> dict[str, CostModel]:
  """`cost_model.json` of a checkpoint directory, by drafter kind; {} when it has none."""
  if not (path / COST_FILE).is_file():
    return {}
  try:
    return {kind: CostModel(**fields) for kind, fields in read_json(path / COST_FILE).items()}
  except (TypeError, ValueError, AttributeError) as e:
    raise ValueError(f"{path / COST_FILE}: invalid cost model ({one_line(e)})") from None


def write_cost_models(path: pathlib.Path, cost_models: dict[str, CostModel]) -> None:
  if cost_models:
    fields = {kind: c.to_json() for kind, c in sorted(cost_models.items())}
    (pathlib.Path(path) / COST_FILE).write_text(json.dumps(fields, indent=2) + "\n")


def _make_dir(path: str | pathlib.Path) -> pathlib.Path:
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  return path


def _save_params(params: model.Params, path: pathlib.Path, storage_dtype: str | None = None) -> None:
  """Writes `path/params` with orbax, optionally cast to `storage_dtype`."""
  with ocp.StandardCheckpointer() as ckptr:
    # ids stay ids; quantized weights stay as they are
    cast = lambda x: x if quantization.is_qarray(x) or not jnp.issubdtype(x.dtype, jnp.floating) \
        else x.astype(storage_dtype)
    params = params if storage_dtype is None else jax.tree.map(cast, params, is_leaf=quantization.is_qarray)
    ckptr.save(path / "params", params, force=True)
  # orbax leaves a marker that spells out the absolute path; a shipped checkpoint must not carry it.
  (path / "params" / "commit_success.txt").unlink(missing_ok=True)


def _restore_params(path: pathlib.Path, init_fn: Callable[[], Any], config: ModelConfig, mesh=None) -> Any:
  """Restores `path/params` into the structure, shapes and dtypes that `init_fn()` would produce.

  With a mesh, each array is restored straight into its shards (the rules of `jspec.model.sharding`, by
  `config`): no process ever holds the whole model.
  """
  abstract = jax.eval_shape(init_fn)
  if mesh is not None:
    shardings = sharding.named(mesh, sharding.param_specs(abstract, config, mesh))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  if not (path / "params").is_dir():
    raise ValueError(f"{path}: no params/ directory")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      params = ckptr.restore(path / "params", abstract)
  except Exception as e:  # orbax raises many types for missing or corrupt files
    raise ValueError(f"{path}: cannot restore parameters ({one_line(e)})") from None
  return params if mesh is not None else jax.tree.map(jnp.asarray, params)


def parse_config(fields: dict, dtype: str | None, where: pathlib.Path) -> ModelConfig:
  try:
    return ModelConfig.from_dict({**fields, "dtype": dtype or default_dtype()})
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: invalid model config ({one_line(e)})") from None
