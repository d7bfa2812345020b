"""Entry point of `python -m jspec.serve`; the command line lives in jspec/serve/cli.py."""
import sys

from jspec.serve.cli import main

if __name__ == "__main__":
  sys.exit(main())
