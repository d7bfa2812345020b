import atexit
import gc
import logging
import os
import shutil
import tempfile

# Tests run on the CPU in fp32; keep XLA from grabbing every core's threads twice over.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' tiny programs spend far longer compiling than running: compile them with LLVM's cheap passes
# only, with XLA:CPU's elemental emitters rather than its fusion emitters (half the compile time of a decode
# program, and of every small op run eagerly), and as one LLVM module, not split for parallel code
# generation, since every core already runs a test worker (decode programs compiled 4-15% faster). The
# HLO and what it computes are the same; only the machine code is less tuned. Subprocesses inherit it.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# Compiled programs are kept in one cache for the whole run, out of the user's: the many tests that decode
# with the same tiny shapes load a program another test (or test worker) compiled. The process that makes
# the directory removes it; test workers and subprocesses inherit it.
if "JSPEC_COMPILE_CACHE" not in os.environ or "PYTEST_XDIST_WORKER" not in os.environ:
  os.environ["JSPEC_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
  atexit.register(shutil.rmtree, os.environ["JSPEC_COMPILE_CACHE"], ignore_errors=True)
# libtpu, where installed, takes a machine-wide lock unless told that several processes (test workers) load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Cross-tokenizer tables likewise (`jspec.text.vocab_map`).
if "JSPEC_VOCAB_MAP_DIR" not in os.environ or "PYTEST_XDIST_WORKER" not in os.environ:
  os.environ["JSPEC_VOCAB_MAP_DIR"] = tempfile.mkdtemp(prefix="jspec-test-vocab-")
  atexit.register(shutil.rmtree, os.environ["JSPEC_VOCAB_MAP_DIR"], ignore_errors=True)

import pytest  # noqa: E402

from jspec.decoding import program_cache  # noqa: E402

program_cache.use_compile_cache(os.environ["JSPEC_COMPILE_CACHE"])

# Tracing and lowering a decode program allocate millions of short-lived objects: collecting less often, past
# the modules imported by now (jax and jspec: frozen), lowers a program 7-12% faster here.
gc.freeze()
gc.set_threshold(50_000, 20, 20)


# Test files by the seconds they take on 2 cores, longest first. With several test workers, each worker takes
# the next file when it is nearly done with its own, so starting the long files first leaves only short ones
# for the end, when a worker may otherwise wait alone. A file not listed (new) starts first: its time is unknown.
BY_TIME = ("test_paging.py", "test_serve.py", "test_drafters.py", "test_constraints.py", "test_hf.py",
           "test_hlo.py", "test_sharding.py", "test_paged_mesh.py", "test_stream.py", "test_tree.py", "test_train.py",
           "test_sampling.py", "test_cli.py", "test_cross_vocab.py", "test_adaptive.py", "test_quantization.py",
           "test_calibration.py",
           "test_model.py", "test_gpu_check.py", "test_decode.py", "test_memory.py", "test_engine.py",
           "test_suffix.py", "test_executables.py", "test_accelerators.py", "test_package.py", "test_head_formats.py",
           "test_logprobs.py", "test_pallas_attention.py", "test_extension.py")


def pytest_configure(config):
  # pytest-xdist would otherwise hand out files by their number of tests, most first.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(BY_TIME)}
  items.sort(key=lambda item: rank.get(item.path.name, -1))


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Drops compiled programs after each test module. Every XLA:CPU executable keeps its own memory
  mappings alive, and a single process compiling a few hundred of them crashed inside the compiler."""
  yield
  program_cache.release_executables()


@pytest.fixture(autouse=True)
def _quiet_jspec_log():
  """The CLIs' `main` set up jspec's status lines on the stderr a test captured; the next test starts without
  them."""
  log = logging.getLogger("jspec")
  yield
  for handler in list(log.handlers):
    log.removeHandler(handler)
  log.setLevel(logging.NOTSET)
  log.propagate = True
