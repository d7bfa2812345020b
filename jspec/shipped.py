"""The checkpoints that ship with jspec: a code target and its drafters (see `configs/` to rebuild them)."""
from __future__ import annotations

import pathlib

CHECKPOINTS = pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
TARGET = CHECKPOINTS / "code-target"
# The shipped weights of each drafter for the shipped target (n-gram lookup needs none).
DRAFTS = {"model": CHECKPOINTS / "code-draft", "medusa": CHECKPOINTS / "code-target-medusa",
          "eagle": CHECKPOINTS / "code-target-eagle"}
DEFAULT_DRAFTER = "model"  # the best measured speedup on held-out code (BENCHMARKS.md)


def is_target(path: str | pathlib.Path) -> bool:
  return pathlib.Path(path).resolve() == TARGET
