"""Tiny random models for tests and smoke runs."""
from __future__ import annotations

import dataclasses

import jax

from jspec import model
from jspec.checkpoint import Model
from jspec.config import ModelConfig
from jspec.tokenizer import byte_tokenizer

TINY = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                   rope_theta=10000.0, max_seq_len=1024, eos_id=256)
TINY_DRAFT = dataclasses.replace(TINY, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=64)


def random_model(config: ModelConfig = TINY, seed: int = 0, scale: float = 1.0) -> Model:
  """A random model with the byte tokenizer. `scale` multiplies the embeddings: larger means peakier."""
  params = model.init_params(config, jax.random.PRNGKey(seed))
  params["embed"] = params["embed"] * scale
  return Model(config=config, params=params, tokenizer=byte_tokenizer())


def perturbed(m: Model, noise: float, seed: int = 1) -> Model:
  """A copy of `m` with Gaussian noise on every weight: a draft that agrees with it only partly."""
  leaves, treedef = jax.tree.flatten(m.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + noise * x.std() * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return dataclasses.replace(m, params=jax.tree.unflatten(treedef, noisy))
