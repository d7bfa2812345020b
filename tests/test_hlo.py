"""The compiled decode loops never copy a whole KV-cache buffer (see jspec/cache.py)."""
import dataclasses

import numpy as np
import pytest

from jspec import cache as kvcache
from jspec import decode, drafters, engine, testing
from jspec.settings import AdaptiveConfig, CostModel, SpecConfig

CONFIG = dataclasses.replace(testing.TINY, eos_id=None)
DRAFT = dataclasses.replace(testing.TINY_DRAFT, eos_id=None)


def _hlo(batch, kind, capacity=512):
  target = testing.random_model(CONFIG)
  draft = testing.random_model(DRAFT, seed=1)
  adaptive_spec = SpecConfig(4, adaptive=AdaptiveConfig().with_costs(CostModel.neutral("model")))
  drafter, draft_params, spec = {
      "autoregressive": (None, None, None),
      "model": (drafters.ModelDrafter(DRAFT), draft.params, SpecConfig(4)),
      # Adaptive rounds pick a branch per round (plain step or K), and the draft catches up after plain
      # steps with a wider forward: branches that write caches, which XLA:CPU must not copy.
      "model-adaptive": (drafters.ModelDrafter(DRAFT, max_lag=17), draft.params, adaptive_spec),
      "ngram-adaptive": (drafters.NgramDrafter(CONFIG.vocab_size, 3), None, adaptive_spec),
  }[kind]
  decoder = decode.Decoder(target.params, draft_params, target_config=CONFIG, drafter=drafter, spec=spec)
  requests = decode.Requests(np.zeros((batch, 16), np.int32), np.full((batch,), 3, np.int32),
                             np.full((batch,), 8, np.int32), engine.as_sampling(0.0, 0, 1.0, batch),
                             np.arange(batch, dtype=np.uint32), np.full((batch, 1), -1, np.int32))
  return engine.lower(decoder, requests, capacity).compile().as_text()


@pytest.mark.parametrize("batch,kind", [
    (b, k) for b in (1, 4, kvcache.MAX_UNROLLED_ROWS + 2) for k in ("autoregressive", "model")] + [
    (4, k) for k in ("model-adaptive", "ngram-adaptive")])
def test_no_full_cache_copy_in_loop_body(batch, kind):
  capacity = 512
  text = _hlo(batch, kind, capacity)
  for config in [CONFIG] + ([DRAFT] if kind.startswith("model") else []):
    elements = batch * config.n_kv_heads * capacity * config.head_dim
    assert testing.loop_cache_copies(text, elements) == []


def test_detector_finds_a_copy():
  # The layout the issue started from: a [B, T, K, Dh] buffer written by a vmapped update and read by an
  # einsum makes XLA copy the whole buffer; the detector must see it.
  import jax
  import jax.numpy as jnp
  from jax import lax

  def step(carry):
    i, k_BxTxKxDh = carry
    k_BxTxKxDh = jax.vmap(lambda b, n: lax.dynamic_update_slice(b, jnp.ones((1, 2, 16)), (n, 0, 0)))(
        k_BxTxKxDh, jnp.full((1,), i))
    s = jnp.einsum("bqhd,bthd->bhqt", jnp.ones((1, 1, 2, 16)), k_BxTxKxDh)
    return i + 1, k_BxTxKxDh + s.sum() * 0
  text = jax.jit(lambda k: lax.while_loop(lambda c: c[0] < 10, step, (0, k))).lower(
      jnp.zeros((1, 512, 2, 16))).compile().as_text()
  assert testing.loop_cache_copies(text, 512 * 2 * 16)
