"""A target and a draft made into one `Decoder`: which drafter, whether the draft fits the target, and the
cost model adaptive speculation uses."""
from __future__ import annotations

import dataclasses

from jspec import tree
from jspec.config import num_params
from jspec.decode import Decoder
from jspec.drafters import Heads, ModelDrafter, NgramDrafter
from jspec.model import Model
from jspec.settings import CostModel, SpecConfig
from jspec.tokenizer import same_vocab


def drafter_kind(draft: Model | Heads) -> str:
  return "model" if isinstance(draft, Model) else draft.drafter.kind


def make_decoder(target: Model, draft: Model | Heads | None, spec: SpecConfig | None, batch: int) -> Decoder:
  """The decoder for a batch of `batch` rows. Plain decoding when neither a draft nor `spec.drafter` is
  given, or when the batch reaches `spec.disable_at_batch_size`. Mismatches are one-line ValueErrors."""
  spec = spec or SpecConfig()
  plain = Decoder(target.params, target_config=target.config)
  kind = spec.drafter
  if kind == "ngram" or (kind is None and draft is None):
    if draft is not None:
      raise ValueError("the ngram drafter takes no draft weights")
    if kind is None:
      return plain
    drafter, params = NgramDrafter(target.config.vocab_size, spec.max_ngram), None
    measured = target.cost_models.get(kind)
  else:
    if draft is None:
      raise ValueError(f"the {kind} drafter needs draft weights")
    if kind is not None and kind != drafter_kind(draft):
      raise ValueError(f"the {kind} drafter was given {drafter_kind(draft)} weights")
    kind = drafter_kind(draft)
    _check_fit(target, draft, spec)
    drafter = draft.drafter if kind != "model" else ModelDrafter(draft.config, vocab_size=target.config.vocab_size)
    params, measured = draft.params, draft.cost_models.get(kind)
  if spec.disable_at_batch_size is not None and batch >= spec.disable_at_batch_size:
    return plain  # vLLM's rule: large batches gain little from speculation
  if measured is not None and measured.target_params not in (None, num_params(target.config)):
    measured = None  # measured with another target
  policy = spec.adaptive
  if spec.tree is not None:  # trees run at their fixed shape
    spec = _tree_spec(target, kind, drafter, spec, measured)
    policy = None
    if kind == "model":  # the draft's cache trails the text by the accepted path after a tree round
      drafter = dataclasses.replace(drafter, max_lag=max(drafter.max_lag, spec.draft_len))
  if policy is not None:
    policy = policy.with_costs((measured or CostModel.neutral(kind)).for_batch(batch))
    if kind == "model" and policy.fallback_threshold > 0:  # plain steps leave the draft behind
      drafter = dataclasses.replace(drafter, max_lag=policy.probe_interval + 1)
  spec = dataclasses.replace(spec, drafter=kind, adaptive=policy, disable_at_batch_size=None)
  return Decoder(target.params, params, target_config=target.config, drafter=drafter, spec=spec)


def _tree_spec(target: Model, kind: str, drafter, spec: SpecConfig, measured: CostModel | None) -> SpecConfig:
  """`spec` with its tree's shape set (the drafter's measured one where unset) and checked against the
  drafter and the target, and Medusa's static shape chosen."""
  if not hasattr(drafter, "propose_tree"):
    raise ValueError(f"the {kind} drafter drafts chains only; trees need medusa, eagle or model")
  windows = [w for w in target.config.sliding_windows if w]
  if windows and min(windows) <= spec.draft_len:
    raise ValueError(f"a tree of depth {spec.draft_len} needs sliding windows wider than it (the target's "
                     f"narrowest is {min(windows)})")
  shape = spec.tree.resolved(measured)
  if kind == "medusa" and shape.sampled:
    raise ValueError("the medusa drafter's tree is static: sampled children need eagle or model")
  if kind == "medusa":
    if shape.choices is None:
      choices = tree.default_choices(spec.draft_len, shape.top_k, shape.nodes)
      shape = dataclasses.replace(shape, choices=choices, nodes=len(choices))
  else:
    made = shape.top_k + (spec.draft_len - 1) * shape.top_k ** 2
    if shape.nodes > made and spec.tree.nodes is None:  # a measured or default size, for a shallower tree
      shape = dataclasses.replace(shape, nodes=made)
    elif shape.nodes > made:
      raise ValueError(f"a tree of depth {spec.draft_len} and top-k {shape.top_k} makes {made} candidate "
                       f"nodes, fewer than the {shape.nodes} asked for")
    if shape.choices is not None:
      raise ValueError(f"the {kind} drafter grows its tree dynamically; tree choices are for medusa")
  return dataclasses.replace(spec, tree=shape)


def _check_fit(target: Model, draft: Model | Heads, spec: SpecConfig) -> None:
  kind = drafter_kind(draft)
  if kind == "model":  # the tokenizers must agree; the embeddings may be padded to other sizes
    if not same_vocab(draft.tokenizer, target.tokenizer):
      raise ValueError("the draft's tokenizer differs from the target's")
    return
  shape = draft.drafter.config
  if (shape.dim, shape.vocab_size) != (target.config.dim, target.config.vocab_size):
    raise ValueError(f"these {kind} heads were trained for a target of width {shape.dim} and vocab "
                     f"{shape.vocab_size}, not {target.config.dim} and {target.config.vocab_size}")
  if kind == "medusa" and spec.draft_len > draft.drafter.num_heads:
    raise ValueError(f"draft_len {spec.draft_len} exceeds the {draft.drafter.num_heads} Medusa heads")
