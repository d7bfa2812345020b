"""`jspec.generate`: validate, tokenize, pad, run the jitted loop, and report tokens and statistics."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jspec import cache as kvcache
from jspec import adaptive as adaptive_policy
from jspec import decode, drafters, engine, sharding
from jspec.checkpoint import Model
from jspec.tokenizer import decode as detokenize
from jspec.tokenizer import encode


@dataclasses.dataclass
class Result:
  texts: list[str]
  token_ids: list[list[int]]
  stats: dict[str, Any]


def check_request(target: Model, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                  top_k: int, top_p: float, drafter: drafters.Drafter | None, draft_len: int) -> None:
  """Raises ValueError with one clear line for anything the loop cannot serve."""
  if not prompt_ids:
    raise ValueError("no prompts given")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0, got {top_k}")
  context = target.config.max_seq_len
  if isinstance(drafter, drafters.ModelDrafter):
    context = min(context, drafter.config.max_seq_len)
  for i, ids in enumerate(prompt_ids):
    if not ids:
      raise ValueError(f"prompt {i} is empty")
    if min(ids) < 0 or max(ids) >= target.config.vocab_size:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {target.config.vocab_size})")
    if len(ids) + max_new_tokens > context:
      raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                       f"the model's context of {context} tokens")


def generate(target: Model, prompts: Sequence[str | Sequence[int]], *,
             draft: Model | drafters.Heads | None = None, drafter: str | None = None,
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             draft_len: int = 4, max_ngram: int = 3, typical_acceptance: bool = False,
             adaptive: bool = False, fallback_threshold: float = 0.4, probe_interval: int = 16,
             cost_ratio: float = 0.1, verify_cost: float = 0.0, round_overhead: float = 0.0,
             disable_at_batch_size: int | None = None, trace_rounds: int = 0,
             mesh: Mesh | None = None, shard_draft: bool = True, seed: int | Sequence[int] = 0,
             ignore_eos: bool = False) -> Result:
  """Decodes a batch of prompts (texts or token-id lists), speculatively when a drafter is given.

  `draft` is a draft model or trained Medusa/EAGLE heads (`jspec.load` returns either); `drafter="ngram"`
  needs no weights. With neither, decoding is plain autoregression. `typical_acceptance=True` swaps exact
  rejection sampling for Medusa's typical acceptance: faster when sampling, but LOSSY (opt-in).

  `adaptive=True` makes `draft_len` the largest K and picks each round's K (or a plain step) inside the
  loop from acceptance statistics (see `jspec.adaptive`); `fallback_threshold=0` turns fallback off.
  With `disable_at_batch_size=N`, batches of N or more rows decode plainly. Row b samples with `seed + b`
  (or `seed[b]` when a list is given), so a row is reproducible alone (not with `adaptive`, whose K is
  chosen for the whole batch). `trace_rounds=R` records the first R adaptive rounds in `stats["trace"]`.
  `ignore_eos=True` decodes `max_new_tokens` for every row, past any EOS (as vLLM's benchmarks do), without
  compiling anything new.

  With a `mesh` (`jspec.sharding.make_mesh("data=D,model=M")`), parameters and caches are sharded by the
  rules in `jspec.sharding` (the drafter's too, unless `shard_draft=False` replicates it) and the loop runs
  as one SPMD program on the mesh, across processes when `jax.distributed` is initialized.
  """
  if isinstance(prompts, (str, bytes)):
    prompts = [prompts]
  prompt_ids = [encode(target.tokenizer, p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
  if (draft is not None or drafter is not None) and draft_len < 1:
    raise ValueError(f"draft_len must be >= 1, got {draft_len}")
  if max_ngram < 1:
    raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
  chosen, drafter_params = drafters.resolve(target, draft, drafter, max_ngram, draft_len)
  check_request(target, prompt_ids, max_new_tokens, temperature, top_k, top_p, chosen, draft_len)
  batch = len(prompt_ids)
  if disable_at_batch_size is not None and batch >= disable_at_batch_size:
    chosen, drafter_params = None, None  # vLLM's rule: large batches gain little from speculation
  spec, headroom = None, 0
  if chosen is not None:
    policy = None
    if adaptive:
      if not 0 <= fallback_threshold <= 1:
        raise ValueError(f"fallback_threshold must be in [0, 1], got {fallback_threshold}")
      if probe_interval < 1:
        raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
      if cost_ratio <= 0:
        raise ValueError(f"cost_ratio must be > 0, got {cost_ratio}")
      if verify_cost < 0 or round_overhead < 0:
        raise ValueError(f"verify_cost and round_overhead must be >= 0, got {verify_cost}, {round_overhead}")
      policy = adaptive_policy.Policy(cost_ratio, verify_cost, round_overhead, fallback_threshold, probe_interval)
      if isinstance(chosen, drafters.ModelDrafter) and fallback_threshold > 0:  # plain steps leave it behind
        chosen = dataclasses.replace(chosen, max_lag=probe_interval + 1)
    spec = decode.Speculation(draft_len, typical_acceptance, policy, trace_rounds)
    headroom = max(draft_len, getattr(chosen, "max_lag", 0))
  width = engine.prompt_bucket(max(len(p) for p in prompt_ids))
  capacity = kvcache.round_capacity(decode.required_capacity(width, max_new_tokens, headroom))

  prompts_BxP = np.zeros((batch, width), np.int32)
  for b, ids in enumerate(prompt_ids):
    prompts_BxP[b, :len(ids)] = ids
  seeds = [seed + b for b in range(batch)] if isinstance(seed, int) else [int(s) for s in seed]
  if len(seeds) != batch:
    raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
  if not all(0 <= s < 2 ** 32 for s in seeds):
    raise ValueError("seeds must be in [0, 2**32)")
  seeds = np.asarray(seeds, np.uint32)
  args = (target.params, drafter_params, prompts_BxP,
          np.asarray([len(p) for p in prompt_ids], np.int32), np.full((batch,), max_new_tokens, np.int32),
          engine.as_sampling(temperature, top_k, top_p, batch), seeds, decode.eos_ids(target.config, batch, ignore_eos))
  static = dict(target_config=target.config, drafter=chosen, spec=spec, capacity=capacity)
  if mesh is not None:
    args, static["layout"] = _on_mesh(mesh, args, target, chosen, shard_draft)
  executable, compile_seconds = engine.compiled_run(args, static)
  start = time.perf_counter()
  tokens, seq_lens, stats = jax.block_until_ready(executable(*args))
  wall = time.perf_counter() - start

  tokens, seq_lens = np.asarray(tokens), np.asarray(seq_lens)
  token_ids = [tokens[b, len(p):seq_lens[b]].tolist() for b, p in enumerate(prompt_ids)]
  texts = [detokenize(target.tokenizer, ids) for ids in token_ids]
  return Result(texts=texts, token_ids=token_ids,
                stats=summarize(stats, wall, compile_seconds, None if chosen is None else chosen.kind,
                                typical_acceptance and chosen is not None, adaptive and chosen is not None))


def summarize(stats: decode.DecodeStats, wall_seconds: float, compile_seconds: float,
              drafter: str | None, lossy: bool = False, adaptive: bool = False) -> dict[str, Any]:
  s = jax.tree.map(np.asarray, stats)
  speculative = drafter is not None
  drafted, rounds, emitted = int(s.drafted), int(s.rounds), int(s.emitted)
  return {
      "drafter": drafter,
      "verify": "typical acceptance (lossy)" if lossy else "exact rejection sampling" if speculative else None,
      "lossy": lossy,
      "acceptance_rate": float(s.accepted) / drafted if drafted else None,
      "mean_accepted_length": emitted / rounds if rounds else None,
      "rounds": rounds,
      "target_forwards": int(s.target_forwards),
      "draft_forwards": int(s.draft_forwards),
      "plain_forwards": int(s.plain_forwards),
      "drafted_tokens": drafted,
      "accepted_tokens": int(s.accepted),
      "emitted_tokens": emitted,
      "per_position_acceptance": [float(a) / rounds for a in s.accepted_at] if speculative and rounds else [],
      "acceptance_ewma": _mean_finite(s.acceptance.ewma_rate) if speculative else None,
      "acceptance_window": _mean_finite(s.acceptance.window_rate) if speculative else None,
      "adaptive": adaptive,
      "draft_len_counts": {k: int(c) for k, c in enumerate(s.draft_len_counts) if c} if speculative else {},
      "fallback_rounds": int(s.fallback_rounds),
      "probe_rounds": int(s.probe_rounds),
      "trace": [dict(zip(("draft_len", "accepted", "acceptance_window", "acceptance_ewma"),
                         [None if np.isnan(v) else float(v) for v in row]))
                for row in s.trace_Rx4 if not np.isnan(row[0])],
      "tokens_per_second": emitted / wall_seconds if wall_seconds > 0 else None,
      "wall_seconds": wall_seconds,
      "compile_seconds": compile_seconds,
  }


def _mean_finite(x: np.ndarray) -> float | None:
  """The mean over rows with data (NaN marks a row that never tested a proposal)."""
  x = x[np.isfinite(x)]
  return float(x.mean()) if x.size else None


def _on_mesh(mesh: Mesh, args: tuple, target: Model, drafter, shard_draft: bool):
  """Places the run's arguments on the mesh and chooses the cache layout."""
  target_params, drafter_params, *rest = args
  batch = rest[0].shape[0]
  draft_config = {"model": lambda d: d.config, "medusa": lambda d: d.target_config,
                  "eagle": lambda d: d.config}.get(getattr(drafter, "kind", None), lambda d: None)(drafter)
  if not sharding.is_placed(target_params, mesh):
    target_params = sharding.place(target_params, mesh, sharding.param_specs(target_params, target.config, mesh))
  draft_cache = sharding.cache_layout(batch, None, mesh)
  if drafter_params is not None and not sharding.is_placed(drafter_params, mesh):
    specs = sharding.param_specs(drafter_params, draft_config, mesh) if shard_draft else None
    drafter_params = sharding.place(drafter_params, mesh, specs)
  if shard_draft and draft_config is not None:
    draft_cache = sharding.cache_layout(batch, draft_config, mesh)
  layout = sharding.Layout(mesh, sharding.cache_layout(batch, target.config, mesh), draft_cache,
                           draft_replicated=not shard_draft)
  return (target_params, drafter_params, *sharding.place(tuple(rest), mesh)), layout
