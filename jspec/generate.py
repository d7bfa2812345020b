"""Entry point of `python -m jspec.generate`; the command line lives in jspec/cli.py."""
import sys

from jspec.cli import main

if __name__ == "__main__":
  sys.exit(main())
