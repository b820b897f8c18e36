"""The training path in modules a reader can hold: none longer than LIMIT lines; the paper's
model in PAPER_LIMIT lines; and no module of the package importing (anywhere, inside
functions too) one that imports it back."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "seq2seq"
LIMIT = 350
TRAINING_PATH = ("train_lib", "steps", "evaluate", "workdir", "lock", "checkpoint",
                 "checksums", "load", "metrics", "state", "losses", "optim", "sharding")
# The reference path, read as the paper: what exists for speed or for the parameters'
# layout (layout.py, kernels/) lives elsewhere.
PAPER = ("attention", "layers", "model", "losses")
PAPER_LIMIT = 600


@pytest.mark.parametrize("name", TRAINING_PATH)
def test_the_training_paths_modules_are_short(name):
  lines = len((PACKAGE / f"{name}.py").read_text().splitlines())
  assert lines <= LIMIT, f"seq2seq/{name}.py has {lines} lines, more than {LIMIT}"


def test_the_papers_model_reads_in_few_lines():
  lines = {n: len((PACKAGE / f"{n}.py").read_text().splitlines()) for n in PAPER}
  assert sum(lines.values()) <= PAPER_LIMIT, \
      f"{', '.join(f'{n}.py {k}' for n, k in lines.items())}: {sum(lines.values())} lines " \
      f"together, more than {PAPER_LIMIT}"


def _modules() -> dict[str, Path]:
  return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
          .removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules) -> set[str]:
  """The package's modules that `path` imports anywhere: at import time or inside a function
  (a lazy import still ties the two modules together)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:   # `from package import module` imports the module
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in modules else node.module)
  return found & set(modules)


def test_no_import_cycle():
  modules = _modules()
  graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
  done, path = set(), []

  def visit(m):
    if m in path:
      cycle = path[path.index(m):] + [m]
      pytest.fail("import cycle: " + " -> ".join(cycle))
    if m in done:
      return
    path.append(m)
    for d in sorted(graph[m]):
      visit(d)
    path.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)
