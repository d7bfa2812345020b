"""How a draft model with another tokenizer drafts for a target: token-level intersection (Timor et al., ICML
2025), as device tables built once per tokenizer pair.

Two tokens correspond when they spell the same bytes (byte-level BPE characters and SentencePiece's U+2581
and `<0xNN>` read as the bytes they stand for, `jspec.text.tokenizer.token_bytes`), or are special tokens of the
same name; the two end-of-text tokens always correspond. The drafter proposes only tokens in the
intersection, from its distribution restricted to them and renormalised, mapped to target ids; the target
verifies with the ordinary rule, so the output keeps the target's distribution exactly.

The draft reads the text as draft tokens: each target token's bytes spelled in draft tokens (the draft
tokenizer's own encoding of them where it spells them back exactly, else the longest draft tokens that
match, left to right), at most `MAX_SPELLING` per target token. A target token in the intersection is
spelled as its one counterpart, so what the draft fed itself while drafting stays valid once accepted. The
draft sees a segmentation of the same text that may differ from its tokenizer's on the whole text: that only
makes it draft worse, never wrong.

Tables are kept by the pair's digest, in memory and under `cache_dir()`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

import numpy as np
from tokenizers import Tokenizer

from jspec.core.settings import user_cache_dir
from jspec.text.tokenizer import token_bytes

MAX_SPELLING = 4  # draft tokens per target token at most; longer spellings are cut (the draft sees less text)
MIN_SHARED = 0.25  # refuse a pair whose intersection holds less than this fraction of the draft's vocabulary
VERSION = 1  # of the tables' layout and rules: part of the cache key


@dataclasses.dataclass(frozen=True)
class VocabMap:
  """The tables of one (target, draft) pair.

  draft_ids_I, target_ids_I: the intersection, as pairs of ids (each id at most once on either side).
  spelling_VtxL, spelling_lens_Vt: each target id's text as draft ids, left-aligned, and how many (>= 1).
  shared_fraction: the intersection's size over the draft's vocabulary (its ordinary and special tokens).
  """
  draft_ids_I: np.ndarray
  target_ids_I: np.ndarray
  spelling_VtxL: np.ndarray
  spelling_lens_Vt: np.ndarray
  shared_fraction: float

  @property
  def spelling_len(self) -> int:
    return self.spelling_VtxL.shape[1]

  def arrays(self) -> dict[str, np.ndarray]:
    """What the jitted loop reads (beside the draft's weights)."""
    return {"draft_ids": self.draft_ids_I, "target_ids": self.target_ids_I, "spelling": self.spelling_VtxL,
            "spelling_lens": self.spelling_lens_Vt}


def cache_dir() -> pathlib.Path:
  """$JSPEC_VOCAB_MAP_DIR, else jspec/vocab_map under the user's cache directory."""
  return pathlib.Path(os.environ.get("JSPEC_VOCAB_MAP_DIR") or user_cache_dir("vocab_map"))


def vocab_map(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int,
              target_eos: int | None, draft_eos: int | None) -> VocabMap:
  """The tables for a target of `target_vocab` embedding rows and a draft of `draft_vocab` (either may pad
  past its tokenizer), from the cache or built and stored. A pair sharing too little is a ValueError."""
  args = (target, draft, target_vocab, draft_vocab, target_eos, draft_eos)
  key = _pair_key(*args)
  vmap = _memory.get(key) or _stored(key, args)
  _memory[key] = vmap
  while len(_memory) > 8:  # the pairs of this process, the oldest dropped first
    _memory.pop(next(iter(_memory)))
  if vmap.shared_fraction < MIN_SHARED:
    raise ValueError(f"the draft's tokenizer shares {vmap.shared_fraction:.1%} of its vocabulary with the "
                     f"target's, under the {MIN_SHARED:.0%} a cross-tokenizer draft needs")
  return vmap


_memory: dict[str, VocabMap] = {}


@functools.lru_cache(maxsize=16)  # by identity: a loaded pair is digested once
def _pair_key(target: Tokenizer, draft: Tokenizer, *sizes) -> str:
  described = json.dumps([VERSION, target.to_str(), draft.to_str(), *sizes])
  return hashlib.sha256(described.encode()).hexdigest()[:32]


def _stored(key: str, args: tuple) -> VocabMap:
  path = cache_dir() / f"{key}.npz"
  if path.is_file():
    try:
      with np.load(path, allow_pickle=False) as f:
        return VocabMap(f["draft_ids"], f["target_ids"], f["spelling"], f["spelling_lens"],
                        float(f["shared_fraction"]))
    except (OSError, ValueError, KeyError):
      pass  # unreadable: built again below
  vmap = build(*args)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{key}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **vmap.arrays(), shared_fraction=np.float64(vmap.shared_fraction))
    tmp.replace(path)
  except OSError:
    pass  # a read-only cache only costs a rebuild
  return vmap


