"""Entry point of `python -m jspec.bench`; the command line lives in jspec/bench/cli.py."""
import sys

from jspec.bench.cli import main

if __name__ == "__main__":
  sys.exit(main())
