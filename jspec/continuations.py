"""Entry point of `python -m jspec.continuations`; the code lives in jspec/training/continuations.py."""
import sys

from jspec.training.continuations import main

if __name__ == "__main__":
  sys.exit(main())
