"""Tiny random models for tests and smoke runs."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, models

from jspec import drafters
from jspec.api import generate
from jspec.core import registry
from jspec.core.settings import SpecConfig
from jspec.model import model
from jspec.model.config import ModelConfig
from jspec.model.model import Model
from jspec.speculation import sampling
from jspec.text.tokenizer import EOS_TOKEN, byte_tokenizer

TINY = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                   rope_theta=10000.0, max_seq_len=1024, eos_id=256)
TINY_DRAFT = dataclasses.replace(TINY, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=64)
NO_EOS = dataclasses.replace(TINY, eos_id=None)  # every row decodes all its new tokens
SMALL_VOCAB = dataclasses.replace(TINY, vocab_size=16, eos_id=None)  # drafts are often right by chance
KINDS = registry.kinds()
# The XLA options the tests' fast compile (tests/conftest.py) changes, as users compile: for the checks that
# read a compiled program itself (its HLO, its memory), so that they check the programs users run.
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True}


def fixed_k(draft_len: int = 4, **kw) -> SpecConfig:
  """Speculation with K drafted every round (adaptive K chooses K for the whole batch, so a sampled row's
  tokens would depend on its neighbours)."""
  return SpecConfig(draft_len, adaptive=None, **kw)


def simulated_devices_env(devices: int) -> dict[str, str]:
  """The environment of a subprocess whose JAX sees `devices` simulated CPU devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}


def measured_here() -> dict[str, str]:
  """The `CostModel` fields of figures measured on the devices here (`jspec.planning.calibration`)."""
  backend, device_kind = jax.default_backend(), jax.devices()[0].device_kind
  return dict(backend=backend, device_kind=device_kind)


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