def _keys(tok: Tokenizer, vocab: int, eos: int | None) -> dict[int, object]:
  """Each id's key: its bytes, ("special", name) for special tokens, "eos" for the end-of-text id."""
  spec = json.loads(tok.to_str())
  keys: dict[int, object] = {i: b for i, b in token_bytes(tok).items() if i < vocab}
  keys |= {t["id"]: ("special", t["content"]) for t in spec.get("added_tokens", [])
           if t.get("special") and t["id"] < vocab}
  if eos is not None:
    keys[eos] = "eos"
  return keys


def build(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int, target_eos: int | None,
          draft_eos: int | None) -> VocabMap:
  """The tables of `VocabMap`, computed."""
  target_keys, draft_keys = _keys(target, target_vocab, target_eos), _keys(draft, draft_vocab, draft_eos)
  draft_of: dict[object, int] = {}
  for d in sorted(draft_keys):
    draft_of.setdefault(draft_keys[d], d)  # duplicates: the first id stands for its key
  counterpart: dict[int, int] = {}  # target id -> draft id
  taken = set()
  for t in sorted(target_keys):
    d = draft_of.get(target_keys[t])
    if d is not None and d not in taken:
      counterpart[t] = d
      taken.add(d)
  fallback = draft_eos if draft_eos is not None else 0
  spelled = _spellings(target_keys, draft, draft_keys, counterpart, fallback)
  width = min(MAX_SPELLING, max(map(len, spelled.values()), default=1))
  spelling = np.full((target_vocab, width), fallback, np.int32)
  lens = np.ones(target_vocab, np.int32)
  for t, ids in spelled.items():
    spelling[t, :min(len(ids), width)] = ids[:width]
    lens[t] = min(len(ids), width)
  pairs = sorted((d, t) for t, d in counterpart.items())
  draft_ids = np.asarray([d for d, _ in pairs], np.int32)
  target_ids = np.asarray([t for _, t in pairs], np.int32)
  return VocabMap(draft_ids, target_ids, spelling, lens, len(pairs) / max(len(draft_keys), 1))


def _spellings(target_keys: dict[int, object], draft: Tokenizer, draft_keys: dict[int, object],
               counterpart: dict[int, int], fallback: int) -> dict[int, list[int]]:
  """Each target id's text as draft ids, never empty (a token the draft cannot spell is `fallback`)."""
  draft_bytes = {d: k for d, k in draft_keys.items() if isinstance(k, bytes)}
  by_bytes = {k: d for d, k in sorted(draft_bytes.items(), reverse=True)}  # the first id wins
  longest = max(map(len, by_bytes), default=0)
  match = lambda data: _longest_match(data, by_bytes, longest) or [fallback]
  out = {t: [d] for t, d in counterpart.items()}
  texts = {}
  for t, key in target_keys.items():
    if t in out:
      continue
    if not isinstance(key, bytes):  # a special token the draft lacks
      out[t] = [fallback]
      continue
    try:
      texts[t] = key.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: no text to encode
      out[t] = match(key)
  encodings = draft.encode_batch(list(texts.values()), add_special_tokens=False)
  for t, enc in zip(texts, encodings):
    ids = enc.ids
    exact = ids and all(i in draft_bytes for i in ids) and b"".join(draft_bytes[i] for i in ids) == target_keys[t]
    # Otherwise the tokenizer added or changed text (a prefix space, a normaliser): match the bytes instead.
    out[t] = list(ids) if exact else match(target_keys[t])
  return out


def _longest_match(data: bytes, by_bytes: dict[bytes, int], longest: int) -> list[int]:
  """`data` as the longest draft tokens (of at most `longest` bytes) that match, left to right; bytes no
  token spells are skipped."""
  out, i = [], 0
  while i < len(data):
    for n in range(min(longest, len(data) - i), 0, -1):
      d = by_bytes.get(data[i:i + n])
      if d is not None:
        out.append(d)
        i += n
        break
    else:
      i += 1
  return out
