"""Entry point of `python -m jspec.train`; the code lives in jspec/training/train.py."""
import sys

from jspec.training.train import main

if __name__ == "__main__":
  sys.exit(main())
