"""The interface every drafter implements (`Drafter`), the proposals it makes, trained heads, and the target
features that head drafters read.

A drafter is a frozen (hashable) dataclass: it is a static part of the jitted loop, and its weights, if
any, are a separate pytree. Its per-request state (a KV cache, the target's last features) rides in the
loop's carried state. Each round the loop calls:

  propose(...)       -> a `Proposal`: K tokens per row and the logits each was sampled from (q for
                        rejection sampling);
  propose_tree(...)  -> a `TreeProposal` instead, for drafters with `supports_tree`;
  observe(...)       -> after the target forward and the commit: learn the target's features of the round
                        and roll back to the accepted text. A round may also be a plain target step (no
                        proposals: n-gram misses, adaptive fallback), which observe sees as S = 1.

Everything else the engine needs to know of a kind (whether it needs weights, how far its cache may trail
the text, the longest context it holds, how its checkpoint is written and read, how it is trained) is
asked of the drafter here, never of its kind's name. Kinds are listed in `jspec.core.registry`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.core.settings import CostModel, SpecConfig, TreeConfig
from jspec.model.config import ModelConfig
from jspec.speculation.sampling import SamplingParams, next_token
from jspec.text.automaton import Automata

if TYPE_CHECKING:
  from jspec.model.model import Model

DrafterState = Any  # a pytree; None for stateless drafters


@flax.struct.dataclass
class Proposal:
  """K proposed tokens per row, for positions `seq_lens[b] + i`, and the logits each was drawn from."""
  tokens_BxK: jax.Array
  logits_BxKxV: jax.Array
  has_draft_B: jax.Array  # False: the row has no real proposal (its tokens are placeholders)


@flax.struct.dataclass
class TreeProposal:
  """A draft tree per row, flattened as `jspec.speculation.tree` describes: node m's token, the chunk index of its
  parent, and (for children drawn from q) the logits q came from at each chunk entry."""
  tokens_BxM: jax.Array
  parents_BxM: jax.Array
  logits_BxM1xV: jax.Array | None
  rule: str = flax.struct.field(pytree_node=False)  # jspec.speculation.tree.TOP_K or SAMPLED


@flax.struct.dataclass
class DraftWeights:
  """The weights a drafter reads: its own (None when it has none) and the target's (heads share the target's
  embedding and LM head)."""
  drafter: Any
  target: Any


@flax.struct.dataclass
class DraftContext:
  """The rows' text as the loop holds it: tokens `[0, seq_lens[b])` of row b, its sampling values, whether
  its text is shared across requests (False: a drafter that keeps texts across requests neither keeps nor
  offers it this row's), and its constraint automaton (None: no row is constrained), whose allowed tokens a
  drafter should draw from."""
  tokens_BxT: jax.Array
  seq_lens_B: jax.Array
  sampling: SamplingParams
  share_B: jax.Array
  constraint: Automata | None = None


class Drafter:
  """The base every drafter derives from: the loop's calls, and what the engine asks of a kind. A subclass
  is a frozen dataclass with a `kind` and the methods its drafting needs; the defaults below describe a
  drafter with no weights of its own, no cache that trails the text, and chains only."""
  kind: ClassVar[str]  # its name in `jspec.core.registry`
  needs_weights: ClassVar[bool] = True  # False: it drafts from the context alone (`for_pair` gets no draft)
  can_skip_rounds: ClassVar[bool] = False  # rows may lack a proposal; a round where none has one is a plain step
  supports_tree: ClassVar[bool] = False  # implements `propose_tree`
  # The target layers whose outputs (side by side) the loop hands `prefill` and `observe`; empty: the target's
  # final-normed hidden state.
  feature_layers: tuple[int, ...] = ()
  lags_plain_steps: ClassVar[bool] = False  # a plain target step leaves its state behind the text (see max_lag)
  is_draft_model: ClassVar[bool] = False  # its weights are a whole `Model` (a draft model), not heads on the target
  # The tokens after a page that its cache's entries in the page depend on: EAGLE's entry at a page's end
  # reads the next token, so a cached page is shared only by a text that goes on with the same token.
  prefix_lookahead: ClassVar[int] = 0
  learning_rate: ClassVar[float | None] = None  # peak rate `python -m jspec.train drafter` uses (None: not offered)
  config: ModelConfig | None  # the shape its weights and cache follow; None: no weights

  # -- pairing with a target ------------------------------------------------------------------------------
  @classmethod
  def for_pair(cls, target: Model, draft: Any, spec: SpecConfig) -> Drafter:
    """The drafter for `target` from the loaded draft weights (a `Model` or `Heads`; None when
    `needs_weights` is False); a draft that does not fit the target is a one-line ValueError."""
    return draft.drafter

  @classmethod
  def longest_draft(cls, draft: Any) -> int | None:
    """The most tokens these draft weights can propose in a round (None: no limit)."""
    return None

  def loop_params(self, params: Any) -> Any:
    """The weights the loop carries for this drafter, from the loaded draft's (themselves by default)."""
    return params

  @property
  def max_lag(self) -> int:
    """The most tokens the drafter's state may trail the text by at the start of a round."""
    return 0

  def with_max_lag(self, lag: int) -> Drafter:
    """This drafter able to catch up `lag` tokens at the start of a round (after plain steps or a tree
    round); drafters whose state never trails return themselves."""
    return self

  def forwards(self, draft_len: int) -> int:
    """The draft forwards a round of `draft_len` proposals counts in the statistics (`draft_forwards`)."""
    return draft_len

  @property
  def writes_ahead(self) -> int:
    """Slots past a row's pending token its own cache is written at while it drafts (a block drafted at once)."""
    return 0

  @property
  def context_len(self) -> int | None:
    """The longest text (prompt + new tokens) the drafter holds; None: as long as the target's."""
    return None

  def tree_shape(self, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
    """`shape` (its unset fields already taken from the measured or default shape) completed and checked
    for this drafter's trees of depth `depth`: a ValueError if it cannot draft it. `nodes_asked`: the node
    count was the user's, not a default that may shrink to fit a shallow tree."""
    raise ValueError(f"the {self.kind} drafter drafts chains only; trees need a drafter with supports_tree")

  # -- checkpoints -------------------------------------------------------------------------------------------
  def metadata(self) -> dict:
    """What its checkpoint's `drafter.json` records beside the kind and the config."""
    return {}

  @classmethod
  def from_metadata(cls, config: ModelConfig, metadata: dict) -> Drafter:
    """The drafter a checkpoint describes (the inverse of `metadata`)."""
    return cls(config)

  def init_params(self, key: jax.Array) -> Any:
    """Fresh weights (training starts from these; checkpoints restore into their shapes)."""
    raise NotImplementedError(f"the {self.kind} drafter has no weights of its own")

  # -- published formats -----------------------------------------------------------------------------------
  # The module beside it that reads and writes its heads in the formats they are published in (None: none), as
  # `jspec.formats.head_formats` calls it: `FORMATS`; `detect(path, config) -> Found | None` (config: the
  # directory's config.json); `read(cls, found, tensors, dtype) -> Heads`; `write(heads, fmt, target,
  # verifier) -> (config, tensors)`, a ValueError where they cannot be written as `fmt`.
  published: ClassVar[Any] = None

  # -- training ---------------------------------------------------------------------------------------------
  @classmethod
  def for_training(cls, target_config: ModelConfig, options: dict) -> Drafter:
    """A drafter to train for a target of `target_config` (`options`: the training config's `heads`)."""
    raise ValueError(f"the {cls.kind} drafter is not trained as heads on a frozen target")

  def training_init(self, key: jax.Array, target_params: Any, token_counts: np.ndarray) -> tuple[Any, dict]:
    """Weights to start training from, given how often each target token occurs in the training data:
    `(trained, frozen)`, the frozen ones (`{}` by default) fixed by the data and merged in for the loss."""
    return self.init_params(key), {}

  def loss(self, weights: DraftWeights, hidden_BxSxD: jax.Array, target_logits_BxSxV: jax.Array,
           tokens_BxS: jax.Array, key: jax.Array, options: dict) -> jax.Array:
    """The training loss on a window of the target's features, logits and tokens (target frozen)."""
    raise NotImplementedError(f"the {self.kind} drafter has no training loss")

  # -- the loop's calls ------------------------------------------------------------------------------------
  def init(self, batch: int, capacity: int, draft_len: int) -> DrafterState:
    """Empty state for a batch, with room for `capacity` positions per row."""
    return None

  def prefill(self, weights: DraftWeights, state: DrafterState, prompts_BxP: jax.Array, prompt_lens_B: jax.Array,
              hidden_BxWxD: jax.Array, start_B: jax.Array) -> DrafterState:
    """Reads the prompts; `hidden` is the target's prefill output (final-normed features) for the W tokens
    from `start` (what precedes it is a cached prefix, whose pages the drafter's paged cache shares)."""
    return state

  def propose(self, weights: DraftWeights, state: DrafterState, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[DrafterState, Proposal]:
    """K proposals per row. Token i of row b is drawn with `keys[i, b]` from the distribution that its
    logits give under `context.sampling`. A row without a real proposal still returns well-formed tokens
    and logits (and `has_draft_B` False, when `can_skip_rounds`)."""
    raise NotImplementedError

  def propose_tree(self, weights: DraftWeights, state: DrafterState, context: DraftContext, spec: SpecConfig,
                   keys_Bx2: jax.Array) -> tuple[DrafterState, TreeProposal]:
    """A draft tree of `spec.tree`'s shape and depth `spec.draft_len`; the keys and the rows' sampling draw
    children from q when `spec.tree.sampled`."""
    raise NotImplementedError

  def retire(self, state: DrafterState, tokens_RxT: jax.Array, lens_R: jax.Array) -> DrafterState:
    """Rows of a running batch end and take new requests (`jspec.decoding.rows.insert`): their texts were
    `tokens[r, :lens[r]]` (length 0: a row whose text is not shared). A drafter whose state outlives requests
    learns from them here."""
    return state

  def observe(self, weights: DraftWeights, state: DrafterState, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> DrafterState:
    """After a target forward over S tokens at positions `[n-1, n-1+S)`; `context.seq_lens_B` holds the
    lengths after the commit. After a tree round, `hidden` holds the accepted path's features in order."""
    return state


def check_heads_fit(kind: str, heads_config: ModelConfig, target: Model) -> None:
  """Heads work at the target's width and read its LM head: both must match what they were trained for."""
  if (heads_config.dim, heads_config.vocab_size) != (target.config.dim, target.config.vocab_size):
    raise ValueError(f"these {kind} heads were trained for a target of width {heads_config.dim} and vocab "
                     f"{heads_config.vocab_size}, not {target.config.dim} and {target.config.vocab_size}")


def dynamic_tree_shape(kind: str, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
  """`Drafter.tree_shape` for drafters that grow EAGLE-2's dynamic tree (`jspec.speculation.tree.grow`)."""
  if shape.choices is not None:
    raise ValueError(f"the {kind} drafter grows its tree dynamically; tree choices are for static trees")
  made = shape.top_k + (depth - 1) * shape.top_k ** 2
  if shape.nodes > made and not nodes_asked:
    return dataclasses.replace(shape, nodes=made)
  if shape.nodes > made:
    raise ValueError(f"a tree of depth {depth} and top-k {shape.top_k} makes {made} candidate nodes, fewer "
                     f"than the {shape.nodes} asked for")
  return shape


@dataclasses.dataclass(frozen=True)
class Heads:
  """Trained Medusa or EAGLE weights, the drafter they belong to, and the cost models measured with them
  (by drafter kind; see `jspec.core.settings.CostModel`)."""
  drafter: Drafter
  params: dict
  cost_models: dict[str, CostModel] = dataclasses.field(default_factory=dict)
  source: str = ""  # the published format they were read from (`jspec.formats.head_formats`); "": jspec's own

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


@flax.struct.dataclass
class Features:
  """The target's final-normed features of the last target forward: feats[b, i] is at position start[b] + i.

  Head drafters read the feature that predicted the last committed token (position seq_len - 2).
  """
  feats_BxCxD: jax.Array
  start_B: jax.Array

  @classmethod
  def zeros(cls, batch: int, width: int, dim: int, dtype) -> Features:
    return cls(jnp.zeros((batch, width, dim), dtype), jnp.zeros((batch,), jnp.int32))

  @classmethod
  def from_prefill(cls, hidden_BxWxD: jax.Array, prompt_lens_B: jax.Array, width: int,
                   start_B: jax.Array) -> Features:
    """Keeps the feature at position len-2 (clamped to 0 for one-token prompts, whose draft is then
    uninformed but still verified), of features from position `start` (at most len-2)."""
    kept = jnp.maximum(prompt_lens_B - 2, 0).astype(jnp.int32)
    last = jnp.take_along_axis(hidden_BxWxD, jnp.maximum(kept - start_B, 0)[:, None, None], axis=1)
    feats = jnp.zeros((hidden_BxWxD.shape[0], width, hidden_BxWxD.shape[2]), hidden_BxWxD.dtype)
    return cls(feats.at[:, :1].set(last), kept)

  def update(self, hidden_BxSxD: jax.Array, n_B: jax.Array) -> Features:
    """Stores a target forward's features (S <= width) starting at position n-1."""
    feats = self.feats_BxCxD.at[:, :hidden_BxSxD.shape[1]].set(hidden_BxSxD.astype(self.feats_BxCxD.dtype))
    return Features(feats, (n_B - 1).astype(jnp.int32))

  def last(self, seq_lens_B: jax.Array) -> jax.Array:
    """The feature at position seq_len - 2, [B,D]."""
    idx = jnp.clip(seq_lens_B - 2 - self.start_B, 0, self.feats_BxCxD.shape[1] - 1)
    return jnp.take_along_axis(self.feats_BxCxD, idx[:, None, None], axis=1)[:, 0]


def onto_vocab(logits_BxSxW: jax.Array, target_ids_W: jax.Array, vocab_size: int) -> jax.Array:
  """Logits over a smaller vocabulary (entry w is target token `target_ids[w]`) as logits over the target's
  `vocab_size` tokens, -inf off the mapped ones: q is zero there, so verification stays exact."""
  out = jnp.full((*logits_BxSxW.shape[:-1], vocab_size), -jnp.inf, logits_BxSxW.dtype)
  return out.at[..., target_ids_W].set(logits_BxSxW)


def draw(key_Bx2: jax.Array, logits_BxV: jax.Array, fsm_B: jax.Array | None,
         context: DraftContext) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """One drafted token per row under the rows' sampling, from the logits masked by the row's automaton
  state `fsm` along its draft path (when constrained). Returns the token, the logits it was drawn from (q)
  and the state after it."""
  automata = context.constraint
  if automata is not None:
    logits_BxV = automata.mask(logits_BxV[:, None], fsm_B[:, None])[:, 0]
  token = next_token(key_Bx2, logits_BxV, context.sampling)
  return token, logits_BxV, None if automata is None else automata.step(fsm_B[:, None], token[:, None])[:, 0]


def draw_path(keys_KxBx2: jax.Array, logits_BxKxV: jax.Array, context: DraftContext) -> tuple[jax.Array, jax.Array]:
  """K drafted tokens per row from logits given up front (one set per draft position), each masked by the
  automaton state the tokens before it reach. Returns `(tokens_BxK, logits_BxKxV)` as drawn from."""
  fsm = None if context.constraint is None else context.constraint.state_B
  tokens, logits = [], []
  for i in range(keys_KxBx2.shape[0]):
    token, q, fsm = draw(keys_KxBx2[i], logits_BxKxV[:, i], fsm, context)
    tokens.append(token)
    logits.append(q)
  return jnp.stack(tokens, 1), jnp.stack(logits, 1)


def draft_chain(step: Callable[[Any, jax.Array], tuple[Any, jax.Array]], carry: Any, logits_BxV: jax.Array,
                keys_KxBx2: jax.Array, context: DraftContext) -> tuple[Any, Proposal]:
  """Samples K tokens autoregressively (`draw`, with the rows' sampling values and constraints): token i
  from the logits so far, then `step(carry, token)` gives the next logits. The last token needs no step:
  the next round feeds it if it is accepted.
  """
  def body(c, key_Bx2):
    carry, logits_BxV, fsm = c
    token, logits_BxV, fsm = draw(key_Bx2, logits_BxV, fsm, context)
    carry, next_logits = step(carry, token)
    return (carry, next_logits, fsm), (token, logits_BxV)

  fsm = None if context.constraint is None else context.constraint.state_B
  (carry, logits_BxV, fsm), (tokens_KxB, logits_KxBxV) = lax.scan(body, (carry, logits_BxV, fsm), keys_KxBx2[:-1])
  token, logits_BxV, _ = draw(keys_KxBx2[-1], logits_BxV, fsm, context)
  tokens_BxK = jnp.concatenate([tokens_KxB.T, token[:, None]], axis=1)
  logits_BxKxV = jnp.concatenate([jnp.moveaxis(logits_KxBxV, 0, 1), logits_BxV[:, None]], axis=1)
  return carry, Proposal(tokens_BxK, logits_BxKxV, jnp.ones(tokens_BxK.shape[:1], bool))
