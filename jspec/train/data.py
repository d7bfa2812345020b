"""The training corpus: the CPython standard library's own source, found through `sysconfig`.

It exists wherever Python does, so anyone can rebuild the shipped models. Files are split by a hash of
their path relative to the stdlib root: about 96% train, 2% validation, 2% held out.
"""
from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import numpy as np

from jspec import flags


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


def shard_path(directory: pathlib.Path, split: str) -> pathlib.Path:
  return pathlib.Path(directory) / f"{split}.npy"


@flags.command
def main(argv: list[str] | None = None) -> int:
  """`python -m jspec.train data --out data/code`: train the BPE tokenizer on the train split, write token shards."""
  import argparse

  from tqdm import tqdm

  from jspec.text import tokenizer

  ap = argparse.ArgumentParser(prog="python -m jspec.train data")
  ap.add_argument("--out", default="data/code")
  ap.add_argument("--vocab-size", type=int, default=6144)
  ap.add_argument("--list", choices=("train", "validation", "heldout"),
                  help="print the files of this split, one per line, and stop")
  args = ap.parse_args(argv)
  if args.list:
    print("\n".join(map(str, corpus_files(args.list))))
    return 0
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"corpus: the standard library of this Python ({stdlib_root().name}), split by path hash")
  tok = tokenizer.train_bpe(read_texts("train"), args.vocab_size)
  tok.save(str(out / "tokenizer.json"))
  eos = tok.token_to_id(tokenizer.EOS_TOKEN)
  for split in ("train", "validation", "heldout"):
    ids = []
    for path in tqdm(corpus_files(split), desc=f"tokenizing {split}"):
      ids.extend(tokenizer.encode(tok, path.read_text(encoding="utf-8", errors="replace")))
      ids.append(eos)
    np.save(shard_path(out, split), np.asarray(ids, np.uint16 if args.vocab_size <= 65536 else np.int32))
    print(f"{split}: {len(ids):,} tokens")
  return 0
