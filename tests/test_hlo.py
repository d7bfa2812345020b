"""The compiled decode loops never copy a whole KV-cache buffer (see jspec/model/cache.py)."""
import dataclasses

import jax
import pytest

from jspec import drafters, testing
from jspec.core.settings import AdaptiveConfig, CostModel, SpecConfig, TreeConfig
from jspec.decoding import programs
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import Decoder, make_decoder
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.speculation import tree

pytestmark = pytest.mark.slow  # programs compiled as users compile them

CONFIG = testing.NO_EOS
DRAFT = dataclasses.replace(testing.TINY_DRAFT, eos_id=None)


def _decoder_and_batch(batch, kind, capacity=512):
  target = testing.random_model(CONFIG)
  draft = testing.random_model(DRAFT, seed=1)
  medusa = testing.random_heads(drafters.MedusaDrafter(CONFIG, 3))
  eagle = testing.random_heads(drafters.EagleDrafter.for_target(CONFIG))
  adaptive_spec = SpecConfig(4, adaptive=AdaptiveConfig().with_costs(CostModel.neutral(), 1, 4))
  drafter, draft_params, spec = {
      "autoregressive": (None, None, None),
      "model": (drafters.ModelDrafter(DRAFT), draft.params, SpecConfig(4, adaptive=None)),
      # Adaptive rounds pick a branch per round (plain step or K), and the draft catches up after plain
      # steps with a wider forward: branches that write caches, which XLA:CPU must not copy.
      "model-adaptive": (drafters.ModelDrafter(DRAFT, lag=17), draft.params, adaptive_spec),
      # The EAGLE head's own cache and feature buffer ride through every branch too.
      "eagle-adaptive": (eagle.drafter, eagle.params, adaptive_spec),
      # A tree round gathers the accepted path's K/V into place: in place too.
      "medusa-tree": (medusa.drafter, medusa.params,
                      SpecConfig(3, tree=TreeConfig(3, 8, tree.default_choices(3, 3, 8)))),
      # The draft model grows its tree in its own cache, and catches up on the accepted path after.
      "model-tree": (drafters.ModelDrafter(DRAFT, lag=3), draft.params, SpecConfig(3, tree=TreeConfig(3, 8))),
  }[kind]
  # The target's head made explicit, as `make_decoder` does: the program that runs.
  decoder = Decoder(model.with_head(target.params), draft_params, target_config=CONFIG, drafter=drafter,
                           spec=spec)
  return decoder, make_batch(decoder, [[0, 0, 0]] * batch, 8, capacity_slots=capacity)


def as_users_compile(lowered) -> str:
  """The optimized HLO of a lowered program as users compile it (not with the tests' fast-compile options)."""
  return lowered.compile(compiler_options=testing.AS_USERS_COMPILE).as_text()


def _hlo(batch, kind, capacity=512):
  return as_users_compile(programs.lower(*_decoder_and_batch(batch, kind, capacity)))


# Each way a loop writes a cache: a row's in-place update (a few rows) or one scatter (many), the adaptive
# branches (a draft model's catch-up, an EAGLE head's cache and features), a tree's compaction, a draft
# model growing its tree in its own cache.
@pytest.mark.parametrize("batch,kind", [(4, "autoregressive"), (kvcache.MAX_UNROLLED_ROWS + 2, "model")] + [
    (4, k) for k in ("model-adaptive", "eagle-adaptive", "medusa-tree", "model-tree")])
def test_no_full_cache_copy_in_loop_body(batch, kind):
  capacity = 512
  text = _hlo(batch, kind, capacity)
  # The EAGLE head's cache has the target's shape: CONFIG's size covers it.
  for config in [CONFIG] + ([DRAFT] if kind.startswith("model") else []):
    elements = batch * config.n_kv_heads * capacity * config.head_dim
    assert testing.loop_cache_copies(text, elements) == []


