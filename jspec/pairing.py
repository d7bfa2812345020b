"""A target and a draft made into one `Decoder`: which drafter (from `jspec.registry`), whether the draft fits
the target, and the cost model adaptive speculation uses."""
from __future__ import annotations

import dataclasses

from jspec import costs, model, registry
from jspec.decode import Decoder
from jspec.drafters import Drafter, Heads
from jspec.model import Model
from jspec.settings import CostModel, SpecConfig


def drafter_kind(draft: Model | Heads) -> str:
  """The kind of drafter these weights are: a `Model` drafts as a draft model, `Heads` as their drafter."""
  return draft.drafter.kind if isinstance(draft, Heads) else "model"


def make_decoder(target: Model, draft: Model | Heads | None, spec: SpecConfig | None, batch: int,
                 mesh_shape: tuple[int, ...] = (1, 1)) -> Decoder:
  """The decoder for a batch of `batch` rows. Plain decoding when neither a draft nor `spec.drafter` is
  given, or, without adaptive K, when the batch reaches `spec.disable_at_batch_size` (with it, the
  policy steps aside per round, from the rows running). Mismatches are one-line ValueErrors. The adaptive
  policy's cost model is the one `jspec.costs.cost_model` picks for these models on a mesh of
  `mesh_shape`.

  The target's LM head is made explicit here (`model.with_head`), once, so every program and every step
  driven by hand runs with it."""
  spec = spec or SpecConfig()
  target_params = model.with_head(target.params)
  plain = Decoder(target_params, target_config=target.config)
  kind = spec.drafter or (None if draft is None else drafter_kind(draft))
  if kind is None:
    return plain
  cls = registry.drafter_class(kind)
  if not cls.needs_weights:
    if draft is not None:
      raise ValueError(f"the {kind} drafter takes no draft weights")
    params = None
  else:
    if draft is None:
      raise ValueError(f"the {kind} drafter needs draft weights")
    if kind != drafter_kind(draft):
      raise ValueError(f"the {kind} drafter was given {drafter_kind(draft)} weights")
    params = draft.params
  measured, source = (costs.cost_model(target, draft, kind, cls.needs_weights, mesh_shape)
                      if spec.adaptive is not None or spec.tree is not None else (None, None))  # what reads it
  drafter = cls.for_pair(target, draft, spec)
  params = drafter.loop_params(params)
  disable_at = spec.disable_at_batch_size
  if disable_at is not None and batch >= disable_at and (spec.adaptive is None or spec.tree is not None):
    return plain  # vLLM's rule: large batches gain little from speculation (adaptive: per round, below)
  policy = spec.adaptive
  if spec.tree is not None:  # trees run at their fixed shape
    spec = _tree_spec(target, drafter, spec, measured)
    policy = None
    drafter = drafter.with_max_lag(spec.draft_len)  # a cache may trail the text by the accepted path
  if policy is not None:
    policy = dataclasses.replace(policy.with_costs(measured, batch), disable_at_rows=disable_at,
                                 cost_source=source)
    if drafter.lags_plain_steps:  # plain steps leave it behind, by up to a probe interval (`jspec.adaptive`)
      longest = drafter.context_len or target.config.max_seq_len  # and never by more than a text it holds
      drafter = drafter.with_max_lag(min(policy.probe_interval + 1, longest))
  spec = dataclasses.replace(spec, drafter=kind, adaptive=policy, disable_at_batch_size=None)
  return Decoder(target_params, params, target_config=target.config, drafter=drafter, spec=spec)


def _tree_spec(target: Model, drafter: Drafter, spec: SpecConfig, measured: CostModel | None) -> SpecConfig:
  """`spec` with its tree's shape set (the drafter's measured one where unset) and checked against the
  drafter and the target."""
  if not drafter.supports_tree:
    trees = [k for k in registry.kinds() if registry.drafter_class(k).supports_tree]
    raise ValueError(f"the {drafter.kind} drafter drafts chains only; trees need {', '.join(trees)}")
  windows = [w for w in target.config.sliding_windows if w]
  if windows and min(windows) <= spec.draft_len:
    raise ValueError(f"a tree of depth {spec.draft_len} needs sliding windows wider than it (the target's "
                     f"narrowest is {min(windows)})")
  shape = drafter.tree_shape(spec.tree.resolved(measured), spec.draft_len, nodes_asked=spec.tree.nodes is not None)
  return dataclasses.replace(spec, tree=shape)
