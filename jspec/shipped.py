"""The checkpoints that ship with jspec: a code target and its drafters (see `configs/` to rebuild them)."""
from __future__ import annotations

import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parent
# Installed from a wheel, the checkpoints are package data (jspec/checkpoints); in a clone (and an editable
# install) they are the repository's checkpoints/.
CHECKPOINTS = next((d for d in (_PACKAGE / "checkpoints", _PACKAGE.parent / "checkpoints") if d.is_dir()),
                   _PACKAGE / "checkpoints")
TARGET = CHECKPOINTS / "code-target"
# The shipped weights of each drafter for the shipped target (n-gram lookup needs none).
DRAFTS = {"model": CHECKPOINTS / "code-draft", "medusa": CHECKPOINTS / "code-target-medusa",
          "eagle": CHECKPOINTS / "code-target-eagle"}
DEFAULT_DRAFTER = "model"  # the best measured speedup on held-out code (BENCHMARKS.md)


def is_target(path: str | pathlib.Path) -> bool:
  return pathlib.Path(path).resolve() == TARGET
