"""The training corpus: the CPython standard library's own source, found through `sysconfig`.

It exists wherever Python does, so anyone can rebuild the shipped models. Files are split by a hash of
their path relative to the stdlib root: about 96% train, 2% validation, 2% held out.
"""
from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import numpy as np


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
  bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
  return "validation" if bucket < 2 else "heldout" if bucket < 4 else "train"


def corpus_files(split: str) -> list[pathlib.Path]:
  root = stdlib_root()
  files = sorted(p for p in root.rglob("*.py")
                 if "site-packages" not in p.parts and "dist-packages" not in p.parts)
  return [p for p in files if split_of(p.relative_to(root).as_posix()) == split]


def read_texts(split: str) -> list[str]:
  return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(split)]


def token_stream(texts: list[str], encode, eos_id: int) -> np.ndarray:
  """All texts tokenized and joined, each followed by EOS."""
  out = []
  for t in texts:
    out.extend(encode(t))
    out.append(eos_id)
  return np.asarray(out, np.int32)
