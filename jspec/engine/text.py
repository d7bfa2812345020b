"""A request's text as the engine hands it out: detokenized incrementally, cut at its first stop string, and
held back where its end could begin one."""
from __future__ import annotations

from collections.abc import Sequence

from jspec.text.tokenizer import IncrementalDetokenizer


class TextOutput:
  """A request's text, detokenized incrementally and cut at its first stop string; an end of the text
  that could begin a stop string is held back until the next tokens tell."""

  def __init__(self, tokenizer, stops: Sequence[str]):
    self.detokenizer, self.stops = IncrementalDetokenizer(tokenizer), [s for s in stops if s]
    self.held = ""

  def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
    """The text to hand out now, and whether a stop string ended it."""
    text = self.held + self.detokenizer.push(ids) + (self.detokenizer.flush() if final else "")
    cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
    if cut >= 0:
      self.held = ""
      return text[:cut], True
    keep = 0 if final else max((k for stop in self.stops for k in range(1, min(len(stop), len(text) + 1))
                                if text.endswith(stop[:k])), default=0)
    self.held = text[len(text) - keep:]
    return text[:len(text) - keep], False
