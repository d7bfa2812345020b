"""XLA options jspec sets for the process before JAX starts its backends (from `import jspec`).

XLA:CPU in jaxlib 0.10 hands matrix products to YNNPACK fusions by default. On x86 CPUs those run a
product of a few rows (a verify of K + 1 tokens, a prefill chunk) about twice as slowly as XLA's own dot
emitter, which a verify pays every round, and an executable full of them loads about twice as slowly from
a stored file (docs/cpu-performance.md). They are turned off unless `XLA_FLAGS` already chooses, and only
for the jaxlib versions known to have the flag (XLA aborts on a flag it does not know).
"""
from __future__ import annotations

import importlib.metadata
import os

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
VERSIONS_WITH_FLAG = ("0.10.",)


def _jaxlib_version() -> str:
  try:
    return importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    return ""


def prefer_xla_dots() -> None:
  """Adds `--xla_cpu_experimental_ynn_fusion_type=` (no YNNPACK fusions) to `XLA_FLAGS`, unless it
  mentions the flag or jaxlib is not a version known to have it. Only backends started later see it."""
  flags = os.environ.get("XLA_FLAGS", "")
  if YNN_FLAG in flags or not _jaxlib_version().startswith(VERSIONS_WITH_FLAG):
    return
  os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}=".strip()
