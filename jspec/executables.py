"""Compiled executables kept on disk, so a later process runs a program without tracing, lowering or
compiling it again.

JAX's persistent compilation cache skips only XLA's compile: every process still traces and lowers the
program to find its cache key, which for the adaptive decode program (one branch per draft length) takes
longer than the decode itself. Here an executable is stored under a key of everything its program depends
on: the program's name and static values, the arguments' tree (which holds the decoder's configs) and
their shapes, dtypes and shardings, the devices and the process's index among several, the versions of jax
and jaxlib, XLA's options (`XLA_FLAGS`), and the digest of jspec's own source. Files are the user's own
cache (like JAX's, loading one runs its code); one that cannot be read is compiled again.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger("jspec")
SUBDIR = "jspec-executables"


@functools.cache
def source_digest() -> str:
  """The digest of jspec's Python source: a changed program never loads a stale executable."""
  root = Path(__file__).parent
  digest = hashlib.sha256()
  for file in sorted(root.rglob("*.py")):
    digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
  return digest.hexdigest()


def path(cache_dir: str, name: str, args: tuple, static: dict[str, Any]) -> Path:
  """Where the executable of program `name` for these arguments is kept."""
  leaves = tuple((x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(args))
  identity = repr((name, sorted(static.items()), str(jax.tree.structure(args)), leaves, jax.__version__,
                   jaxlib.__version__, [str(d) for d in jax.devices()], jax.process_index(), jax.config.jax_enable_x64,
                   jax.config.jax_default_matmul_precision, os.environ.get("XLA_FLAGS", ""), source_digest()))
  return Path(cache_dir) / SUBDIR / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.bin"


def load(file: Path) -> Any | None:
  """The executable stored in `file`, or None if there is none (or it cannot be loaded: then it is removed)."""
  try:
    payload, in_tree, out_tree = pickle.loads(file.read_bytes())
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except FileNotFoundError:
    return None
  except Exception as error:  # noqa: BLE001 - a stale or partial file: compile instead
    log.debug("cannot load %s (%s); compiling", file, error)
    file.unlink(missing_ok=True)
    return None


def store(file: Path, executable: Any) -> None:
  """Writes `executable` to `file` atomically; a program that cannot be serialized is not stored."""
  try:
    data = pickle.dumps(serialize_executable.serialize(executable))
  except Exception as error:  # noqa: BLE001 - e.g. a backend without serialization
    log.debug("cannot store the executable (%s)", error)
    return
  file.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile(dir=file.parent, delete=False) as out:
    out.write(data)
  os.replace(out.name, file)
