"""Tokenizers, always as a `tokenizer.json` read and written by the `tokenizers` package.

Both kinds are byte-level, so decoding round-trips any text exactly, whitespace and indentation included:
`train_bpe` learns merges on a corpus; `byte_tokenizer` has none (256 byte tokens and end-of-text).
"""
from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


def byte_tokenizer() -> Tokenizer:
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([EOS_TOKEN])
  return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=True,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  return tok


def load_tokenizer(directory: pathlib.Path) -> Tokenizer:
  path = pathlib.Path(directory) / "tokenizer.json"
  if not path.is_file():
    raise ValueError(f"{directory}: no tokenizer.json")
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # the tokenizers package raises its own exception types
    raise ValueError(f"{path}: cannot read the tokenizer ({e})") from None


def encode(tok: Tokenizer, text: str) -> list[int]:
  return tok.encode(text, add_special_tokens=False).ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
  return tok.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=16)  # by identity: a loaded pair is checked once, not on every request (~4 ms)
def same_vocab(a: Tokenizer, b: Tokenizer) -> bool:
  """Whether two tokenizers map the same strings to the same ids."""
  return a.get_vocab() == b.get_vocab()
