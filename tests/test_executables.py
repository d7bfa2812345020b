"""Executables kept on disk: a later process loads the program it needs instead of compiling it, and gets
the same tokens; another program, other shapes or a damaged file never load a wrong executable."""
import contextlib
import json
import logging
import os
import threading
import types

import jax
import pytest

import jspec
from jspec import testing
from jspec.decoding import executables, program_cache

NO_EOS = testing.NO_EOS


@pytest.fixture
def cache_dir(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  program_cache.use_compile_cache(str(tmp_path))
  program_cache.release_executables()
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", before)
  program_cache.release_executables()


def stored(cache_dir):
  return sorted((cache_dir / executables.SUBDIR).glob("*.bin"))


@pytest.mark.slow
def test_a_new_process_loads_the_program_and_decodes_the_same(cache_dir, caplog):
  target = testing.random_model(NO_EOS, seed=0, scale=2.0)
  draft = testing.perturbed(target, 0.5)
  kw = dict(draft=draft, max_new_tokens=12, temperature=1.0, seed=3, spec=jspec.SpecConfig(adaptive=None))
  first = jspec.generate(target, ["def f(", "x"], **kw)
  files = stored(cache_dir)
  assert len(files) == 1 and files[0].name.startswith("decode-")
  program_cache.release_executables()  # what a new process has
  with caplog.at_level(logging.INFO, logger="jspec"):
    again = jspec.generate(target, ["def g(", "y"], **dict(kw, seed=5))
    second = jspec.generate(target, ["def f(", "x"], **kw)
  assert "loading the decode program" in caplog.text and "loaded the decode program" in caplog.text
  assert "compiling" not in caplog.text
  assert second.token_ids == first.token_ids and again.token_ids != first.token_ids
  # Another batch, another program: another file.
  jspec.generate(target, ["def f("], **kw)
  assert len(stored(cache_dir)) == 2


def test_a_damaged_file_is_compiled_again(cache_dir):
  target = testing.random_model(NO_EOS, seed=0)
  first = jspec.generate(target, ["abc"], max_new_tokens=8)
  [file] = stored(cache_dir)
  file.write_bytes(file.read_bytes()[:100])
  program_cache.release_executables()
  assert executables.load(file) is None and not file.exists()
  assert jspec.generate(target, ["abc"], max_new_tokens=8).token_ids == first.token_ids


def test_the_key_changes_with_the_source_xla_options_and_the_static_values(cache_dir, monkeypatch):
  requests_args = (jax.numpy.zeros((2, 3)),)
  a = executables.path(str(cache_dir), "decode", requests_args, {"capacity": 64})
  assert executables.path(str(cache_dir), "decode", requests_args, {"capacity": 64}) == a
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
  assert executables.path(str(cache_dir), "decode", requests_args, {"capacity": 64}) != a
  monkeypatch.undo()
  monkeypatch.setattr(executables, "source_digest", lambda: "edited")
  assert executables.path(str(cache_dir), "decode", requests_args, {"capacity": 64}) != a
  assert executables.path(str(cache_dir), "decode", requests_args, {"capacity": 128}) != a


def test_a_stored_program_is_not_written_to_jaxs_cache_too(cache_dir, caplog):
  """A program jspec's store keeps is serialized once, into the store, not into JAX's cache as well."""
  target = testing.random_model(NO_EOS, seed=0)
  with caplog.at_level(logging.DEBUG, logger="jax._src.compilation_cache"):
    jspec.generate(target, ["pqr", "s"], max_new_tokens=5)
    jax.jit(lambda x: jax.numpy.sin(x) * 7.25)(jax.numpy.ones(3))  # written: what JAX alone compiles
  assert len(stored(cache_dir)) == 1
  written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Writing ")]
  assert written and not any(m.startswith("Writing jit__run ") for m in written), written


def test_a_program_only_jaxs_cache_holds_is_compiled_once_more_and_stored(cache_dir, caplog, monkeypatch):
  """After an upgrade JAX's compilation cache holds a program that jspec's store (keyed by jspec's source)
  does not. XLA:CPU's executable loaded from JAX's cache fails to run once serialized again ("Function ... not
  found"), so it is compiled once more under a key of its own and stored: later processes load it."""
  target = testing.random_model(NO_EOS, seed=0)
  with monkeypatch.context() as m:  # an earlier jspec, which let JAX's cache keep what it stored too
    m.setattr(program_cache, "jax_config", types.SimpleNamespace(
        persistent_cache_min_compile_time_secs=lambda seconds: contextlib.nullcontext()))
    first = jspec.generate(target, ["x"], max_new_tokens=4)
  for file in stored(cache_dir):
    file.unlink()
  program_cache.release_executables()
  jax.clear_caches()
  with caplog.at_level(logging.DEBUG, logger="jax._src.compiler"):
    again = jspec.generate(target, ["x"], max_new_tokens=4)  # held by JAX's cache: compiled again and stored
  assert "Persistent compilation cache hit for 'jit__run'" in caplog.text
  caplog.clear()
  assert len(stored(cache_dir)) == 1
  program_cache.release_executables()
  with caplog.at_level(logging.INFO, logger="jspec"):
    last = jspec.generate(target, ["x"], max_new_tokens=4)
  assert "loaded the decode program" in caplog.text and "compiling" not in caplog.text
  assert first.token_ids == again.token_ids == last.token_ids


def test_a_program_jax_holds_from_its_cache_is_not_stored(cache_dir):
  """`compile()` returns an executable JAX already holds without a word: one it loaded from its cache
  earlier in the process is not stored either; one XLA compiles now is."""
  x = jax.numpy.ones(4)
  f = jax.jit(lambda x: jax.numpy.cos(x) + 1)
  f(x)  # compiled, and kept in JAX's cache
  jax.clear_caches()
  f(x)  # loaded from JAX's cache
  program_cache.compiled("f", lambda: f.lower(x), (x,))
  assert stored(cache_dir) == []
  program_cache.compiled("g", lambda: jax.jit(lambda x: jax.numpy.tan(x) * 3).lower(x), (x,))
  assert len(stored(cache_dir)) == 1


def test_a_run_again_loads_its_programs_while_it_starts(cache_dir, monkeypatch):
  """`prefetch` loads on a thread the executables a run with the same settings used last time; the run takes
  one only where its own key leads to that file. A run that used other programs replaces the list."""
  target = testing.random_model(NO_EOS, seed=0)
  loads = []
  load = executables.load
  monkeypatch.setattr(executables, "load", lambda file: loads.append((file.name, threading.current_thread().name))
                      or load(file))
  executables.prefetch(str(cache_dir), "run a")
  first = jspec.generate(target, ["abc"], max_new_tokens=8)
  [file] = stored(cache_dir)
  program_cache.release_executables()  # a new process, the same settings
  loads.clear()
  executables.prefetch(str(cache_dir), "run a")
  assert jspec.generate(target, ["abc"], max_new_tokens=8).token_ids == first.token_ids
  assert [(name, thread.startswith("jspec-prefetch")) for name, thread in loads] == [(file.name, True)]
  program_cache.release_executables()  # other settings: nothing prefetched, the program loads when needed
  loads.clear()
  executables.prefetch(str(cache_dir), "run b")
  assert jspec.generate(target, ["abc"], max_new_tokens=8).token_ids == first.token_ids
  assert [(name, thread.startswith("jspec-prefetch")) for name, thread in loads] == [(file.name, False)]
  program_cache.release_executables()  # run a again, with another program: only that one is kept for it
  executables.prefetch(str(cache_dir), "run a")
  jspec.generate(target, ["abc", "de"], max_new_tokens=8)
  [other] = set(stored(cache_dir)) - {file}
  runs = json.loads((cache_dir / executables.SUBDIR / executables.RUNS_FILE).read_text())
  assert sorted(runs.values()) == sorted([[file.name], [other.name]])
  # A damaged or hostile list is ignored.
  (cache_dir / executables.SUBDIR / executables.RUNS_FILE).write_text(json.dumps({k: ["../x", 3] for k in runs}))
  program_cache.release_executables()
  loads.clear()
  executables.prefetch(str(cache_dir), "run a")
  (cache_dir / executables.SUBDIR / executables.RUNS_FILE).write_text("{")
  executables.prefetch(str(cache_dir), "run a")
  assert loads == []
