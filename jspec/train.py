"""Entry point of `python -m jspec.train`: `--config FILE` (jspec/training/train.py) or `drafter ...`
(jspec/training/recipe.py)."""
import sys

from jspec.training import recipe, train


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["drafter"]:
    return recipe.main(argv[1:])
  return train.main(argv)


if __name__ == "__main__":
  sys.exit(main())
