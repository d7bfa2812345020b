"""The cached forward equals the full forward, whatever the chunking and however ragged the batch."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import testing
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import RopeScaling, num_params


def _check_chunks(config, chunk, batch, capacity, prompt_lens, total, seed=0, heads_major=False):
  params = model.init_params(config, jax.random.PRNGKey(seed))
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, total), 0, config.vocab_size)
  full_logits, full_hidden = model.forward_full(params, tokens, config)
  lens = np.asarray(prompt_lens, np.int32)
  width = int(lens.max())
  cache = kvcache.init_cache(config, batch, capacity, heads_major)
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  logits, _, cache = model.forward(params, tokens[:, :width], positions, cache, config)
  for b in range(batch):  # prefill of right-padded prompts: each row's real positions match
    np.testing.assert_allclose(logits[b, :lens[b]], full_logits[b, :lens[b]], atol=1e-5, rtol=1e-5)
  cache = cache.rewind(jnp.asarray(lens))
  step = jax.jit(lambda c, t, p: model.forward(params, t, p, c, config))
  while int(lens.max()) + chunk <= total:
    pos = lens[:, None] + np.arange(chunk)
    chunk_tokens = np.take_along_axis(np.asarray(tokens), pos, axis=1)
    logits, hidden, cache = step(cache, chunk_tokens, pos)
    for b in range(batch):
      np.testing.assert_allclose(logits[b], full_logits[b, pos[b]], atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(hidden[b], full_hidden[b, pos[b]], atol=1e-5, rtol=1e-5)
    lens = lens + chunk
    np.testing.assert_array_equal(cache.lengths, lens)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_cache_matches_full_forward_ragged(chunk):
  # 150 tokens cross the first attention block (128 slots), so the blocked loop is exercised too.
  _check_chunks(testing.TINY, chunk, batch=3, capacity=256, prompt_lens=[7, 1, 130], total=150)


@pytest.mark.parametrize("heads_major", [False, True])
def test_cache_matches_full_forward_scatter_path_and_qkv_bias_untied(heads_major):
  config = dataclasses.replace(testing.TINY, qkv_bias=True, tie_embeddings=False, n_kv_heads=4)
  batch = kvcache.MAX_UNROLLED_ROWS + 1
  _check_chunks(config, 3, batch=batch, capacity=128, prompt_lens=list(range(1, batch + 1)), total=40,
                heads_major=heads_major)


# Every family feature at once: sliding windows (one layer windowed, one global), soft-caps, a query scale,
# q/k norms, sandwich (1 + w) norms, GeGLU, scaled embeddings, partial rotary with YaRN scaling.
FEATURES = dataclasses.replace(
    testing.TINY, sliding_windows=(8, 0), attn_softcap=5.0, final_softcap=3.0, query_scale=24.0, qk_norm=True,
    sandwich_norms=True, norm_plus_one=True, activation="gelu_tanh", scale_embeddings=True,
    partial_rotary_factor=0.5, rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=32),
    local_rope_theta=100.0)


@pytest.mark.parametrize("chunk", [1, 3])
def test_cache_matches_full_forward_with_every_family_feature(chunk):
  # Rows past 136 tokens: the windowed layer skips the blocks no query can see.
  _check_chunks(FEATURES, chunk, batch=3, capacity=512, prompt_lens=[140, 137, 150], total=175)
  _check_chunks(FEATURES, chunk, batch=2, capacity=256, prompt_lens=[3, 12], total=30)


def test_sliding_window_mask_attends_to_the_last_w_positions_only():
  """A brute-force check of the window: each position's output equals attention over its last W tokens."""
  config = dataclasses.replace(testing.TINY, n_layers=1, sliding_windows=(4,))
  params = model.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 12), 0, config.vocab_size)
  windowed, _ = model.forward_full(params, tokens, config)
  full = dataclasses.replace(config, sliding_windows=())
  for t in range(12):  # position t alone with its last 4 tokens, shifted to their own positions
    start = max(0, t - 3)
    positions = jnp.arange(start, t + 1)[None]
    hidden = model.trunk(params, tokens[:, start:t + 1], positions, full, model.full_attention(full))
    want = model.logits_from_hidden(params, hidden, full)[0, -1]
    np.testing.assert_allclose(windowed[0, t], want, atol=1e-5, rtol=1e-5)


def test_heads_major_cache_matches_full_forward():
  # The row order a mesh uses when it splits kv heads (row k*B + b): per-row updates and attention.
  _check_chunks(testing.TINY, 2, batch=3, capacity=256, prompt_lens=[7, 1, 130], total=150, heads_major=True)


def test_rollback_is_only_a_length():
  config = testing.TINY
  params = model.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 20), 0, config.vocab_size)
  cache = kvcache.init_cache(config, 1, 128)
  pos = jnp.arange(20)[None]
  _, _, cache = model.forward(params, tokens, pos, cache, config)
  junk = jnp.full((1, 4), 3)
  _, _, dirty = model.forward(params, junk, pos[:, 10:14], cache.rewind(jnp.asarray([10])), config)
  # After rewinding past the junk, a fresh chunk sees exactly the original prefix.
  a, _, _ = model.forward(params, tokens[:, 10:12], pos[:, 10:12], dirty.rewind(jnp.asarray([10])), config)
  full, _ = model.forward_full(params, tokens, config)
  np.testing.assert_allclose(a[0], full[0, 10:12], atol=1e-5, rtol=1e-5)


def test_num_params_matches_tree():
  for config in [testing.TINY, dataclasses.replace(testing.TINY, qkv_bias=True, tie_embeddings=False), FEATURES]:
    params = model.init_params(config, jax.random.PRNGKey(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == num_params(config)


def test_round_capacity_is_a_block_multiple_that_fits_closely_in_few_shapes():
  for tokens in [1, 127, 128, 129, 300, 1000, 1025, 4097, 8192 + 20, 100_000]:
    cap = kvcache.round_capacity(tokens)
    assert cap >= tokens and cap % kvcache.BLOCK_SIZE == 0
    assert cap <= max(tokens * 1.125, kvcache.BLOCK_SIZE) + kvcache.BLOCK_SIZE  # a block past 12.5% at most
  assert kvcache.round_capacity(8192 + 20) == 9216
  shapes = {kvcache.round_capacity(t) for t in range(1, 2 ** 17, 7)}
  assert len(shapes) <= 8 + 8 * 10  # 8 exact, then 8 per doubling
