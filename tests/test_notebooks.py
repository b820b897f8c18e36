"""The Colab notebooks (colab/*.ipynb): committed as colab/make_notebooks.py writes them,
without outputs, and each runs top to bottom without an error.

The notebooks run in order in one shared workdir (notebooks 2 and 3 reuse the model that
notebook 1 trains; run alone, they train it themselves) in their small setting,
SEQ2SEQ_NOTEBOOK_SMOKE=1, on a Jupyter kernel of this very interpreter (a kernelspec
written to a temporary JUPYTER_PATH), so the test needs no registered kernel.
SEQ2SEQ_NOTEBOOK_KEEP=1 keeps the executed notebooks (with outputs) in the test's workdir.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("01_quickstart", "02_anatomy", "03_fast_decoding")
KERNEL = "seq2seq-test-python"
CELL_TIMEOUT = 600  # seconds per cell


def _make_notebooks():
  spec = importlib.util.spec_from_file_location("make_notebooks", COLAB / "make_notebooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _repository_url() -> str:
  """[project.urls] Repository of pyproject.toml: the notebooks' one source for it."""
  url = _make_notebooks().repository_url()
  assert url.startswith("https://github.com/") and f'"{url}"' in (ROOT / "pyproject.toml").read_text()
  return url


def test_notebooks_are_generated_and_committed_without_outputs():
  assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)
  check = subprocess.run([sys.executable, str(COLAB / "make_notebooks.py"), "--check"],
                         capture_output=True, text=True)
  assert check.returncode == 0, check.stderr
  repo = _repository_url()
  owner_name = repo.removeprefix("https://github.com/")
  for name in NOTEBOOKS:
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0].source
    assert (f"https://colab.research.google.com/github/{owner_name}/blob/main/colab/{name}.ipynb"
            in first)
    assert "**Runtime:**" in first and "pip install -e '.[notebooks]'" in first
    assert "pip" in nb.cells[1].source and f'REPO_URL = "{repo}"' in nb.cells[1].source
    assert nb.cells[2].cell_type == "code" and "import seq2seq" in nb.cells[2].source  # setup
    assert nb.cells[3].cell_type == "markdown", \
        f"{name}: the first cell after the setup has no text before it"
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs committed"


def test_notebooks_extra_has_a_jupyter_front_end_and_dev_does_not():
  tomllib = pytest.importorskip("tomllib")
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert any(d.startswith("jupyterlab") for d in extras["notebooks"])  # what the intros say
  assert not any(d.startswith(("jupyterlab", "notebook")) for d in extras["dev"])  # CI's install


def test_make_notebooks_repo_option_writes_a_forks_url(tmp_path):
  """--repo URL: the install cell and the badges of a fork (checked with --check)."""
  fork = "https://github.com/someone/seq2seq-fork"
  check = subprocess.run([sys.executable, str(COLAB / "make_notebooks.py"), "--check",
                          "--repo", fork], capture_output=True, text=True)
  assert check.returncode == 1 and "out of date" in check.stderr   # committed: pyproject's URL
  bad = subprocess.run([sys.executable, str(COLAB / "make_notebooks.py"), "--check",
                        "--repo", "https://example.org/x"], capture_output=True, text=True)
  assert bad.returncode != 0 and "not a GitHub repository URL" in bad.stderr


# --- the install cell, run outside Colab with pip and the environment faked --------------

def _install_cell(repo_url=None) -> str:
  source = nbformat.read(COLAB / "01_quickstart.ipynb", as_version=4).cells[1].source
  for name in NOTEBOOKS[1:]:  # the same cell in every notebook
    assert nbformat.read(COLAB / f"{name}.ipynb", as_version=4).cells[1].source == source
  if repo_url and repo_url != _repository_url():
    source = source.replace(f'REPO_URL = "{_repository_url()}"', f'REPO_URL = "{repo_url}"')
    assert f'REPO_URL = "{repo_url}"' in source
  return source


class _FakePip:
  def __init__(self, returncode=0, on_run=None):
    self.calls, self.returncode, self.on_run = [], returncode, on_run

  def __call__(self, args, **kw):
    self.calls.append(list(args))
    if self.on_run:
      self.on_run()
    return subprocess.CompletedProcess(args, self.returncode, stdout="", stderr="ERROR: no\n")


