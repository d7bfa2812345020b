"""Mixture-of-experts targets: routing per token with no token dropped, and speculation over them exact.

Parity with transformers per family (qwen3_moe, mixtral, glm4_moe) is in tests/test_hf.py; on a mesh, in
tests/mesh_worker.py.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import SpecConfig
from jspec.formats import loading
from jspec.model import model, moe
from jspec.model.config import MoeConfig, num_params

# Sigmoid routing among groups, shared experts and a first dense layer: every part of the router at once.
GROUPED = MoeConfig(experts=4, top_k=2, expert_dim=32, routing="sigmoid", scale=2.5, groups=2, top_groups=1,
                    shared_dim=32, dense_layers=(0,))
CONFIG = dataclasses.replace(testing.SMALL_VOCAB, moe=GROUPED)


@pytest.fixture(scope="module")
def target():
  return testing.random_model(CONFIG, seed=0, scale=2.0)


def dense_reference(h_TxD, layer, config):
  """Every token through each of its experts one at a time, with the weights gathered per token."""
  weights, chosen = moe.route(h_TxD, layer, config.moe)
  (gate, up), down = moe.gate_and_up(layer["we_gate_up"][chosen]), layer["we_down"][chosen]  # [T,Ok,...]
  hidden = jax.nn.silu(jnp.einsum("td,tkdf->tkf", h_TxD, gate)) * jnp.einsum("td,tkdf->tkf", h_TxD, up)
  return jnp.einsum("tk,tkf,tkfd->td", weights, hidden, down)


@pytest.mark.parametrize("routing", ["softmax", "sigmoid"])
def test_experts_compute_each_tokens_own_experts_and_drop_none(routing):
  config = dataclasses.replace(CONFIG, moe=dataclasses.replace(GROUPED, routing=routing, experts=8, groups=4,
                                                               top_groups=2, normalize=routing == "sigmoid"))
  layer = model.init_params(config, jax.random.PRNGKey(1))["layers"][1]
  h = jax.random.normal(jax.random.PRNGKey(2), (15, config.dim))
  # Every token routed to expert 0 (and one other) too: nothing is capped, so nothing changes but the choice.
  crowded = {**layer, "router": layer["router"].at[:, 0].add(100.0)}
  assert bool((moe.route(jnp.abs(h), crowded, config.moe)[1] == 0).any(-1).all())
  for x, weights in ((h, layer), (jnp.abs(h), crowded)):
    want = dense_reference(x, weights, config)
    np.testing.assert_allclose(moe.experts(x[None], weights, config.moe, jax.nn.silu)[0], want, atol=1e-5)
    routed = moe.route(x, weights, config.moe)
    for way in (moe.grouped, moe.every_expert):  # the TPU's and the other platforms'
      np.testing.assert_allclose(way(x, *routed, weights, jax.nn.silu), want, atol=1e-5)
  many = jax.random.normal(jax.random.PRNGKey(3), (moe.TOKENS_AT_ONCE + 88, config.dim))  # in two pieces
  routed = moe.route(many, layer, config.moe)
  np.testing.assert_allclose(moe.every_expert(many, *routed, layer, jax.nn.silu),
                             moe.grouped(many, *routed, layer, jax.nn.silu), atol=1e-5)


def test_a_rows_output_does_not_depend_on_the_rest_of_the_batch(target):
  """Routing is per token: a row whose tokens all go to one group's experts gives the same output alone and
  beside rows whose tokens all go to the other group (experts that hold only other rows' tokens)."""
  layer = target.params["layers"][1]
  candidates = jax.random.normal(jax.random.PRNGKey(0), (400, CONFIG.dim))
  group = moe.route(candidates, layer, CONFIG.moe)[1][:, 0] // 2
  row, others = candidates[group == 0][None, :8], candidates[group == 1][:24].reshape(3, 8, -1)
  alone = moe.experts(row, layer, CONFIG.moe, jax.nn.silu)
  batched = moe.experts(jnp.concatenate([row, others]), layer, CONFIG.moe, jax.nn.silu)[:1]
  np.testing.assert_allclose(alone, batched, atol=1e-6)
  tokens = np.random.default_rng(0).integers(0, 16, size=(6, 8))  # and through the whole model
  np.testing.assert_allclose(model.forward_full(target.params, tokens[:1], CONFIG)[0],
                             model.forward_full(target.params, tokens, CONFIG)[0][:1], atol=1e-5)


def test_quantized_experts_are_refused_in_one_line(target):
  with pytest.raises(ValueError, match="a mixture of experts in int8; jspec holds experts in float"):
    loading.quantized(target, "int8")


def test_parameter_counts_count_every_expert_and_the_active_ones():
  params = model.init_params(CONFIG, jax.random.PRNGKey(0))
  assert num_params(CONFIG) == sum(x.size for x in jax.tree.leaves(params))
  sparse = GROUPED.experts * 3 * CONFIG.dim * GROUPED.expert_dim
  assert num_params(CONFIG) - num_params(CONFIG, active=True) == sparse * (1 - GROUPED.top_k / GROUPED.experts)


def test_greedy_speculation_over_a_moe_target_is_its_plain_decoding(target):
  """Every drafter kind, chains and a draft tree: a prefill, plain steps and verifies through the experts."""
  rng = np.random.default_rng(0)
  ps = [rng.integers(0, 16, size=int(n)).tolist() for n in (3, 9, 5, 1)]
  plain = jspec.generate(target, ps, max_new_tokens=16)
  for p, ids in zip(ps, plain.token_ids):
    testing.assert_target_argmax(target, p, ids)
  for kind in testing.KINDS:
    draft = testing.random_draft(kind, target, seed=2)
    r = jspec.generate(target, ps, draft=draft, spec=testing.fixed_k(3, drafter=kind), max_new_tokens=16)
    assert r.token_ids == plain.token_ids, kind
    assert r.stats.accepted_tokens > 0 or kind == "dflash", kind  # a random DFlash block is rarely accepted here
  tree = SpecConfig(3, drafter="eagle", tree=jspec.TreeConfig(2, 6), adaptive=None)
  r = jspec.generate(target, ps, draft=testing.random_eagle3(target), spec=tree, max_new_tokens=16)
  assert r.token_ids == plain.token_ids and r.stats.accepted_tokens > 0


def test_two_tokens_over_a_moe_target_follow_its_law(target):
  tv, bound, stats = testing.two_token_tv(target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=testing.perturbed(target, 0.5),
                                          spec=testing.fixed_k(2, drafter="model"))
  assert tv < bound and 0 < stats.acceptance_rate < 1
