"""`python -m jspec.train`: `--config FILE` trains a model, draft or heads (`trainer`); `drafter ...` a drafter
for any target from text files (`recipe`); `data ...` writes the corpus's tokenizer and token shards (`data`);
`continuations ...` the target's own continuations (`continuations`)."""
from __future__ import annotations

import sys

SUBCOMMANDS = ("drafter", "data", "continuations")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  command = argv[0] if argv[:1] and argv[0] in SUBCOMMANDS else None
  if command == "drafter":
    from jspec.train import recipe
    return recipe.main(argv[1:])
  if command == "data":
    from jspec.train import data
    return data.main(argv[1:])
  if command == "continuations":
    from jspec.train import continuations
    return continuations.main(argv[1:])
  from jspec.train import trainer
  return trainer.main(argv)
