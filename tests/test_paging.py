"""Paged KV caches (jspec/cache.py): decoding through page tables gives the tokens contiguous caches give,
for every drafter, chains and trees, greedy and sampled, and the loop holds no copy of the pool."""
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import cache as kvcache
from jspec import programs, rows, testing
from jspec.decoder import make_decoder
from jspec.request import make_batch
from jspec.settings import SamplingConfig, SpecConfig, TreeConfig

PROMPTS = [[3, 1, 4, 1, 5], list(range(2, 124)), [7] * 200]  # rows that start, cross and fill pages
NEW_TOKENS = 40


def paged(requests, seed: int = 0, spare: int = 5):
  """The requests with each row's pages scattered over a pool larger than the batch needs."""
  batch, per_row = requests.prompt_lens_B.shape[0], requests.capacity // kvcache.PAGE_SIZE
  pages = batch * per_row + spare
  table = np.random.default_rng(seed).permutation(pages)[:batch * per_row].reshape(batch, per_row)
  return requests.replace(page_table_BxR=jnp.asarray(table, jnp.int32), pages=pages)


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


def _decoder(kind: str, pair):
  target, draft = pair
  spec = {"plain": None, "model": testing.fixed_k(4), "model-adaptive": SpecConfig(4),
          "model-tree": SpecConfig(3, tree=TreeConfig(3, 8)), "ngram": testing.fixed_k(3, drafter="ngram")}
  if kind in spec:
    return make_decoder(target, None if kind in ("plain", "ngram") else draft, spec[kind], len(PROMPTS))
  heads_kind, shape = kind.split("-") if "-" in kind else (kind, None)
  heads = testing.random_draft(heads_kind, target)
  spec = (SpecConfig(3, drafter=heads_kind, tree=TreeConfig(3, 8)) if shape == "tree"
          else testing.fixed_k(3, drafter=heads_kind))
  return make_decoder(target, heads, spec, len(PROMPTS))


@pytest.mark.parametrize("kind", ["plain", "model", "model-adaptive", "model-tree", "ngram", "eagle", "eagle-tree",
                                  "medusa-tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_decoding_gives_the_contiguous_tokens(pair, kind, temperature):
  decoder = _decoder(kind, pair)
  requests = make_batch(decoder, PROMPTS, NEW_TOKENS, sampling=SamplingConfig(temperature), seed=[1, 2, 3])
  tokens, lens, _ = programs.run(decoder, requests)
  paged_tokens, paged_lens, _ = programs.run(decoder, paged(requests))
  np.testing.assert_array_equal(paged_lens, lens)
  np.testing.assert_array_equal(paged_tokens, tokens)


def test_a_segment_over_narrow_rows_reads_the_whole_pool(pair):
  """The server's narrow segments slice per-row buffers: a page table is one, the pool is not."""
  decoder = _decoder("model", pair)
  requests = paged(make_batch(decoder, PROMPTS, NEW_TOKENS))
  state = programs.start(decoder, requests)
  done = state.done_B.at[1:].set(True)
  narrow = rows.run_rows(decoder, state.replace(done_B=done), width=1)
  whole, _, _ = programs.run(decoder, requests)
  np.testing.assert_array_equal(narrow.tokens_BxT[0, :narrow.seq_lens_B[0]], whole[0, :narrow.seq_lens_B[0]])


@pytest.mark.slow  # compiled as users compile
@pytest.mark.parametrize("kind", ["model", "eagle-tree"])
def test_the_loop_holds_no_copy_of_the_pool(pair, kind):
  decoder = _decoder(kind, pair)
  requests = paged(make_batch(decoder, PROMPTS, NEW_TOKENS))
  text = programs.lower(decoder, requests).compile(compiler_options=testing.AS_USERS_COMPILE).as_text()
  for config in [decoder.target_config] + ([decoder.drafter.config] if kind == "model" else []):
    pool = requests.pages * config.n_kv_heads * kvcache.PAGE_SIZE * config.head_dim
    assert testing.loop_cache_copies(text, pool) == []
