"""The package's shape: no import cycles, light imports where they matter, a public surface that tools and
tests keep to, and a command line that answers --help without JAX."""
import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jspec
from jspec.core import shipped, xla_options

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "jspec"
MODULES = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PACKAGE.rglob("*.py")}


def _runtime_imports(path: pathlib.Path, type_only: bool = False) -> set[str]:
  """The jspec modules a module imports anywhere in its body (functions too; `if TYPE_CHECKING:` blocks,
  which never run, only with `type_only`)."""
  tree = ast.parse(path.read_text())
  skipped = set() if type_only else {
      id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
      for child in node.body for n in ast.walk(child)}
  found = set()
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("jspec")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in MODULES else node.module)
  return found


def _cycles() -> list[list[str]]:
  graph = {name: _runtime_imports(path, type_only=True) & set(MODULES) for name, path in MODULES.items()}
  cycles, state = [], {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  return cycles


def test_no_import_cycles_among_jspec_modules():
  assert _cycles() == []


def test_the_cycle_detector_finds_a_cycle(tmp_path, monkeypatch):
  a, b = tmp_path / "a.py", tmp_path / "b.py"
  a.write_text("def f():\n  from jspec import b\n")  # a lazy import hides a cycle no less
  b.write_text("from jspec.a import f\n")
  monkeypatch.setitem(MODULES, "jspec.a", a)
  monkeypatch.setitem(MODULES, "jspec.b", b)
  assert ["jspec.a", "jspec.b", "jspec.a"] in _cycles()
  b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from jspec.a import f\n")  # a cycle too
  assert ["jspec.a", "jspec.b", "jspec.a"] in _cycles()


def _layers() -> dict[str, int]:
  """Each module's layer, as docs/design.md's table lists them (0 first: the lowest)."""
  design = (REPO / "docs" / "design.md").read_text()
  table = design[design.index("| layer | package |"):].split("\n\n")[0].splitlines()[2:]
  layers = {}
  for index, row in enumerate(table):
    for entry in re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]):
      prefix = "jspec." + entry.removesuffix(".py").removesuffix("/").replace("/", ".")
      for name in MODULES:
        if name == prefix.removesuffix(".__init__") or (entry.endswith("/") and name.startswith(prefix + ".")) \
            or (entry.endswith("/") and name == prefix):
          layers[name] = index
  return layers


def _upward_imports(layers: dict[str, int]) -> list[str]:
  return [f"{name} ({layers[name]}) imports {dep} ({layers[dep]})"
          for name, path in sorted(MODULES.items()) if name in layers
          for dep in sorted(_runtime_imports(path, type_only=True) & set(layers)) if layers[dep] > layers[name]]


def test_every_import_points_down_the_layers_of_the_design():
  layers = _layers()
  assert sorted(set(MODULES) - set(layers)) == [], "modules docs/design.md's layer table does not list"
  assert _upward_imports(layers) == []


def test_the_layers_are_packages_and_the_top_holds_the_public_api_and_the_commands():
  top = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert len(top) <= 12, top
  design = (REPO / "docs" / "design.md").read_text()
  table = design[design.index("| layer | package |"):].split("\n\n")[0].splitlines()[2:]
  packages = [entry for row in table for entry in re.findall(r"`(\w+/)`", row.split("|")[2])]
  assert sorted(packages) == sorted(p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
  low = tmp_path / "low.py"
  low.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from jspec.api import generate\n")
  monkeypatch.setitem(MODULES, "jspec.low", low)
  layers = {**_layers(), "jspec.low": 0}
  assert _upward_imports(layers) == [f"jspec.low (0) imports jspec.api ({layers['jspec.api']})"]


def _modules_after(code: str) -> set[str]:
  out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                       capture_output=True, text=True, cwd=REPO, timeout=300, check=True).stdout
  return {m.split(".")[0] for m in out.split()}


