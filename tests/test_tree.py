"""Draft trees: the tree attention mask against a full forward over each node's path, the path compaction
against a fresh prefill, and the verification rules' exact laws."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import DEFAULT_TREE, CostModel, SpecConfig, TreeConfig
from jspec.decoding import loop
from jspec.decoding.decoder import make_decoder
from jspec.formats import checkpoint
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import num_params
from jspec.speculation import tree

# Chunk entry 0 is the pending token; node m is entry m + 1. Three children of the pending token, two
# below the first, one below the second, one below entry 4 (depth 3).
PARENTS = [0, 0, 0, 1, 1, 2, 4]
DEPTH, WIDTH = 3, 3
FEATURES = dataclasses.replace(testing.TINY, sliding_windows=(4, 0), attn_softcap=5.0, qk_norm=True)


def _paths(parents):
  """Chunk entry i's path from the pending token: a list of entries."""
  paths = [[0]]
  for m, parent in enumerate(parents):
    paths.append(paths[parent] + [m + 1])
  return paths


def _tree_forward(config, prompts, nodes, seed=0, heads_major=False):
  m = testing.random_model(config, seed=seed)
  batch = len(prompts)
  cache = kvcache.init_cache(config, batch, 256, heads_major)
  width = max(len(p) for p in prompts)
  padded = jnp.asarray([p + [0] * (width - len(p)) for p in prompts])
  lens = jnp.asarray([len(p) for p in prompts])
  _, cache = model.prefill(m.params, config, cache, padded[:, :-1] if width > 1 else padded, lens - 1)
  parents = jnp.asarray([PARENTS] * batch)
  mask = tree.ancestors(parents, DEPTH)
  chunk = jnp.concatenate([jnp.take_along_axis(padded, (lens - 1)[:, None], axis=1), jnp.asarray(nodes)], axis=1)
  positions = (lens - 1)[:, None] + tree.depths(mask)
  logits, _, cache = model.forward(m.params, chunk, positions, cache, config, mask)
  return m, chunk, logits, cache


@pytest.mark.parametrize("config,heads_major", [(testing.TINY, False), (FEATURES, True)],
                         ids=["tiny", "window-softcap-qknorm-heads-major"])
def test_each_node_sees_exactly_its_path(config, heads_major):
  prompts = [[5, 9, 3, 7, 1], [2, 4]]
  nodes = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]]
  m, chunk, logits, _ = _tree_forward(config, prompts, nodes, heads_major=heads_major)
  for b, prompt in enumerate(prompts):
    for i, path in enumerate(_paths(PARENTS)):
      tokens = prompt[:-1] + [int(chunk[b, j]) for j in path]
      want = testing.full_logits(m, [tokens])[0, -1]
      np.testing.assert_allclose(logits[b, i], want, atol=2e-5, rtol=2e-5)


def test_ancestors_and_depths():
  mask = np.asarray(tree.ancestors(jnp.asarray([PARENTS]), DEPTH))[0]
  for i, path in enumerate(_paths(PARENTS)):
    assert set(np.flatnonzero(mask[i])) == set(path)
  assert np.asarray(tree.depths(jnp.asarray(mask[None])))[0].tolist() == [len(p) - 1 for p in _paths(PARENTS)]


def test_compacted_cache_equals_a_prefill_of_the_accepted_text():
  """After the accepted path is moved into place, the next step's logits are those of a full forward over
  the prompt and the path, for paths of every length, in both rows at once."""
  prompts = [[5, 9, 3, 7, 1], [2, 4, 6]]
  nodes = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27]]
  m, chunk, _, cache = _tree_forward(testing.TINY, prompts, nodes)
  base = jnp.asarray([len(p) - 1 for p in prompts])
  for paths in ([[0, 1, 4, 7], [0, 2, 6, 6]], [[0, 0, 0, 0], [0, 3, 3, 3]]):
    path = jnp.asarray(paths)
    accepted = jnp.asarray([len(set(p)) for p in paths])
    moved = tree.compact(cache, base, path).rewind(base + accepted)
    logits, _, _ = model.forward(m.params, jnp.asarray([[30], [31]]), (base + accepted)[:, None], moved,
                                 testing.TINY)
    for b, prompt in enumerate(prompts):
      text = prompt[:-1] + [int(chunk[b, j]) for j in dict.fromkeys(paths[b])] + [30 + b]
      want = testing.full_logits(m, [text])[0, -1]
      np.testing.assert_allclose(logits[b, 0], want, atol=2e-5, rtol=2e-5)