def random_heads(drafter, seed: int = 0, scale: float = 0.5) -> drafters.Heads:
  """Medusa or EAGLE heads with random weights: `scale` times a unit normal on top of their init."""
  params = drafter.init_params(jax.random.PRNGKey(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  noisy = [x + scale * x.shape[-1] ** -0.5 * jax.random.normal(k, x.shape, x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]
  return drafters.Heads(drafter, jax.tree.unflatten(treedef, noisy))


def random_pair(config: ModelConfig = NO_EOS, noise: float = 0.5) -> tuple[Model, Model]:
  """A peaky random target and a draft model that agrees with it only partly (its perturbed copy)."""
  target = random_model(config, seed=0, scale=2.0)
  return target, perturbed(target, noise)


def random_draft(kind: str, target: Model, seed: int = 1, heads: int = 5, scale: float = 0.5,
                 noise: float = 0.5) -> Model | drafters.Heads | None:
  """A random drafter of `kind` for `target`: a perturbed copy (a draft model), random heads (`heads` of
  them where the kind has several), or None (a drafter without weights)."""
  cls = registry.drafter_class(kind)
  if cls.is_draft_model:
    return perturbed(target, noise, seed=seed)
  if not cls.needs_weights:
    return None
  return random_heads(cls.for_training(target.config, {"num_heads": heads}), seed, scale)


def random_eagle3(target: Model, seed: int = 1, scale: float = 0.5, draft_vocab: int | None = None) -> drafters.Heads:
  """A random EAGLE-3 head for `target`: it reads the default low, middle and high layers, and drafts over
  `draft_vocab` tokens (default: all) chosen at random."""
  layers = drafters.eagle_formats.default_feature_layers(target.config.n_layers)
  drafter = drafters.EagleDrafter.for_target(target.config, feature_layers=layers, draft_vocab=draft_vocab)
  counts = np.random.default_rng(seed).permutation(target.config.vocab_size)
  _, frozen = drafter.training_init(jax.random.PRNGKey(seed), target.params, counts)
  return drafters.Heads(drafter, {**random_heads(drafter, seed, scale).params, **frozen})


def char_tokenizer(tokens: list[str], merges: list[tuple[str, str]] = ()) -> Tokenizer:
  """A BPE tokenizer over exactly `tokens` (single characters and the results of `merges`), with no
  pre-tokenizer: tiny vocabularies whose overlap a test chooses."""
  return Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=list(merges)))


def renamed_vocab(m: Model, split: int, added: int, seed: int = 0) -> Model:
  """`m` under another vocabulary: the same weights with every id moved, `split` merged tokens removed
  (their text is then spelled by the pieces they merge) and `added` new merged tokens (random embeddings).
  Where the two tokenizations of a text agree, it computes exactly `m`'s distributions."""
  spec = json.loads(m.tokenizer.to_str())
  vocab, merges = spec["model"]["vocab"], [tuple(x.split(" ")) if isinstance(x, str) else tuple(x)
                                            for x in spec["model"]["merges"]]
  rng = np.random.default_rng(seed)
  inputs = {t for pair in merges for t in pair}
  leaves = [a + b for a, b in merges if a + b not in inputs]
  removed = set(rng.choice(leaves, split, replace=False).tolist())
  merges = [(a, b) for a, b in merges if a + b not in removed]
  kept = [t for t in sorted(vocab, key=vocab.get) if t not in removed]
  new = []
  while len(new) < added:
    a, b = rng.choice(kept, 2).tolist()
    if a + b not in vocab and a + b not in new and EOS_TOKEN not in (a, b):
      new.append(a + b)
      merges.append((a, b))
  order = rng.permutation(len(kept) + len(new))
  new_id = {t: int(order[i]) for i, t in enumerate(kept + new)}
  spec["model"]["vocab"], spec["model"]["merges"] = new_id, [[a, b] for a, b in merges]
  for token in spec["added_tokens"]:
    token["id"] = new_id[token["content"]]
  config = dataclasses.replace(m.config, vocab_size=len(new_id), eos_id=None if m.config.eos_id is None
                               else new_id[m.tokenizer.id_to_token(m.config.eos_id)])
  params = dict(m.params)
  rows = np.asarray(jax.random.normal(jax.random.PRNGKey(seed), (len(new_id), m.config.dim))) * float(
      np.asarray(m.params["embed"]).std())
  rows[[new_id[t] for t in kept]] = np.asarray(m.params["embed"])[[vocab[t] for t in kept]]
  params["embed"] = jnp.asarray(rows, m.params["embed"].dtype)
  if "lm_head" in params:
    cols = np.zeros((m.config.dim, len(new_id)), np.float32)
    cols[:, [new_id[t] for t in kept]] = np.asarray(m.params["lm_head"])[:, [vocab[t] for t in kept]]
    params["lm_head"] = jnp.asarray(cols, m.params["lm_head"].dtype)
  return Model(config, params, Tokenizer.from_str(json.dumps(spec)))


_forward_full = jax.jit(model.forward_full, static_argnums=(2, 3))


# Cached attention cases (`attention_case`): ragged rows of S new queries over a 384-slot cache (3 blocks),
# grouped-query heads; a prefill of 600 queries a row spans several of a kernel's query tiles.
ATTENTION_HEAD_DIM = 16  # the head dim of every `ATTENTION_CASES` entry
ATTENTION_CASES = {
    "chain": dict(),
    "step": dict(seq=1, lengths=(0, 383)),
    "window": dict(window=64, lengths=(100, 250)),
    "softcap": dict(softcap=5.0, scale=0.3),
    "tree": dict(tree=True),
    "tree-window": dict(tree=True, window=40, lengths=(90, 200)),
    "heads-major": dict(heads_major=True),
    "mha": dict(heads=2, kv_heads=2, seq=4),
    "prefill": dict(seq=300, lengths=(0, 60), window=100),
    "paged": dict(paged=True),
    "paged-tree": dict(tree=True, paged=True, lengths=(130, 250)),
    "paged-prefill": dict(seq=200, lengths=(0, 60), paged=True),
}


def _ancestors(batch: int, seq: int, entries: int, rng) -> np.ndarray:
  """Random trees: entry e's parent is an earlier entry; each of the last `seq` entries sees its ancestors."""
  parent = [-1] + [int(rng.integers(0, e)) for e in range(1, entries)]
  mask = np.zeros((batch, seq, entries), bool)
  for i, e in enumerate(range(entries - seq, entries)):
    while e >= 0:
      mask[:, i, e], e = True, parent[e]
  return mask


def attention_case(kernel, dtype, seq=3, heads=4, kv_heads=2, lengths=(5, 200), window=0, softcap=None,
                   scale=None, tree=False, heads_major=False, paged=False) -> jax.Array:
  """`attention.cached_attention` of random queries over a random cache (an `ATTENTION_CASES` entry) with
  `kernel` (None: the reference), in fp32. The inputs are drawn in fp32 and cast to `dtype`. `paged`: the
  same cache as a pool of pages in a shuffled order, read through a page table."""
  from jspec.model import attention
  batch, head_dim, capacity = len(lengths), ATTENTION_HEAD_DIM, 384
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim)).astype(dtype)
  k = jax.random.normal(kk, (batch * kv_heads, capacity, head_dim)).astype(dtype)
  v = jax.random.normal(kv, (batch * kv_heads, capacity, head_dim)).astype(dtype)
  mask = jnp.asarray(_ancestors(batch, seq, seq + 2, np.random.default_rng(0))) if tree else None
  table = None
  if paged:  # row b's block r (its kv heads) in page table[b, r] of a pool with a spare page
    blocks = capacity // 128
    table = jnp.asarray(np.random.default_rng(1).permutation(batch * blocks + 1)[:batch * blocks], jnp.int32)
    as_pages = lambda x: x.reshape(batch, kv_heads, blocks, 128, head_dim).transpose(0, 2, 1, 3, 4).reshape(
        batch * blocks, kv_heads, 128, head_dim)
    pool = lambda x: jnp.zeros((batch * blocks + 1, kv_heads, 128, head_dim), dtype).at[table].set(as_pages(x))
    k, v, table = pool(k), pool(v), table.reshape(batch, blocks)
  return attention.cached_attention(q, k, v, jnp.asarray(lengths, jnp.int32), heads_major, window, softcap, scale,
                                    tree_BxSxA=mask, kernel=kernel, page_table_BxR=table).astype(jnp.float32)


