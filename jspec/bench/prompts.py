"""The prompt sets the benchmarks decode: held-out standard-library code, third-party package code, context
editing, English prose."""
from __future__ import annotations

import importlib.util
import itertools
import pathlib

import numpy as np

from jspec.train import data


def edit_prompts(count: int, max_lines: int = 12) -> list[str]:
  """Context-editing prompts: a held-out function, a request to rewrite it, and its first line again.

  The continuation mostly repeats text from the prompt, which is where n-gram lookup should shine.
  """
  prompts = []
  for path in data.corpus_files("heldout"):
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.startswith("def ") and i > 5:
        body = "".join(lines[i:i + max_lines])
        prompts.append(f"{body}\n# The same function, rewritten with better names:\n{line}")
        break
    if len(prompts) == count:
      break
  return prompts


PROSE = [
    "The old lighthouse keeper had not spoken to anyone for three weeks when the boat finally arrived. He",
    "Most people think of autumn as a season of endings, but for a gardener it is the beginning of",
    "When the committee met again on Thursday, the mood in the room had changed. Nobody wanted to",
    "My grandmother kept every letter she ever received, tied in bundles with faded ribbon, and",
    "The history of the bicycle is a story of small improvements that, taken together, transformed",
    "It rained all night, and by morning the river had risen almost to the top of the stone wall that",
    "Learning a second language as an adult is humbling. At first every sentence feels like",
    "The bakery on the corner opens at six, and by half past there is usually a line of sleepy",
]


def prose_prompts(count: int) -> list[str]:
  """English prose, which the code models have hardly seen: drafts are accepted rarely."""
  return PROSE[:count]


def function_starts(paths, count: int, max_chars: int = 600) -> list[str]:
  """The start of a function in each file: everything up to and including its first `def` line past line 5
  (the last `max_chars` characters), from the first `count` files that have one."""
  prompts = []
  for path in paths:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.lstrip().startswith("def ") and i > 5:
        prompts.append("".join(lines[:i + 1])[-max_chars:])
        break
    if len(prompts) == count:
      break
  return prompts


def heldout_prompts(count: int, max_chars: int = 600) -> list[str]:
  """The start of a function in held-out stdlib files: everything up to and including a `def` line."""
  return function_starts(data.corpus_files("heldout"), count, max_chars)


# Installed with jspec, never in its training data (the corpus is the standard library alone).
THIRD_PARTY = ("jinja2", "tqdm", "optax", "chex", "flax", "orbax", "jax", "numpy")


def package_files(name: str) -> list[pathlib.Path]:
  """An installed package's Python files, tests excluded, in path order."""
  spec = importlib.util.find_spec(name)
  roots = [pathlib.Path(r) for r in (spec.submodule_search_locations or [])] if spec else []
  return sorted(p for root in roots for p in root.rglob("*.py")
                if not {"tests", "test", "testing"} & set(p.relative_to(root).parts[:-1])
                and p.stat().st_size > 2000)


def thirdparty_prompts(count: int, max_chars: int = 600) -> list[str]:
  """The start of a function in installed third-party packages (THIRD_PARTY, one file from each in turn):
  code the shipped models were not trained on, as a new user's would be."""
  files = itertools.chain.from_iterable(itertools.zip_longest(*map(package_files, THIRD_PARTY)))
  return function_starts((f for f in files if f is not None), count, max_chars)


def varied_heldout_prompts(count: int, seed: int = 0) -> list[str]:
  """Held-out code cut at random lines, with 100 to 1,500 characters of context: prompts of mixed lengths,
  some close enough to the end of their file that the target ends them (EOS) early."""
  rng = np.random.default_rng(seed)
  texts = [t for t in data.read_texts("heldout") if t.count("\n") > 10]
  prompts = []
  while len(prompts) < count:
    lines = texts[rng.integers(len(texts))].splitlines(keepends=True)
    cut = int(rng.integers(5, len(lines)))
    prompts.append("".join(lines[:cut])[-int(rng.integers(100, 1500)):])
  return prompts


PROMPT_SETS = {"code": heldout_prompts, "thirdparty": thirdparty_prompts, "edit": edit_prompts,
               "prose": prose_prompts}