def test_greedy_walk_follows_the_argmax():
  vocab = 6
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 1, 2]] * 3)
  parents = jnp.asarray([PARENTS] * 3)
  # Row 0: argmax 2 at the root (node 1, entry 2), then 1 (node 5, entry 6): a leaf; bonus 4.
  # Row 1: argmax 1 (entry 1), then 4 (entry 4), then 2 (entry 7), then the bonus 0.
  # Row 2: argmax 0 at the root: nothing accepted.
  best = [[2, 0, 1, 0, 0, 0, 4, 0], [1, 4, 0, 0, 2, 0, 0, 0], [0] * 8]
  logits = jax.nn.one_hot(jnp.asarray(best), vocab)
  path, n, token = tree.verify_greedy(tokens, parents, logits, DEPTH, WIDTH)
  assert path.tolist() == [[0, 2, 6, 6], [0, 1, 4, 7], [0, 0, 0, 0]]
  assert n.tolist() == [2, 3, 0] and token.tolist() == [4, 0, 0]


VOCAB, SAMPLES = 5, 40_000


def _tables(seed, sparse):
  """The target's p and the draft's q after every prefix of up to DEPTH tokens: [V]*(k + 1) arrays."""
  rng = np.random.default_rng(seed)

  def dist(shape, zeros):
    logits = rng.normal(size=shape) * 1.5
    if zeros:  # as top-k / top-p leave them
      logits = np.where(rng.random(shape) < 0.3, -np.inf, logits)
      logits[..., 0] = np.maximum(logits[..., 0], 0.0)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)
  p = [dist((VOCAB,) * (k + 1), sparse) for k in range(DEPTH + 1)]
  q = [dist((VOCAB,) * (k + 1), False) for k in range(DEPTH + 1)]
  return p, q


def _lookup(table, prefix_SxK):
  """table[k] at each row's prefix of k tokens."""
  k = prefix_SxK.shape[1]
  return table[k][tuple(prefix_SxK.T)] if k else np.broadcast_to(table[0], (prefix_SxK.shape[0], VOCAB))


def _round_samples(rule, children_rule, p, q, seed=0):
  """SAMPLES rounds over fresh trees, each filled up to 3 tokens with direct samples from p (what the
  next rounds would emit). Children are the draft's top-k (`tree.TOP_K`) or drawn from q (`SAMPLED`)."""
  rng = np.random.default_rng(seed)
  paths = _paths(PARENTS)
  tokens = np.zeros((SAMPLES, len(PARENTS)), np.int64)
  for m, parent in enumerate(PARENTS):
    prefix = tokens[:, [e - 1 for e in paths[parent][1:]]]
    qd = _lookup(q, prefix)
    if children_rule == tree.TOP_K:
      rank = PARENTS[:m].count(parent)
      tokens[:, m] = np.argsort(-qd, axis=1, kind="stable")[:, rank]
    else:
      tokens[:, m] = (rng.random((SAMPLES, 1)) > np.cumsum(qd, axis=1)).sum(1).clip(0, VOCAB - 1)
  entry_prefix = lambda i: tokens[:, [e - 1 for e in paths[i][1:]]]
  p_chunk = np.stack([_lookup(p, entry_prefix(i)) for i in range(len(paths))], axis=1)
  q_chunk = np.stack([_lookup(q, entry_prefix(i)) for i in range(len(paths))], axis=1)
  keys = jax.random.split(jax.random.PRNGKey(seed), SAMPLES)
  path, n, token = jax.jit(tree.verify, static_argnames=("depth", "width", "rule"))(
      keys, jnp.asarray(tokens, jnp.int32), jnp.asarray([PARENTS] * SAMPLES), jnp.asarray(p_chunk, jnp.float32),
      jnp.asarray(q_chunk, jnp.float32), depth=DEPTH, width=WIDTH, rule=rule)
  path, n, token = np.asarray(path), np.asarray(n), np.asarray(token)
  out = np.zeros((SAMPLES, 3), np.int64)
  for s in range(SAMPLES):
    emitted = [int(tokens[s, e - 1]) for e in path[s, 1:n[s] + 1]] + [int(token[s])]
    while len(emitted) < 3:
      emitted.append(int(rng.choice(VOCAB, p=_lookup(p, np.asarray([emitted]))[0])))
    out[s] = emitted[:3]
  return out, n