def full_logits(m: Model, tokens_BxS) -> np.ndarray:
  """[B, S, V]: `model.forward_full`'s logits, the reference decoding is checked against. Compiled once per
  width of 32 tokens: a causal forward's logits do not depend on the tokens after them (but dynamic-NTK
  RoPE scales by the length, so such a model runs unpadded)."""
  tokens_BxS = np.asarray(tokens_BxS, np.int32)
  width = tokens_BxS.shape[1]
  scaling = m.config.rope_scaling
  padded = width if scaling is not None and scaling.type == "dynamic" else -(-width // 32) * 32
  tokens = np.pad(tokens_BxS, ((0, 0), (0, padded - width)))
  return np.asarray(_forward_full(m.params, tokens, m.config, ())[0])[:, :width]


def assert_target_argmax(target: Model, prompt_ids: list[int], out_ids: list[int]) -> None:
  """Every emitted token is the target's full-forward argmax, except at near-ties (top-2 gap < 1e-5)."""
  logits = full_logits(target, [prompt_ids + out_ids])[0]
  for i, tok in enumerate(out_ids):
    row = logits[len(prompt_ids) - 1 + i]
    top2 = np.sort(row)[-2:]
    assert tok == row.argmax() or top2[1] - row[tok] < 1e-5, f"token {i}: {tok} vs argmax {row.argmax()}"


def exact_two_token_law(m: Model, prompt: list[int], temperature: float, top_k: int, top_p: float,
                        allowed=None) -> np.ndarray:
  """[V, V]: the probability of the first two tokens after `prompt` under the sampling transform, by
  enumerating every first token (for a tiny vocabulary). With `allowed(emitted ids) -> [V] bool`, the
  constrained law: at each step the logits outside the allowed tokens are masked before the transform."""
  vocab = m.config.vocab_size
  full = lambda batch: sampling.SamplingParams(jnp.full((batch,), temperature, jnp.float32),
                                               jnp.full((batch,), top_k, jnp.int32),
                                               jnp.full((batch,), top_p, jnp.float32))
  logits = full_logits(m, [prompt + [a] for a in range(vocab)])
  first_logits, second_logits = logits[:1, len(prompt) - 1:len(prompt)], logits[:, len(prompt):len(prompt) + 1]
  if allowed is not None:
    first_logits = np.where(allowed([]), first_logits, -np.inf)
    second_logits = np.where(np.stack([allowed([a]) for a in range(vocab)])[:, None], second_logits, -np.inf)
  first = np.nan_to_num(np.asarray(sampling.probabilities(jnp.asarray(first_logits), full(1))[0, 0]))
  second = np.nan_to_num(np.asarray(sampling.probabilities(jnp.asarray(second_logits), full(vocab))[:, 0]))
  return first[:, None] * second


def tv_bound(p: np.ndarray, n: int) -> float:
  """Expected TV distance of an n-sample histogram from p, plus a McDiarmid margin for failure probability
  1e-4."""
  return float(0.5 * np.sum(np.sqrt(p * (1 - p) / n)) + np.sqrt(np.log(1e4) / (2 * n)))


def two_token_tv(target: Model, prompt: list[int], sp: tuple[float, int, float], n: int, allowed=None, **kw):
  """(TV distance of n decoded two-token samples from the exact law, the bound it must stay under, the
  request's stats). `kw` goes to `jspec.generate` (a draft, speculation settings, a constraint, whose
  allowed tokens `allowed` gives as `exact_two_token_law` takes them)."""
  want = exact_two_token_law(target, prompt, *sp, allowed=allowed)
  r = generate(target, [prompt] * n, max_new_tokens=2, temperature=sp[0], top_k=sp[1], top_p=sp[2], seed=11, **kw)
  counts = np.zeros_like(want)
  for a, b in r.token_ids:
    counts[a, b] += 1
  return 0.5 * np.abs(counts / n - want).sum(), tv_bound(want, n), r.stats


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """The instruction lines of each computation in a compiled module's text, by name."""
  computations: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
    if header:
      name = header.group(1)
      computations[name] = []
    elif name and line.startswith("  "):
      computations[name].append(line)
  return computations


def loop_cache_copies(hlo_text: str, cache_elements: int) -> list[str]:
  """Instructions in any while-loop body that copy, transpose or rewrite a whole cache-sized buffer.

  A loop that writes the cache and attends over it can pay a full copy of the buffer every step (see
  jspec/model/cache.py). In-place updates appear as dynamic-update-slice fusions and are allowed.
  """
  computations = _computations(hlo_text)
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))

  def in_place_update(fusion: str) -> bool:
    root = next((x for x in computations.get(fusion, []) if x.lstrip().startswith("ROOT")), "")
    return " dynamic-update-slice(%param" in root or " scatter(%param" in root

  bad = []
  for body in bodies:
    for line in computations.get(body, []):
      m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* ([\w\-]+)\(", line)
      if not m:
        continue
      dims, op = m.groups()
      if math.prod(int(d) for d in dims.split(",") if d) != cache_elements:
        continue
      called = re.search(r"calls=%([\w.\-]+)", line)
      if op in ("copy", "transpose", "select") or (op == "fusion" and not in_place_update(called.group(1))):
        bad.append(line.strip()[:160])
  return bad


def _in_loops(computations: dict[str, list[str]], hlo_text: str) -> set[str]:
  """The computations a compiled program runs inside its while loops: the loop bodies and everything they
  call, branches of conditionals included."""
  todo = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
  seen = set()
  while todo:
    comp = todo.pop()
    if comp in seen:
      continue
    seen.add(comp)
    for line in computations.get(comp, []):
      refs = re.findall(r"(?:body|calls|true_computation|false_computation)=%([\w.\-]+)", line)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        refs += re.findall(r"%([\w.\-]+)", group)
      todo.update(refs)
  return seen


def loop_weight_copies(hlo_text: str, weights) -> list[str]:
  """Instructions run inside the while loops that copy or transpose an array shaped as one of `weights`'
  matrices (or as its transpose). Weights do not change in the loop, so such a copy is paid every round
  for nothing (a tied LM head read as `embed.T`, say)."""
  shapes = {tuple(np.shape(w)) for w in jax.tree.leaves(weights) if np.ndim(w) >= 2}
  shapes |= {s[::-1] for s in shapes}
  computations = _computations(hlo_text)
  bad = []
  for comp in _in_loops(computations, hlo_text):
    for line in computations.get(comp, []):
      m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* (copy|transpose)\(", line)
      if m and tuple(int(d) for d in m.group(1).split(",") if d) in shapes:
        bad.append(line.strip()[:160])
  return bad


def loop_collectives(hlo_text: str, scope: str | None = None) -> dict[str, int]:
  """Counts of all-reduce and all-gather instructions that a compiled program runs inside its while loops
  (`_in_loops`): one decode round's traffic. With `scope`, only those traced under
  `jax.named_scope(scope)` (for example "drafter")."""
  computations = _computations(hlo_text)
  counts = {"all-reduce": 0, "all-gather": 0}
  for comp in _in_loops(computations, hlo_text):
    for line in computations.get(comp, []):
      for op in counts:
        if re.search(rf"= \S+ {op}(-start)?\(", line) and (scope is None or f"/{scope}/" in line):
          counts[op] += 1
  return counts
