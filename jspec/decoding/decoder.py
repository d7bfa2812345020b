"""What the decode loop runs, and how a target and a draft become one.

A `Decoder` bundles the weights (pytree leaves) and the static program (configs, drafter, speculation
settings); `make_decoder` builds it from a target and a draft: which drafter (from `jspec.core.registry`), whether
the draft fits the target, and the cost model adaptive speculation uses.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct

from jspec.core import registry
from jspec.core.settings import ATTENTION_CHOICES, AdaptiveConfig, CostModel, SpecConfig
from jspec.drafters import Drafter, Heads, ModelDrafter
from jspec.drafters.base import DraftWeights
from jspec.model import model
from jspec.model.config import ModelConfig
from jspec.model.kernels import pallas_attention
from jspec.model.kernels.pallas_attention import Kernel
from jspec.model.model import Model
from jspec.speculation import costs


@flax.struct.dataclass
class Decoder:
  """What the loop runs: the weights (pytree leaves) and the program (static fields, hashable: part of the
  compiled shape). Plain decoding when `drafter` is None; otherwise `spec` has the adaptive policy's cost
  model set (`AdaptiveConfig.with_costs`). `make_decoder` builds one; on a mesh, `layout`
  says how the caches are laid out (`jspec.model.sharding.place_decoder`)."""
  target_params: model.Params
  drafter_params: Any = None
  target_config: ModelConfig = flax.struct.field(pytree_node=False, default=None)
  drafter: Drafter | None = flax.struct.field(pytree_node=False, default=None)
  spec: SpecConfig | None = flax.struct.field(pytree_node=False, default=None)
  layout: Any = flax.struct.field(pytree_node=False, default=None)  # jspec.model.sharding.Layout on a mesh
  attention: str = flax.struct.field(pytree_node=False, default="auto")  # `settings.ATTENTION_CHOICES`

  def kernel(self, head_dim: int, platform: str | None = None) -> Kernel | None:
    """The attention kernel this decoder's programs run over caches of `head_dim` on `platform` (default: its
    mesh's devices', which may be another machine's, else this machine's): `attention` resolved, the one place
    jspec chooses (None: the reference loop)."""
    platform = platform or pallas_attention.platform_of(self.layout and self.layout.mesh)
    return pallas_attention.select_kernel(self.attention, platform, head_dim)

  @property
  def adaptive(self) -> AdaptiveConfig | None:
    return None if self.spec is None else self.spec.adaptive

  @property
  def draft_len(self) -> int:
    """K (K_max when adaptive); 1 for plain decoding, which keeps statistics of the same shapes."""
    return self.spec.draft_len if self.drafter is not None else 1

  @property
  def weights(self) -> DraftWeights:
    return DraftWeights(self.drafter_params, self.target_params)

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """The target layers whose outputs the drafter reads (none: the final-normed hidden state)."""
    return () if self.drafter is None else self.drafter.feature_layers

  @property
  def verify_width(self) -> int:
    """Tokens per row a round's verify feeds the target: K + 1, or a tree's nodes and the pending token."""
    if self.drafter is None:
      return 1
    return 1 + (self.spec.draft_len if self.spec.tree is None else self.spec.tree.nodes)

  @property
  def headroom(self) -> int:
    """Slots a round may write past a row's text: a verify of K+1 tokens, a drafter's catch-up or its block."""
    if self.drafter is None:
      return 0
    shape = self.spec.tree
    # A tree's verify writes its nodes; a growing drafter writes top_k entries per level but the last.
    written = self.spec.draft_len if shape is None else max(shape.nodes, shape.top_k * (self.spec.draft_len - 1))
    return max(written, self.drafter.max_lag, self.drafter.writes_ahead)

  @property
  def context_len(self) -> int:
    """The longest text a row may hold: the target's context, or the drafter's if shorter."""
    limit = None if self.drafter is None else self.drafter.context_len
    return min(self.target_config.max_seq_len, limit or self.target_config.max_seq_len)


def drafter_kind(draft: Model | Heads) -> str:
  """The kind of drafter these weights are: a `Model` drafts as a draft model, `Heads` as their drafter."""
  return draft.drafter.kind if isinstance(draft, Heads) else ModelDrafter.kind


def make_decoder(target: Model, draft: Model | Heads | None, spec: SpecConfig | None, batch: int,
                 mesh_shape: tuple[int, ...] = (1, 1), attention: str = "auto") -> Decoder:
  """The decoder for a batch of `batch` rows. Plain decoding when neither a draft nor `spec.drafter` is
  given, or, without adaptive K, when the batch reaches `spec.disable_at_batch_size` (with it, the
  policy steps aside per round, from the rows running). Mismatches are one-line ValueErrors. The adaptive
  policy's cost model is the one `jspec.speculation.costs.cost_model` picks for these models on a mesh of
  `mesh_shape`. `attention` picks the attention implementation (`settings.ATTENTION_CHOICES`).

  The target's LM head is made explicit here (`model.with_head`), once, so every program and every step
  driven by hand runs with it."""
  spec = spec or SpecConfig()
  if attention not in ATTENTION_CHOICES:
    raise ValueError(f"attention {attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
  target_params = model.with_head(target.params)
  plain = Decoder(target_params, target_config=target.config, attention=attention)
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
  longest = cls.longest_draft(draft)
  if longest is not None and spec.adaptive is not None and spec.tree is None and spec.draft_len > longest:
    spec = dataclasses.replace(spec, draft_len=longest)  # an adaptive draft_len is a ceiling
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
    policy = dataclasses.replace(policy.with_costs(measured, batch, spec.draft_len), disable_at_rows=disable_at,
                                 cost_source=source)
    # Plain steps leave it behind, by up to a probe interval (`jspec.speculation.adaptive`).
    if drafter.lags_plain_steps:
      longest = drafter.context_len or target.config.max_seq_len  # and never by more than a text it holds
      drafter = drafter.with_max_lag(min(policy.probe_interval + 1, longest))
  spec = dataclasses.replace(spec, drafter=kind, adaptive=policy, disable_at_batch_size=None)
  return Decoder(target_params, params, target_config=target.config, drafter=drafter, spec=spec, attention=attention)


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