def _tv(out, p):
  want = p[0][:, None, None] * p[1][:, :, None] * p[2]
  counts = np.zeros_like(want)
  np.add.at(counts, tuple(out.T), 1)
  return 0.5 * np.abs(counts / len(out) - want).sum(), testing.tv_bound(want.ravel(), len(out))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "masked"])
@pytest.mark.parametrize("rule", [tree.TOP_K, tree.SAMPLED])
def test_tree_verification_keeps_the_exact_law_of_three_tokens(rule, sparse):
  p, q = _tables(seed=1, sparse=sparse)
  out, n = _round_samples(rule, rule, p, q)
  tv, bound = _tv(out, p)
  assert tv < bound, (tv, bound)
  assert (n == 0).mean() > 0.01 and (n >= 2).mean() > 0.02  # shallow and deep paths are both taken


def test_the_p_minus_q_residual_is_wrong_for_top_k_children():
  """The test can fail: verifying top-k children with the sampled-children rule biases the law."""
  p, q = _tables(seed=1, sparse=False)
  out, _ = _round_samples(tree.SAMPLED, tree.TOP_K, p, q)
  tv, bound = _tv(out, p)
  assert tv > 3 * bound, (tv, bound)


# The whole loop with a tree: Medusa's static tree, EAGLE-2's and the draft model's dynamic trees.
NO_EOS = testing.NO_EOS
TREE = TreeConfig(top_k=3, nodes=10)


def _draft(kind, target, scale=2.0):
  return testing.random_draft(kind, target, heads=3, scale=scale)


@pytest.fixture(scope="module")
def target():
  return testing.random_model(NO_EOS, seed=0, scale=2.0)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "model"])
def test_greedy_tree_decoding_is_the_targets_argmax_on_a_ragged_batch(target, kind):
  draft = _draft(kind, target)
  prompts = ["def parse_args(", "x", "import numpy as np\nimport jax\n"]
  spec = SpecConfig(draft_len=3, tree=TREE)
  r = jspec.generate(target, prompts, draft=draft, max_new_tokens=24, spec=spec)
  plain = jspec.generate(target, prompts, max_new_tokens=24)
  assert r.token_ids == plain.token_ids
  for prompt, ids in zip(prompts, r.token_ids):
    testing.assert_target_argmax(target, target.tokenizer.encode(prompt).ids, ids)
  if kind != "eagle":  # random EAGLE weights propose nothing the target takes, tree or not
    chain = jspec.generate(target, prompts, draft=draft, max_new_tokens=24, spec=SpecConfig(draft_len=3, adaptive=None))
    assert r.stats.mean_accepted_length > chain.stats.mean_accepted_length  # siblings rescue rejections


def test_a_copy_of_the_target_drafting_every_candidate_accepts_the_full_depth():
  """With every candidate node kept, the target's greedy path is in the tree: each round emits depth + 1."""
  target = testing.random_model(NO_EOS, seed=0, scale=2.0)
  spec = SpecConfig(draft_len=4, tree=TreeConfig(top_k=3, nodes=3 + 3 * 9))
  r = jspec.generate(target, ["def parse_args(", "x = 1\n"], draft=target, max_new_tokens=25, spec=spec)
  assert r.stats.mean_accepted_length == 5.0 and r.stats.acceptance_rate == 1.0


