"""Entry point of `python -m jspec.train`; the command line lives in jspec/train/cli.py."""
import sys

from jspec.train.cli import main

if __name__ == "__main__":
  sys.exit(main())
