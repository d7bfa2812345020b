import atexit
import os
import shutil
import tempfile

# Tests run on the CPU in fp32; keep XLA from grabbing every core's threads twice over.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI keeps compiled programs in a persistent cache; tests keep theirs out of the user's.
os.environ["JSPEC_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-xla-")
atexit.register(shutil.rmtree, os.environ["JSPEC_COMPILE_CACHE"], ignore_errors=True)

import pytest  # noqa: E402

from jspec import engine  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Drops compiled programs after each test module. Every XLA:CPU executable keeps its own memory
  mappings alive, and a single process compiling a few hundred of them crashed inside the compiler."""
  yield
  engine.release_executables()