def test_tree_requests_of_a_bucket_do_not_retrace(target):
  draft = _draft("eagle", target)
  spec = SpecConfig(draft_len=3, tree=TREE)
  jspec.generate(target, ["warm up"], draft=draft, max_new_tokens=10, spec=spec)
  before = dict(loop.trace_counts)
  for i, temperature in enumerate([0.0, 0.8, 1.2]):
    r = jspec.generate(target, ["abc" * (i + 1)], draft=draft, max_new_tokens=10, spec=spec,
                       temperature=temperature, top_k=i * 3, seed=i)
    assert r.stats.compile_seconds == 0.0
  assert dict(loop.trace_counts) == before


TINY_VOCAB = dataclasses.replace(testing.TINY, vocab_size=8, eos_id=None)


LAWS = [("eagle", (1.0, 0, 1.0), False), ("eagle", (0.7, 3, 1.0), False), ("eagle", (1.0, 0, 0.8), False),
        ("medusa", (0.7, 3, 1.0), False), ("model", (1.0, 0, 0.8), False),
        ("eagle", (1.0, 0, 1.0), True), ("model", (0.7, 3, 1.0), True)]


@pytest.mark.parametrize("kind,sp,sampled", LAWS, ids=[f"{k}-t{t}-topk{tk}-topp{tp}{'-sampled' * s}"
                                                       for k, (t, tk, tp), s in LAWS])
def test_tree_decoding_keeps_the_exact_two_token_law(kind, sp, sampled):
  """Top-k children, and children drawn from q (SpecInfer's rule; 6 of 3 + 9 candidates kept, so the
  keeping is tested too)."""
  target = testing.random_model(TINY_VOCAB, seed=0, scale=1.0)
  draft = _draft(kind, target, scale=1.0)
  spec = SpecConfig(draft_len=2, tree=TreeConfig(top_k=3, nodes=6, sampled=sampled))
  tv, bound, stats = testing.two_token_tv(target, [1, 5, 2], sp, 3000, draft=draft, spec=spec)
  assert tv < bound, (tv, bound)
  assert 0.05 < stats.acceptance_rate < 0.95


def test_an_unset_tree_shape_is_the_drafters_measured_one(target, tmp_path):
  shape = lambda draft, tree_config, depth=3, t=target: make_decoder(
      t, draft, SpecConfig(draft_len=depth, tree=tree_config), 1).spec.tree
  draft = _draft("model", target)
  assert (shape(draft, TreeConfig()).top_k, shape(draft, TreeConfig()).nodes) == DEFAULT_TREE  # none measured
  measured = CostModel(0.1, target_params=num_params(target.config), tree_top_k=2, tree_nodes=6)
  checkpoint.save(dataclasses.replace(draft, cost_models={"model": measured}), tmp_path / "draft")
  draft = jspec.load(tmp_path / "draft")
  assert shape(draft, TreeConfig()) == TreeConfig(2, 6)
  assert shape(draft, TreeConfig(top_k=3)) == TreeConfig(3, 6)  # what is given wins
  assert shape(draft, TreeConfig(), depth=1) == TreeConfig(2, 2)  # a depth-1 tree has only top-k nodes
  with pytest.raises(ValueError, match="makes 2 candidate nodes, fewer than the 6 asked for"):
    shape(draft, TreeConfig(nodes=6), depth=1)
  other = testing.random_model(dataclasses.replace(NO_EOS, mlp_dim=256))
  assert shape(draft, TreeConfig(), t=other) == TreeConfig(*DEFAULT_TREE)  # measured with another target
  # Medusa's static tree: the measured size, its paths from the rank prior; given choices set both.
  heads = _draft("medusa", target)
  heads = dataclasses.replace(heads, cost_models={"medusa": measured})
  assert shape(heads, TreeConfig()).choices == tree.default_choices(3, 2, 6)
  assert shape(heads, TreeConfig(choices=((0,), (2,), (0, 0)))) == TreeConfig(3, 3, ((0,), (2,), (0, 0)))
