"""jspec: lossless speculative decoding in JAX.

The public names below load on first use, so `import jspec` (and `python -m jspec.generate --help`) does not
import JAX.

Shape suffixes: one legend for the whole package. A name like `logits_BxKxV` is an array of shape [B, K, V];
letters written together multiply (QS = Q * S), a digit is a literal size (`keys_Bx2`), and a trailing 1
adds one (K1 = K + 1, S1 = S + 1).
  B  batch rows                          K  tokens drafted per round (a verify feeds K1 = K + 1)
  S  tokens fed to one forward           P  padded prompt width
  T  slots of a KV cache or token buffer V  vocabulary
  D  model width                         F  MLP width
  H  query heads                         J  key/value heads
  Q  query heads per kv head (H / J)     Dh head dim
  X  cache rows, B * J                   N  layers
  C  target features a head drafter keeps (K + 1)
  E  stop tokens a row may end at         W  rounds in the adaptive acceptance window
  R  adaptive rounds recorded in a trace
  M  draft tree nodes (a tree verify feeds M1 = M + 1: the pending token and the nodes; see jspec.speculation.tree)
  L  tree depth (a path holds L1 = L + 1 entries)   A  tree entries fed so far in a round
  G  children per tree node (the tree's top-k; Medusa's ranks)
  Z  candidate nodes a dynamic tree grows before it keeps M
  U  a constraint automaton's states     Y  its token classes (tokens alike in every state)
  I  entries whose automaton states are looked up at once (a path, a tree chunk)
  O  experts of a mixture-of-experts layer    Ok the experts a token runs (top-k)    Fe an expert's MLP width
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jspec.core import xla_options

__version__ = "0.2.0"

xla_options.prefer_xla_dots()

# public name -> the module that defines it
_EXPORTS = {
    "generate": "jspec.api", "Result": "jspec.api", "stream": "jspec.api", "Stream": "jspec.engine.stream",
    "Delta": "jspec.engine.requests", "Engine": "jspec.engine.engine", "Request": "jspec.engine.requests",
    "make_engine": "jspec.api", "RequestStats": "jspec.speculation.stats",
    "load": "jspec.formats.loading", "save": "jspec.formats.checkpoint",
    "Model": "jspec.model.model", "Heads": "jspec.drafters", "ModelConfig": "jspec.model.config",
    "SamplingConfig": "jspec.core.settings", "SpecConfig": "jspec.core.settings",
    "AdaptiveConfig": "jspec.core.settings",
    "CostModel": "jspec.core.settings", "TreeConfig": "jspec.core.settings", "Stats": "jspec.speculation.stats",
    "make_mesh": "jspec.model.sharding",
    "Regex": "jspec.text.constraints", "JsonSchema": "jspec.text.constraints", "Choice": "jspec.text.constraints",
}
__all__ = ["AdaptiveConfig", "Choice", "CostModel", "Delta", "Engine", "Heads", "JsonSchema", "Model", "ModelConfig",
           "Regex", "Request", "RequestStats", "Result", "SamplingConfig", "SpecConfig", "Stats", "Stream",
           "TreeConfig", "generate", "load", "make_engine", "make_mesh", "save", "stream"]

if TYPE_CHECKING:
  from jspec.api import Result, generate, make_engine, stream
  from jspec.core.settings import AdaptiveConfig, CostModel, SamplingConfig, SpecConfig, TreeConfig
  from jspec.drafters import Heads
  from jspec.engine.engine import Engine
  from jspec.engine.requests import Delta, Request
  from jspec.engine.stream import Stream
  from jspec.formats.checkpoint import save
  from jspec.formats.loading import load
  from jspec.model.config import ModelConfig
  from jspec.model.model import Model
  from jspec.model.sharding import make_mesh
  from jspec.speculation.stats import RequestStats, Stats
  from jspec.text.constraints import Choice, JsonSchema, Regex


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jspec' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__)
