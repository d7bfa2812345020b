"""A drafter defined here alone, with nothing in jspec/ changed, decodes like the built-in ones: the drafter
interface and the registry are the whole extension point."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import drafters, testing
from jspec.core import registry
from jspec.drafters.base import draft_chain
from jspec.model import model

CONFIG = testing.SMALL_VOCAB


@registry.register
@dataclasses.dataclass(frozen=True)
class BigramDrafter(drafters.Drafter):
  """Drafts from a table of next-token logits indexed by the previous token (its weights, [V, V])."""
  vocab_size: int
  kind = "bigram"
  config = None

  def propose(self, weights, state, context, keys_KxBx2):
    last_B = jnp.take_along_axis(context.tokens_BxT, context.seq_lens_B[:, None] - 1, axis=1)[:, 0]
    table_VxV = weights.drafter
    return draft_chain(lambda carry, token_B: (carry, table_VxV[token_B]), None, table_VxV[last_B], keys_KxBx2,
                       context)


@pytest.fixture(scope="module")
def pair():
  target = testing.random_model(CONFIG, seed=0, scale=2.0)
  # Each token's row: the target's logits after that token alone, so drafts are often right.
  tokens = jnp.arange(CONFIG.vocab_size)[:, None]
  table = model.forward_full(target.params, tokens, CONFIG)[0][:, 0]
  return target, drafters.Heads(BigramDrafter(CONFIG.vocab_size), table)


def test_a_drafter_defined_outside_jspec_decodes_the_targets_greedy_tokens(pair):
  target, heads = pair
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CONFIG.vocab_size, size=int(n)).tolist() for n in (1, 5, 11)]
  plain = jspec.generate(target, prompts, max_new_tokens=16)
  spec = jspec.SpecConfig(draft_len=3, adaptive=None)
  r = jspec.generate(target, prompts, draft=heads, spec=spec, max_new_tokens=16)
  assert r.stats.drafter == "bigram" and r.stats.accepted_tokens > 0
  assert r.token_ids == plain.token_ids
  for p, ids in zip(prompts, r.token_ids):
    testing.assert_target_argmax(target, p, ids)


def test_it_keeps_the_exact_two_token_law(pair):
  target, heads = pair
  tv, bound, stats = testing.two_token_tv(target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=heads,
                                          spec=jspec.SpecConfig(draft_len=2, adaptive=None))
  assert stats.drafted_tokens > 0
  assert tv < bound


def test_what_it_cannot_do_is_a_one_line_error(pair):
  target, heads = pair
  with pytest.raises(ValueError, match="bigram drafter drafts chains only"):
    jspec.generate(target, [[1, 2]], draft=heads, spec=jspec.SpecConfig(tree=jspec.TreeConfig()))
  with pytest.raises(ValueError, match="already registered"):
    registry.register(type("Other", (BigramDrafter,), {}))