def test_constraint_tables_are_not_copied_in_the_loop():
  """Each row's automaton tables ride in the loop state like a cache: read by gathers, never copied."""
  import jspec
  from jspec.text import constraints
  decoder, _ = _decoder_and_batch(4, "model-adaptive")
  vocabulary = constraints.Vocabulary.of(testing.random_model(CONFIG).tokenizer, [256], CONFIG.vocab_size)
  tables = constraints.compile(jspec.Regex("[a-z]{1,40}"), vocabulary)
  batch = make_batch(decoder, [[0, 0, 0]] * 4, 8, capacity_slots=512, constraints=[tables] * 4,
                           constraint_shape=(128, 24))
  text = as_users_compile(programs.lower(decoder, batch))
  assert testing.loop_cache_copies(text, 4 * 128 * 24) == []


def test_segments_update_the_donated_state_in_place():
  """The segment loop (streaming) copies no cache either, and inserting a prompt into a running batch
  writes into the donated state's buffers."""
  import jax.numpy as jnp

  capacity, rows = 512, 4
  decoder, batch = _decoder_and_batch(rows, "model", capacity)
  state = programs.start(decoder, batch)
  for width in (rows, 2):  # every row, and the narrower program a few busy rows run
    segment = as_users_compile(programs.segment.lower(decoder, state, jnp.int32(8), jnp.asarray(True),
                                                      jnp.zeros(rows, bool), width=width))
    for config in (CONFIG, DRAFT):
      assert testing.loop_cache_copies(segment, width * config.n_kv_heads * capacity * config.head_dim) == []
  one = jax.tree.map(lambda x: x[:1], batch)
  insert = as_users_compile(programs.insert.lower(decoder, state, one, jnp.int32(2)))
  assert "input_output_alias" in insert.splitlines()[0]


@pytest.mark.parametrize("kind", ["model", "eagle", "medusa", "ngram"])
def test_no_weight_is_copied_in_the_loop(kind):
  """The decoder `make_decoder` builds carries the target's weights as the loop reads them (a head tied to
  the embedding made explicit once): no round copies or transposes a matrix of the target's, or of a head
  drafter's. A draft model's tied head is read as `embed.T`: at batch 1 XLA transposes it in the loop,
  which measured no slower here, and an explicit copy would cost a whole vocabulary matrix of memory; the
  check finds that one, so it does see a matrix read in the loop."""
  target = testing.random_model(CONFIG)
  # A draft model of its own width, so that its matrices are not the target's shapes.
  draft = testing.random_model(DRAFT, seed=1) if kind == "model" else testing.random_draft(kind, target)
  decoder = make_decoder(target, draft, testing.fixed_k(4, drafter=kind), 1)
  text = as_users_compile(programs.lower(decoder, make_batch(decoder, [[0, 0, 0]], 8)))
  assert testing.loop_weight_copies(text, decoder.target_params) == []
  if kind == "model":
    assert "lm_head" not in decoder.drafter_params
    assert testing.loop_weight_copies(text, decoder.drafter_params) != []
  else:
    assert testing.loop_weight_copies(text, decoder.drafter_params) == []


def test_detector_finds_a_copy():
  # The layout the issue started from: a [B, T, K, Dh] buffer written by a vmapped update and read by an
  # einsum makes XLA copy the whole buffer; the detector must see it.
  import jax.numpy as jnp
  from jax import lax

  def step(carry):
    i, k_BxTxKxDh = carry
    k_BxTxKxDh = jax.vmap(lambda b, n: lax.dynamic_update_slice(b, jnp.ones((1, 2, 16)), (n, 0, 0)))(
        k_BxTxKxDh, jnp.full((1,), i))
    s = jnp.einsum("bqhd,bthd->bhqt", jnp.ones((1, 1, 2, 16)), k_BxTxKxDh)
    return i + 1, k_BxTxKxDh + s.sum() * 0
  text = as_users_compile(jax.jit(lambda k: lax.while_loop(lambda c: c[0] < 10, step, (0, k))).lower(
      jnp.zeros((1, 512, 2, 16))))
  assert testing.loop_cache_copies(text, 512 * 2 * 16)