def _run_install_cell(source, monkeypatch, tmp_path, pip, versions=None, src_dir=None):
  """Runs the cell as if seq2seq were not installed, in an empty folder ($SEQ2SEQ_SRC =
  `src_dir`); returns the exception it stopped with (None if it ran through)."""
  import importlib.metadata
  import importlib.util
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "seq2seq" else real_find_spec(name, *a))
  monkeypatch.setattr(subprocess, "run", pip)
  if versions is not None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
  if src_dir:
    monkeypatch.setenv("SEQ2SEQ_SRC", str(src_dir))
  else:
    monkeypatch.delenv("SEQ2SEQ_SRC", raising=False)
  monkeypatch.chdir(tmp_path)
  try:
    exec(compile(source, "install-cell", "exec"), {})
  except Exception as e:  # noqa: BLE001 -- the cell's own InstallStopped
    assert type(e).__name__ == "InstallStopped", repr(e)
    shown = e._render_traceback_()         # what IPython prints instead of a traceback
    assert len(shown) == 1 and "\n" not in shown[0]
    return e
  return None


def test_install_cell_stops_with_one_line_when_the_url_is_a_placeholder(monkeypatch, tmp_path):
  placeholder = "https://github.com/your-org/seq2seq"  # pyproject.toml's until there is one
  pip = _FakePip()
  stopped = _run_install_cell(_install_cell(placeholder), monkeypatch, tmp_path, pip)
  assert stopped is not None and "placeholder" in str(stopped) and "REPO_URL" in str(stopped)
  assert pip.calls == []                   # no doomed `pip install git+<placeholder>`


def test_install_cell_installs_a_local_checkout_or_the_repository(monkeypatch, tmp_path):
  pip = _FakePip()                           # a checkout: installed whatever REPO_URL says
  assert _run_install_cell(_install_cell(), monkeypatch, tmp_path, pip, src_dir=ROOT) is None
  assert len(pip.calls) == 1 and pip.calls[0][-1] == str(ROOT)
  fork = "https://github.com/someone/seq2seq"
  pip = _FakePip()
  assert _run_install_cell(_install_cell(fork), monkeypatch, tmp_path, pip) is None
  assert pip.calls[0][1:4] == ["-m", "pip", "install"] and f"git+{fork}" in pip.calls[0]


def test_install_cell_says_in_one_line_when_pip_fails(monkeypatch, tmp_path):
  pip = _FakePip(returncode=1)
  stopped = _run_install_cell(_install_cell("https://github.com/someone/seq2seq"),
                              monkeypatch, tmp_path, pip)
  assert stopped is not None and "pip could not install" in str(stopped)


def test_install_cell_asks_for_a_restart_when_pip_replaced_an_imported_jax(monkeypatch, tmp_path):
  for name in ("jax", "jaxlib"):             # as if this runtime had imported JAX
    if name not in sys.modules:
      monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
  versions = {"jax": "0.4.0", "jaxlib": "0.4.0", "ml_dtypes": "0.5.0", "numpy": "2.0.0"}
  pip = _FakePip(on_run=lambda: versions.update(jax="0.10.2", jaxlib="0.10.2"))
  stopped = _run_install_cell(_install_cell("https://github.com/someone/seq2seq"),
                              monkeypatch, tmp_path, pip, versions)
  assert stopped is not None and "restart the runtime" in str(stopped)
  assert "jax" in str(stopped) and "numpy" not in str(stopped)
  versions.update(jax="0.4.0", jaxlib="0.4.0")
  pip = _FakePip()                           # pip left JAX alone: no restart needed
  assert _run_install_cell(_install_cell("https://github.com/someone/seq2seq"),
                           monkeypatch, tmp_path, pip, versions) is None


@pytest.fixture(scope="module")
def notebook_env(tmp_path_factory):
  """A kernelspec running sys.executable, and the notebooks' shared workdir."""
  jupyter_path = tmp_path_factory.mktemp("jupyter")
  spec = jupyter_path / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "seq2seq test (Python)", "language": "python"}))
  return {"JUPYTER_PATH": str(jupyter_path),
          "SEQ2SEQ_NOTEBOOK_WORKDIR": str(tmp_path_factory.mktemp("notebook_runs")),
          "SEQ2SEQ_NOTEBOOK_SMOKE": "1"}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, notebook_env, monkeypatch):
  for k, v in notebook_env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT,
                                   resources={"metadata": {"path": str(COLAB)}})
  start = time.time()
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:  # the failing cell and its traceback
    pytest.fail(f"{name}.ipynb: {e}", pytrace=False)
  print(f"{name}.ipynb ran in {time.time() - start:.0f} s")
  if os.environ.get("SEQ2SEQ_NOTEBOOK_KEEP"):  # debugging: keep the executed notebook
    nbformat.write(nb, Path(notebook_env["SEQ2SEQ_NOTEBOOK_WORKDIR"]) / f"{name}.ipynb")
  for i, cell in enumerate(nb.cells):  # readable outputs: no progress-bar fragments
    streams = [o for o in cell.get("outputs", []) if o.output_type == "stream"]
    assert len(streams) <= 40, f"{name}.ipynb cell {i}: {len(streams)} stream outputs"
    assert not any("IProgress" in o.text or "\r" in o.text for o in streams), \
        f"{name}.ipynb cell {i}: a progress bar in the output"
