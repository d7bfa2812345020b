"""Request settings: sampling, speculation and its adaptive policy, and a drafter's cost model.

Frozen, hashable dataclasses that validate themselves, so every value a user can pass is checked in one
place (a bad one is a one-line ValueError). This module imports no JAX: the command line reads its defaults
and choices to print `--help` at once.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os

from jspec.core import registry

# `--attention`: auto runs the platform's Pallas kernel on TPUs and GPUs and the reference loop on CPUs; xla
# is that loop everywhere; tpu and gpu name a kernel (on a CPU it is interpreted: slow, for tests).
ATTENTION_CHOICES = ("auto", "xla", "tpu", "gpu")

# The drafter kinds registered when jspec loads (`jspec.core.registry`; a drafter registered later is valid too).
DRAFTERS = registry.kinds()
# The longest draft a request may ask for. Every K up to it is its own compiled branch under adaptive
# speculation, and past about 8 the draft's later tokens are almost never accepted.
MAX_DRAFT_LEN = 16
MAX_NGRAM = 8
MAX_SUFFIX_CACHE_TOKENS = 1 << 24  # the suffix drafter's index: at most about 600 MB of device memory
MAX_TREE_NODES = 64  # draft tree nodes a round may verify (one target forward over them all)
DEFAULT_TREE = (4, 16)  # top-k and nodes of a tree for a drafter with no measured shape
DTYPES = ("float32", "bfloat16")  # what parameters and activations may be computed in
WEIGHT_FORMATS = ("int8", "fp8", "fp8-block")  # quantized linear layers (`jspec.model.quantization`)


def user_cache_dir(name: str) -> str:
  """jspec/`name` under $XDG_CACHE_HOME (~/.cache)."""
  home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(home, "jspec", name)


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


COST_FIELDS = ("cost_ratio", "verify_cost", "round_overhead")


def _check_costs(config, optional: bool) -> None:
  """Each of `config`'s cost fields (c, v, o) is a finite number >= 0 (or None, when `optional`)."""
  for name in COST_FIELDS:
    value = getattr(config, name)
    _check((optional and value is None) or (_is_real(value) and value >= 0),
           f"{name} must be a finite number >= 0, got {value}")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How each token is drawn from the target's distribution. temperature 0 is greedy; top_k 0 and
  top_p 1 are off."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    _check(_is_real(self.temperature) and self.temperature >= 0,
           f"temperature must be a finite number >= 0, got {self.temperature}")
    _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k}")
    _check(_is_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class CostModel:
  """A speculative round's cost in target steps, 1 + o + K (c + v) (see `jspec.speculation.adaptive`).

  c (`cost_ratio`): one draft step over one target step; v (`verify_cost`): what each extra verified token
  adds to a target forward; o (`round_overhead`): a round's time beyond its forwards. `python -m
  jspec.calibrate` measures them for a pair on the devices at hand (`jspec.planning.calibration`); with `--write` it
  stores them with the drafter's checkpoint, noting the target's parameter count and the `backend` and
  `device_kind` they were measured on: they apply only to a target of that size on such devices.
  `tree_top_k` and `tree_nodes`: the fastest tree shape measured for the drafter (`--suite tree --write`),
  what `TreeConfig()` uses with it.

  `round_costs`: whole rounds of K = 1, 2, ... drafts measured in target steps, as the loop runs them
  (`calibrate` times 1, 2, 4, ... and its `--draft-len`, and interpolates the others). A round's cost is
  not linear in K (a verify of 2 tokens may cost much more than 1 + v, of 8 less than 1 + 7 v), so what
  was measured wins over 1 + o + K (c + v) (`round_cost`); past the longest measured K the line continues
  from it.

  c, v, o and the round costs are measured at batch 1; `batches` holds them measured at larger batches,
  as ((batch, CostModel), ...) (in JSON, {"4": {"cost_ratio": ...}}): a batched verify of K+1 tokens a
  row costs more steps than one row's (`for_batch`).
  """
  cost_ratio: float
  verify_cost: float = 0.0
  round_overhead: float = 0.0
  target_params: int | None = None  # the target it was measured with; None: any
  backend: str | None = None  # where it was measured: jax's backend ("cpu", "gpu", "tpu") and device kind
  device_kind: str | None = None
  tree_top_k: int | None = None
  tree_nodes: int | None = None
  batches: tuple[tuple[int, CostModel], ...] = ()
  round_costs: tuple[float, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "round_costs", tuple(self.round_costs))  # a list, as read from JSON
    _check(len(self.round_costs) <= MAX_DRAFT_LEN and all(_is_real(x) and x >= 1 for x in self.round_costs),
           f"round_costs must be at most {MAX_DRAFT_LEN} numbers >= 1 (target steps), got {self.round_costs}")
    if isinstance(self.batches, dict):  # as read from JSON
      object.__setattr__(self, "batches", tuple(sorted(
          (int(b), c if isinstance(c, CostModel) else CostModel(**c)) for b, c in self.batches.items())))
    _check(all(_is_int(b) and b >= 2 and isinstance(c, CostModel) for b, c in self.batches),
           f"batches must map batch sizes >= 2 to cost models, got {self.batches}")
    _check_costs(self, optional=False)
    _check(all(isinstance(getattr(self, n), (str, type(None))) for n in ("backend", "device_kind")),
           "backend and device_kind must be strings")
    _check(self.target_params is None or _is_int(self.target_params),
           f"target_params must be an integer, got {self.target_params}")
    for name in ("tree_top_k", "tree_nodes"):
      value = getattr(self, name)
      _check(value is None or (_is_int(value) and 1 <= value <= MAX_TREE_NODES),
             f"{name} must be an integer in [1, {MAX_TREE_NODES}], got {value}")

  def as_tuple(self) -> tuple[float, float, float]:
    return self.cost_ratio, self.verify_cost, self.round_overhead

  def round_cost(self, draft_len: int) -> float:
    """A round of `draft_len` drafts in target steps: as measured, else 1 + o + K (c + v), continued
    past the longest measured K by c + v per draft."""
    measured = self.round_costs[:draft_len]
    if not measured:
      return 1 + self.round_overhead + draft_len * (self.cost_ratio + self.verify_cost)
    return measured[-1] + (draft_len - len(measured)) * (self.cost_ratio + self.verify_cost)

  def for_batch(self, batch: int) -> CostModel:
    """The cost model measured at the largest batch up to `batch`."""
    return next((c for b, c in reversed(self.batches) if b <= batch), self)

  def to_json(self) -> dict:
    """The fields that differ from their defaults, `batches` keyed by batch size."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "batches"}
    out = {k: v for k, v in fields.items() if v is not None and v != ()}
    if self.round_costs:
      out["round_costs"] = list(self.round_costs)
    if self.batches:
      out["batches"] = {str(b): c.to_json() for b, c in self.batches}
    return out

  @classmethod
  def neutral(cls, reads_weights: bool = True) -> CostModel:
    """What an unmeasured drafter is assumed to cost: c = 0.1 (0 for one that reads no weights, as n-gram
    lookup), v = o = 0."""
    return cls(cost_ratio=0.1 if reads_weights else 0.0)



@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """Adaptive speculation: each round's K (up to `SpecConfig.draft_len`) or a plain step, chosen inside
  the loop from carried acceptance statistics (see `jspec.speculation.adaptive`).

  The cost model's fields left None come from the drafter's measured cost model, when its checkpoint has
  one for this target, else from `CostModel.neutral`. `with_costs` sets them, and `costs_by_rows`: what a
  round of K = 1..K_max costs at each batch width (`CostModel.round_cost`; from c, v and o alone when any
  of them is set here), since a batched verify costs more target steps than one row's; a program reads
  those of its own width (the serving engine runs narrower programs when fewer rows are busy).
  `disable_at_rows`: plain steps while at least this many rows run (vLLM's disable-by-batch-size).
  `draft_lens`: the K it chooses among (`lens`), each a branch of the compiled round that verifies at its
  width: () gives 1, 2, 4, ... below K_max, and K_max (fewer branches than every K, so the program
  compiles and loads faster: docs/adaptive.md).
  """
  cost_ratio: float | None = None
  verify_cost: float | None = None
  round_overhead: float | None = None
  # Plain steps while the windowed acceptance is below it (0: never); low enough that code speculation
  # still speeds up does not fall back (docs/adaptive.md).
  fallback_threshold: float = 0.25
  probe_interval: int = 16  # plain steps between speculative probes during fallback
  window: int = 8  # W: speculative rounds in the rolling acceptance window
  initial_draft_len: int = 4  # K until any row has data
  costs_by_rows: tuple[tuple[float, ...], ...] = ()  # rounds of K = 1..K_max, for batches of 1, 2, ... rows
  disable_at_rows: int | None = None
  cost_source: str | None = None  # where the cost model came from (`jspec.speculation.costs.SOURCES`)
  draft_lens: tuple[int, ...] = ()

  def __post_init__(self):
    _check(self.disable_at_rows is None or (_is_int(self.disable_at_rows) and self.disable_at_rows >= 1),
           f"disable_at_rows must be an integer >= 1, got {self.disable_at_rows}")
    _check_costs(self, optional=True)
    _check(_is_real(self.fallback_threshold) and 0 <= self.fallback_threshold <= 1,
           f"fallback_threshold must be in [0, 1], got {self.fallback_threshold}")
    for name in ("probe_interval", "window", "initial_draft_len"):
      value = getattr(self, name)
      _check(_is_int(value) and value >= 1, f"{name} must be an integer >= 1, got {value}")
    _check(all(_is_int(k) and k >= 1 for k in self.draft_lens),
           f"draft_lens must be integers >= 1, got {self.draft_lens}")

  def lens(self, max_draft_len: int) -> tuple[int, ...]:
    """The draft lengths a round chooses among, up to `max_draft_len`, ascending; 1 always (probes draft
    one token)."""
    wanted = self.draft_lens or [*(1 << i for i in range(max_draft_len.bit_length())), max_draft_len]
    return tuple(sorted({1} | {k for k in wanted if k <= max_draft_len}))

  @property
  def cost(self) -> CostModel:
    """The cost model, once every field is set (`with_costs`)."""
    return CostModel(self.cost_ratio, self.verify_cost, self.round_overhead)

  def with_costs(self, measured: CostModel, batch: int, max_draft_len: int) -> AdaptiveConfig:
    """This policy for up to `batch` rows and drafts of up to `max_draft_len`, its unset cost fields taken
    from `measured` at each number of rows (`CostModel.for_batch`); the fields themselves hold c, v and o
    at `batch` rows. Cost fields set here replace the measured rounds with the line they give."""
    mine = {n: getattr(self, n) for n in COST_FIELDS if getattr(self, n) is not None}

    def at(rows: int) -> CostModel:
      figures = measured.for_batch(rows)
      return dataclasses.replace(figures, **mine, round_costs=() if mine else figures.round_costs)
    by_rows = tuple(tuple(at(rows).round_cost(k) for k in range(1, max_draft_len + 1)) for rows in range(1, batch + 1))
    return dataclasses.replace(self, **dict(zip(COST_FIELDS, at(batch).as_tuple())), costs_by_rows=by_rows)


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """A draft tree instead of a chain (see `jspec.speculation.tree`): its depth is `SpecConfig.draft_len`, each node
  has up to `top_k` children (the draft's top-k tokens), and `nodes` are verified in one target forward.
  `choices` fixes the shape as a list of paths of child ranks (Medusa's `tree_choices`: `(0, 1)` is the
  second-best token below the best one); by default the `nodes` paths likeliest to be accepted are kept.
  `top_k` and `nodes` left None take the drafter's measured shape (`CostModel.tree_top_k`, `tree_nodes`),
  else `DEFAULT_TREE` (see `resolved`); given `choices`, their widest rank and their count. `sampled`
  draws each node's children from the draft's distribution instead of taking its top-k when sampling
  (SpecInfer's multi-draft proposal and rule; dynamic trees only), keeping the first `nodes` level by level.
  """
  top_k: int | None = None
  nodes: int | None = None
  choices: tuple[tuple[int, ...], ...] | None = None
  sampled: bool = False

  def __post_init__(self):
    if self.choices is not None:
      ranks = [r for path in self.choices for r in path if _is_int(r)]
      object.__setattr__(self, "top_k", self.top_k if self.top_k is not None else max(ranks, default=-1) + 1)
      object.__setattr__(self, "nodes", self.nodes if self.nodes is not None else len(self.choices))
    _check(self.top_k is None or (_is_int(self.top_k) and 1 <= self.top_k <= MAX_TREE_NODES),
           f"tree top_k must be an integer in [1, {MAX_TREE_NODES}], got {self.top_k}")
    _check(self.nodes is None or (_is_int(self.nodes) and 1 <= self.nodes <= MAX_TREE_NODES),
           f"tree nodes must be an integer in [1, {MAX_TREE_NODES}], got {self.nodes}")
    _check(isinstance(self.sampled, bool), f"tree sampled must be a bool, got {self.sampled!r}")
    _check(not (self.sampled and self.choices is not None), "sampled children need a dynamic tree, not choices")
    if self.choices is not None:
      paths = set(self.choices)
      _check(len(paths) == len(self.choices) == self.nodes, "tree choices must be `nodes` distinct paths")
      _check(all(len(c) >= 1 and all(_is_int(r) and 0 <= r < self.top_k for r in c) for c in self.choices),
             f"each tree choice must be a non-empty path of ranks in [0, {self.top_k})")
      _check(all(len(c) == 1 or c[:-1] in paths for c in self.choices),
             "every tree choice's parent path must be a choice")

  def resolved(self, measured: CostModel | None) -> TreeConfig:
    """This shape with each unset field taken from the drafter's measured shape, else `DEFAULT_TREE`."""
    pick = lambda value, from_measured, default: next(
        v for v in (value, from_measured, default) if v is not None)
    return dataclasses.replace(
        self, top_k=pick(self.top_k, measured and measured.tree_top_k, DEFAULT_TREE[0]),
        nodes=pick(self.nodes, measured and measured.tree_nodes, DEFAULT_TREE[1]))


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """How to speculate. Static: part of the compiled program, so requests that share it share executables.

  `drafter` names the kind ("model", "medusa", "eagle", "ngram", "suffix"); it may be left None when the
  draft's weights imply it. `max_ngram`: the longest match of a row's own context n-gram and suffix drafting
  try; `suffix_cache_tokens`: past tokens the suffix drafter's index holds. `typical_acceptance` swaps
  exact rejection sampling for Medusa's typical acceptance, which is LOSSY when sampling (greedy output is
  unchanged). `adaptive` (on by default) chooses K per
  round, up to `draft_len` (and a drafter's own limit, as Medusa's heads), or a plain step when acceptance
  is low; None: every round drafts `draft_len`.
  Rounds with `disable_at_batch_size` rows or more running decode plainly (vLLM's rule; without adaptive
  K, a batch of that many rows decodes plainly throughout). `trace_rounds` records the
  first R adaptive decisions in the statistics. `tree` drafts a token tree of depth `draft_len` instead of
  a chain, at that fixed shape: tree rounds are not adaptive.
  """
  draft_len: int = 8
  drafter: str | None = None
  max_ngram: int = 3
  suffix_cache_tokens: int = 1 << 16
  typical_acceptance: bool = False
  adaptive: AdaptiveConfig | None = AdaptiveConfig()
  disable_at_batch_size: int | None = None
  trace_rounds: int = 0
  tree: TreeConfig | None = None

  def __post_init__(self):
    _check(_is_int(self.draft_len) and 1 <= self.draft_len <= MAX_DRAFT_LEN,
           f"draft_len must be an integer in [1, {MAX_DRAFT_LEN}], got {self.draft_len}")
    _check(self.drafter is None or self.drafter in registry.DRAFTERS,
           f"unknown drafter {self.drafter!r}; choose one of {', '.join(registry.DRAFTERS)}")
    _check(_is_int(self.max_ngram) and 1 <= self.max_ngram <= MAX_NGRAM,
           f"max_ngram must be an integer in [1, {MAX_NGRAM}], got {self.max_ngram}")
    _check(_is_int(self.suffix_cache_tokens) and 1 <= self.suffix_cache_tokens <= MAX_SUFFIX_CACHE_TOKENS,
           f"suffix_cache_tokens must be an integer in [1, {MAX_SUFFIX_CACHE_TOKENS}], got {self.suffix_cache_tokens}")
    _check(self.disable_at_batch_size is None or (_is_int(self.disable_at_batch_size)
                                                  and self.disable_at_batch_size >= 1),
           f"disable_at_batch_size must be an integer >= 1, got {self.disable_at_batch_size}")
    _check(_is_int(self.trace_rounds) and self.trace_rounds >= 0,
           f"trace_rounds must be an integer >= 0, got {self.trace_rounds}")
    if self.tree is not None:
      _check(self.tree.choices is None or max(map(len, self.tree.choices)) <= self.draft_len,
             f"tree choices deeper than draft_len {self.draft_len}")
      _check(not self.typical_acceptance, "typical acceptance verifies chains only")