def test_the_decode_loop_imports_no_checkpoint_tokenizer_or_training_machinery():
  loaded = _modules_after("import jspec.decoding.loop")
  assert "jax" in loaded
  assert not loaded & {"orbax", "tokenizers", "transformers", "torch", "optax"}
  assert "optax" not in _modules_after("import jspec.drafters")


def test_help_and_version_answer_without_jax():
  proc = subprocess.run([sys.executable, "-m", "jspec.generate", "--help"], capture_output=True, text=True,
                        cwd=REPO, timeout=300)
  assert proc.returncode == 0
  for group in ("models:", "prompts and output:", "sampling:", "speculation:", "adaptive speculation:",
                "distributed:", "examples:", "(default: 8)"):
    assert group in proc.stdout, group
  loaded = _modules_after("from jspec import cli\ntry:\n  cli.main(['--help'])\nexcept SystemExit:\n  pass")
  assert "jax" not in loaded and "numpy" not in loaded
  proc = subprocess.run([sys.executable, "-m", "jspec.generate", "--version"], capture_output=True, text=True,
                        cwd=REPO, timeout=300)
  assert proc.stdout.strip() == f"jspec {jspec.__version__}"


def test_xla_cpu_dots_are_chosen_unless_xla_flags_choose(monkeypatch):
  monkeypatch.setattr(xla_options, "_jaxlib_version", lambda: "0.10.2")
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/dev/null")
  xla_options.prefer_xla_dots()
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/dev/null --xla_cpu_experimental_ynn_fusion_type="
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
  xla_options.prefer_xla_dots()
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"
  monkeypatch.setattr(xla_options, "_jaxlib_version", lambda: "0.11.0")  # not known to have the flag
  monkeypatch.delenv("XLA_FLAGS")
  xla_options.prefer_xla_dots()
  assert "XLA_FLAGS" not in os.environ


def test_public_names_resolve():
  for name in jspec.__all__:
    assert getattr(jspec, name) is not None and name in dir(jspec)


def _module_names(tree: ast.Module) -> set[str]:
  """The names a file binds to jspec modules (`import jspec`, `from jspec.x import y` where y is a module)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("jspec")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jspec"):
      names |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
  return names


def test_tools_and_tests_use_only_public_names():
  offenders = []
  for path in [*(REPO / "tests").glob("*.py"), *(REPO / "tools").glob("*.py")]:
    tree = ast.parse(path.read_text())
    modules = _module_names(tree)
    offenders += [f"{path.name}: {ast.unparse(node)}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and ast.unparse(node.value).split(".")[0] in modules]
  assert offenders == []


@pytest.mark.slow
def test_an_installed_wheel_finds_the_shipped_models_and_reuses_compiled_programs(tmp_path):
  """`pip install .` (not editable), then `jspec.generate` from another directory: the shipped checkpoints
  come with the package, and a second run loads its program from the persistent compile cache."""
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp_path)],
                 check=True, timeout=300)
  wheel, = tmp_path.glob("jspec-*.whl")
  site = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                 check=True, timeout=300)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = {**os.environ, "PYTHONPATH": str(site), "JSPEC_COMPILE_CACHE": str(tmp_path / "xla")}
  run = lambda *args: subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=elsewhere,
                                     env=env, timeout=300)
  where = run("-c", "from jspec.core import shipped; print(shipped.TARGET)")
  assert pathlib.Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
  # The small pair (quicker to compile); its checkpoints come with the package as the default pair's do.
  command = ["-m", "jspec.generate", "--target", "code-small", "--prompt", "def parse_args(", "--max-new-tokens", "8",
             "--no-adaptive", "--draft-len", "2"]
  first = run(*command, "--json")
  assert first.returncode == 0, first.stderr
  out = json.loads(first.stdout)
  assert out["stats"]["drafter"] == shipped.DEFAULT_DRAFTER and len(out["outputs"][0]["token_ids"]) == 8
  second = run(*command)
  assert second.returncode == 0, second.stderr
  assert "loading the target" in second.stderr and "loaded the decode program" in second.stderr, second.stderr
  assert run(*command, "--quiet").stderr == ""
