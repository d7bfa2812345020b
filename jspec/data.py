"""Entry point of `python -m jspec.data`; the code lives in jspec/training/data.py."""
import sys

from jspec.training.data import main

if __name__ == "__main__":
  sys.exit(main())
