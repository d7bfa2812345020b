"""Tokenizers, always as a `tokenizer.json` read and written by the `tokenizers` package, and chat templates.

jspec's own tokenizers are byte-level, so decoding round-trips any text exactly, whitespace and indentation
included: `train_bpe` learns merges on a corpus; `byte_tokenizer` has none (256 byte tokens and
end-of-text). A model directory's chat template is rendered as transformers renders it, with jinja2 in its
sandbox: a template that comes with a downloaded model is untrusted input.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Iterable

import jinja2
import jinja2.sandbox
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


def detokenize(tok: Tokenizer, ids: list[int]) -> str:
  return tok.decode(ids, skip_special_tokens=True)


DETOKENIZE_WINDOW = 64  # tokens a push decodes again at most, besides its own


class IncrementalDetokenizer:
  """The text of a growing token sequence, handed out in pieces that are never broken: a character whose
  UTF-8 bytes span several tokens decodes as U+FFFD until its last byte arrives, so a trailing U+FFFD is
  held back until more tokens come (or `flush`, at the end, releases it).

  A push decodes a window of the latest tokens rather than all of them (as vLLM's detokenizer), so a long
  output costs each push the same: the window starts at a token where an earlier push had handed out all its
  text (a character boundary) and keeps the tokens before the new ones as context (a decoder's spaces
  between words depend on them)."""

  def __init__(self, tok: Tokenizer):
    self.tok, self.ids = tok, []
    self.start, self.sent = 0, 0  # the window's first token; characters of its text already handed out
    self.boundary = 0  # the token count at the end of the last push that held nothing back

  def push(self, ids: list[int]) -> str:
    """The new complete text after appending `ids`."""
    self.ids.extend(ids)
    text = detokenize(self.tok, self.ids[self.start:])
    end = len(text)
    while end > self.sent and text[end - 1] == "\ufffd":
      end -= 1
    piece, self.sent = text[self.sent:end], max(self.sent, end)
    if self.sent == len(text):  # nothing held back: the tokens end on a character
      if len(self.ids) - self.start > DETOKENIZE_WINDOW and self.boundary > self.start:
        # Not to a window with no text yet: a decoder that strips the text's first space (Llama-2's) would
        # strip the next piece's.
        tail = detokenize(self.tok, self.ids[self.boundary:])
        if tail:
          self.start, self.sent = self.boundary, len(tail)
      self.boundary = len(self.ids)
    return piece

  def flush(self) -> str:
    """Whatever is still held back."""
    text = detokenize(self.tok, self.ids[self.start:])
    piece, self.sent = text[self.sent:], len(text)
    return piece


@functools.lru_cache(maxsize=16)  # by identity: a loaded pair is checked once, not on every request (~4 ms)
def same_vocab(a: Tokenizer, b: Tokenizer) -> bool:
  """Whether two tokenizers map the same strings to the same ids."""
  return a.get_vocab() == b.get_vocab()


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A Jinja chat template and the special tokens it may name."""
  template: str
  special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text): bos_token, eos_token, ...

  def render(self, prompt: str) -> str:
    """`prompt` as a single user turn, with the generation prompt after it (what transformers'
    `apply_chat_template(..., add_generation_prompt=True)` renders)."""
    return self.render_messages([{"role": "user", "content": prompt}])

  def render_messages(self, messages: list[dict[str, str]]) -> str:
    """A conversation (`{"role", "content"}` dicts), with the generation prompt after it."""
    try:
      return _compiled(self.template).render(messages=messages, add_generation_prompt=True,
                                             **dict(self.special_tokens))
    except (jinja2.TemplateError, ValueError, TypeError) as e:
      raise ValueError(f"the chat template failed to render: {' '.join(str(e).split())[:200]}") from None


@functools.lru_cache(maxsize=8)  # a batch of prompts compiles its template once
def _compiled(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template)


def _raise(message: str):
  raise ValueError(message)


def load_chat_template(directory: pathlib.Path) -> ChatTemplate | None:
  """The chat template of a model directory (`chat_template.jinja`, `chat_template.json`, or the
  `chat_template` of `tokenizer_config.json`), or None when it has none."""
  directory = pathlib.Path(directory)
  config = {**_read_json(directory / "tokenizer_config.json"), **_read_json(directory / "chat_template.json")}
  template = config.get("chat_template")
  if (directory / "chat_template.jinja").is_file():
    template = (directory / "chat_template.jinja").read_text()
  if isinstance(template, list):  # named templates: the default one
    template = next((t.get("template") for t in template if t.get("name") == "default"), None)
  if not isinstance(template, str):
    return None
  special = {}
  for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
    token = config.get(name)
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str):
      special[name] = token
  return ChatTemplate(template, tuple(sorted(special.items())))


def save_chat_template(chat: ChatTemplate | None, directory: pathlib.Path) -> None:
  if chat is not None:
    (pathlib.Path(directory) / "chat_template.json").write_text(
        json.dumps({"chat_template": chat.template, **dict(chat.special_tokens)}, indent=2))


def _read_json(path: pathlib.Path) -> dict:
  try:
    return json.loads(path.read_text()) if path.is_file() else {}
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON ({e})") from None


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
  """Each ordinary token's bytes (special tokens left out): byte-level BPE maps characters back to bytes;
  SentencePiece-style vocabularies mark spaces with U+2581 and spell raw bytes as `<0xNN>`."""
  spec = json.loads(tokenizer.to_str())
  special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
  vocab = {i: s for s, i in tokenizer.get_vocab(with_added_tokens=True).items() if i not in special}
  if "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer")):
    byte_of = _byte_level_bytes()
    return {i: bytes(byte_of[ch] for ch in s) if all(ch in byte_of for ch in s) else s.encode()
            for i, s in vocab.items()}
  out = {}
  for i, s in vocab.items():
    if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
      out[i] = bytes([int(s[3:5], 16)])
    else:
      out[i] = s.replace("\u2581", " ").encode()
  return out


def _byte_level_bytes() -> dict[str, int]:
  """Byte-level BPE's character for each byte, inverted (GPT-2's `bytes_to_unicode`): printable bytes
  stand for themselves, the others for 256, 257, ... in byte order."""
  printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
  others = [b for b in range(256) if b not in printable]
  return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
