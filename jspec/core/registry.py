"""The drafter registry: each drafter kind's name and the class that implements it (`jspec.drafters.Drafter`).

A new drafter is one module and one line here (or one `register` call from the user's own code). The classes
are named by import path, so reading the kinds (the command line's `--drafter` choices, `SpecConfig`'s
validation) imports no JAX.
"""
from __future__ import annotations

import importlib
from typing import Any

DRAFTERS: dict[str, str | type] = {
    "model": "jspec.drafters.draft_model:ModelDrafter",
    "medusa": "jspec.drafters.medusa:MedusaDrafter",
    "dflash": "jspec.drafters.dflash:DFlashDrafter",  # before eagle: a one-layer DFlash directory has an fc
    "eagle": "jspec.drafters.eagle:EagleDrafter",
    "mtp": "jspec.drafters.mtp:MtpDrafter",
    "ngram": "jspec.drafters.ngram:NgramDrafter",
    "suffix": "jspec.drafters.suffix:SuffixDrafter",
}


def kinds() -> tuple[str, ...]:
  return tuple(DRAFTERS)


def register(cls: type) -> type:
  """Adds a drafter class under its `kind` (usable as a decorator); a kind already taken is an error."""
  if cls.kind in DRAFTERS and DRAFTERS[cls.kind] is not cls:
    raise ValueError(f"a drafter of kind {cls.kind!r} is already registered")
  DRAFTERS[cls.kind] = cls
  return cls


def drafter_class(kind: str) -> Any:
  """The class registered for `kind`; an unknown kind is a one-line ValueError."""
  if kind not in DRAFTERS:
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
  entry = DRAFTERS[kind]
  if isinstance(entry, str):
    module, name = entry.split(":")
    entry = DRAFTERS[kind] = getattr(importlib.import_module(module), name)
  return entry
