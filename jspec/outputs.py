"""Where the CLI's outputs go as prompts finish: a JSONL file that a rerun resumes, and streamed text printed
in prompt order."""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, TextIO

SEPARATOR = "-" * 40


class JsonlOutput:
  """One line per finished prompt, `{"index", "prompt", "text", "token_ids", "stats"}`, appended and flushed
  as each finishes. Lines already in the file mark their prompts done, so a rerun skips them; a last line
  cut short (an interrupted run) is dropped."""

  def __init__(self, path: str | pathlib.Path, prompts: list[str]):
    self.path = pathlib.Path(path)
    self.done: set[int] = set()
    if not self.path.exists():
      return
    try:
      data = self.path.read_bytes()
    except OSError as e:
      raise ValueError(f"cannot read --output: {e.strerror}: {path}") from None
    complete = data[:data.rfind(b"\n") + 1]  # an unterminated last line is from a run that was stopped
    for n, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), 1):
      try:
        entry = json.loads(line)
        index, prompt = entry["index"], entry["prompt"]
      except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path}:{n}: not an output line of jspec (a JSON object with \"index\" and "
                         "\"prompt\")") from None
      if not (isinstance(index, int) and 0 <= index < len(prompts) and prompts[index] == prompt):
        raise ValueError(f"{path}:{n}: prompt {index} is not the same prompt in this run's prompts; "
                         "write to another --output")
      self.done.add(index)
    if len(complete) < len(data):
      with self.path.open("r+b") as f:
        f.truncate(len(complete))

  def write(self, entry: dict[str, Any]) -> None:
    with self.path.open("a", encoding="utf-8") as f:
      f.write(json.dumps(entry) + "\n")


class OrderedPrinter:
  """Prints streamed outputs in prompt order, each as its prompt then its text: the text of the prompt
  being shown appears as it arrives, later prompts' text when their turn comes."""

  def __init__(self, prompts: list[str], file: TextIO | None = None):
    self.prompts, self.file = prompts, file or sys.stdout
    self.pending = [""] * len(prompts)
    self.finished = [False] * len(prompts)
    self.cursor, self.started = 0, False

  def add(self, position: int, text: str, finished: bool) -> None:
    self.pending[position] += text
    self.finished[position] |= finished
    while self.cursor < len(self.prompts):
      c = self.cursor
      if not self.started:
        self.file.write(self.prompts[c])
        self.started = True
      self.file.write(self.pending[c])
      self.pending[c] = ""
      if not self.finished[c]:
        break
      self.file.write(f"\n{SEPARATOR}\n")
      self.cursor, self.started = c + 1, False
    self.file.flush()
