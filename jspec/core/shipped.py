"""The checkpoints that ship with jspec: code targets and their drafters (see `configs/` to rebuild them)."""
from __future__ import annotations

import dataclasses
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # jspec/
# Installed from a wheel, the checkpoints are package data (jspec/checkpoints); in a clone (and an editable
# install) they are the repository's checkpoints/.
CHECKPOINTS = next((d for d in (_PACKAGE / "checkpoints", _PACKAGE.parent / "checkpoints") if d.is_dir()),
                   _PACKAGE / "checkpoints")


@dataclasses.dataclass(frozen=True)
class Pair:
  """A shipped target and the weights of each drafter trained for it (n-gram lookup needs none), all in
  `checkpoints/` as `{name}-target`, `{name}-draft`, `{name}-target-medusa` and `{name}-target-eagle`."""
  name: str

  @property
  def target(self) -> pathlib.Path:
    return CHECKPOINTS / f"{self.name}-target"

  @property
  def drafts(self) -> dict[str, pathlib.Path]:
    return {"model": CHECKPOINTS / f"{self.name}-draft", "medusa": CHECKPOINTS / f"{self.name}-target-medusa",
            "eagle": CHECKPOINTS / f"{self.name}-target-eagle"}


# code: a 19.6M-parameter target, large enough that speculation pays; code-small: a 6.3M-parameter target,
# quick to compile and run (tests, smoke runs).
PAIRS = {name: Pair(name) for name in ("code", "code-small")}
DEFAULT = PAIRS["code"]
SMALL = PAIRS["code-small"]
TARGET, DRAFTS = DEFAULT.target, DEFAULT.drafts
DEFAULT_DRAFTER = "eagle"  # the steadiest speedup of the four on the shipped pairs (BENCHMARKS.md)


def resolve(target: str | pathlib.Path) -> pathlib.Path:
  """A target directory, or a shipped pair's name (`code`, `code-small`) for its target."""
  return PAIRS[target].target if isinstance(target, str) and target in PAIRS else pathlib.Path(target)


def pair_of(target: str | pathlib.Path) -> Pair | None:
  """The shipped pair whose target this directory is, if any."""
  where = resolve(target).resolve()
  return next((pair for pair in PAIRS.values() if pair.target == where), None)
