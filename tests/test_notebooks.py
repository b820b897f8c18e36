"""The Colab notebooks: each source colab/NN_name.py (jupytext percent format) and its
colab/NN_name.ipynb agree (colab/make_notebooks.py --check), the .ipynb are committed
without outputs, the install cell installs what it should, and each notebook runs top to
bottom without an error.

The notebooks run in order in one shared workdir (notebooks 2 and 3 reuse the model that
notebook 1 trains; run alone, they train it themselves) in their small setting,
SEQ2SEQ_NOTEBOOK_SMOKE=1, on a Jupyter kernel of this very interpreter (a kernelspec
written to a temporary JUPYTER_PATH), so the test needs no registered kernel.
SEQ2SEQ_NOTEBOOK_KEEP=1 keeps the executed notebooks (with outputs) in the test's workdir.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import jupytext
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
  assert sorted(p.stem for p in COLAB.glob("0*.py")) == sorted(NOTEBOOKS)
  check = subprocess.run([sys.executable, str(COLAB / "make_notebooks.py"), "--check"],
                         capture_output=True, text=True)
  assert check.returncode == 0, check.stderr
  repo = _repository_url()
  owner_name = repo.removeprefix("https://github.com/")
  for name in NOTEBOOKS:
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"  # paired with its .py
    source = jupytext.read(COLAB / f"{name}.py")
    assert [(c.cell_type, c.source) for c in source.cells] == \
        [(c.cell_type, c.source) for c in nb.cells], f"{name}: .py and .ipynb differ"
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


def _stale(check) -> list:
  """The files `make_notebooks.py --check` names as out of date."""
  return check.stderr.strip().rsplit(": ", 1)[1].split(", ")


def _colab_copy(tmp_path) -> Path:
  """colab/ and pyproject.toml copied, for the generator to rewrite."""
  shutil.copytree(COLAB, tmp_path / "colab", ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  return tmp_path / "colab"


def test_check_finds_a_notebook_source_edited_without_regenerating(tmp_path):
  colab = _colab_copy(tmp_path)
  py = colab / "02_anatomy.py"
  py.write_text(py.read_text().replace("## 1. A batch of two sentences", "## 1. Two sentences"))
  run = lambda *a: subprocess.run([sys.executable, str(colab / "make_notebooks.py"), *a],
                                  capture_output=True, text=True)
  check = run("--check")
  assert check.returncode == 1 and _stale(check) == ["02_anatomy.ipynb"]
  assert run().returncode == 0                    # regenerate: the edit reaches the .ipynb
  assert "## 1. Two sentences" in (colab / "02_anatomy.ipynb").read_text()
  assert run("--check").returncode == 0


def test_check_finds_a_shared_cell_edited_in_one_notebook(tmp_path):
  """The badge and the install cell belong to the generator: an edit in one .py is undone."""
  colab = _colab_copy(tmp_path)
  py = colab / "03_fast_decoding.py"
  py.write_text(py.read_text().replace("import importlib, importlib.metadata",
                                       "import glob, importlib, importlib.metadata"))
  run = lambda *a: subprocess.run([sys.executable, str(colab / "make_notebooks.py"), *a],
                                  capture_output=True, text=True)
  check = run("--check")
  assert check.returncode == 1 and _stale(check) == ["03_fast_decoding.py"]
  assert run().returncode == 0
  assert "import glob" not in py.read_text()
  assert py.read_text() == (COLAB / "03_fast_decoding.py").read_text()


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
    self.calls, self.envs, self.returncode, self.on_run = [], [], returncode, on_run

  def __call__(self, args, **kw):
    self.calls.append(list(args))
    self.envs.append(kw.get("env"))
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
    def version(name):
      if name not in versions:
        raise importlib.metadata.PackageNotFoundError(name)
      return versions[name]
    monkeypatch.setattr(importlib.metadata, "version", version)
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


PLACEHOLDER = "https://github.com/your-org/seq2seq"  # pyproject.toml's until there is one


def test_install_cell_stops_with_one_line_when_the_url_is_a_placeholder(monkeypatch, tmp_path):
  pip = _FakePip()
  stopped = _run_install_cell(_install_cell(PLACEHOLDER), monkeypatch, tmp_path, pip)
  assert stopped is not None and "placeholder" in str(stopped) and "REPO_URL" in str(stopped)
  assert _make_notebooks().WHEEL_COMMAND in str(stopped)   # how to make what to upload
  assert pip.calls == []                   # no doomed `pip install git+<placeholder>`


def test_install_cell_installs_an_uploaded_wheel_whatever_the_url(monkeypatch, tmp_path):
  wheel = tmp_path / "seq2seq-0.1.0-py3-none-any.whl"  # uploaded next to the notebook
  wheel.write_bytes(b"a wheel")
  pip = _FakePip()
  assert _run_install_cell(_install_cell(PLACEHOLDER), monkeypatch, tmp_path, pip) is None
  assert len(pip.calls) == 1 and pip.calls[0][1:4] == ["-m", "pip", "install"]
  assert Path(pip.calls[0][5]).resolve() == wheel.resolve()
  assert not any(a.startswith("git+") for a in pip.calls[0])


def test_install_cell_takes_the_newest_upload_under_a_name_pip_accepts(monkeypatch, tmp_path):
  """A browser saves a second upload as "name (1).whl", which is no wheel name to pip."""
  old = tmp_path / "seq2seq-0.1.0-py3-none-any.whl"
  new = tmp_path / "seq2seq-0.1.0-py3-none-any (1).whl"
  old.write_bytes(b"the first upload")
  new.write_bytes(b"the second upload")
  os.utime(old, (1_000_000, 1_000_000))
  (tmp_path / "tmp").mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  pip = _FakePip()
  assert _run_install_cell(_install_cell(PLACEHOLDER), monkeypatch, tmp_path, pip) is None
  installed = Path(pip.calls[0][5])
  assert installed.read_bytes() == b"the second upload" and installed.name == old.name
  monkeypatch.undo()                       # the real pip: which name does it refuse?
  def refused(path):   # pip < 24 and newer pips word it differently
    err = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                          "--no-index", str(path)], capture_output=True, text=True).stderr
    return "not a valid wheel filename" in err or "is not a supported wheel" in err
  assert refused(new) and not refused(installed)


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


def test_install_cell_keeps_the_runtimes_jax_and_its_plugin(monkeypatch, tmp_path):
  """On a GPU runtime that has JAX (Colab's: jax, jaxlib and their CUDA plugin, of one
  version), pip is held to those versions and adds no jax[cuda12] of its own; on one
  without JAX, it installs the GPU's."""
  import shutil
  runtime = {"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "jax-cuda12-plugin": "0.12.0.1",
             "jax-cuda12-pjrt": "0.12.0.1", "numpy": "2.0.0", "ml_dtypes": "0.5.0"}
  monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name == "nvidia-smi"
                      else None)
  fork = "https://github.com/someone/seq2seq"
  pip = _FakePip()
  assert _run_install_cell(_install_cell(fork), monkeypatch, tmp_path, pip, dict(runtime)) is None
  (args,), (env,) = pip.calls, pip.envs
  assert not any(a.startswith("jax") for a in args[4:]), args
  kept = Path(env["PIP_CONSTRAINT"].split()[-1]).read_text().split()
  assert sorted(kept) == sorted(f"{n}=={v}" for n, v in runtime.items() if n.startswith("jax"))

  pip = _FakePip()                             # no JAX yet: the GPU's
  assert _run_install_cell(_install_cell(fork), monkeypatch, tmp_path, pip,
                           {"numpy": "2.0.0"}) is None
  assert "jax[cuda12]" in pip.calls[0]
  assert Path(pip.envs[0]["PIP_CONSTRAINT"].split()[-1]).read_text() == ""


@pytest.mark.slow
def test_the_readme_wheel_command_builds_a_wheel_of_the_whole_package(tmp_path):
  """The file to upload with a notebook on Colab: `pip wheel --no-deps -w dist .`, run in a
  copy of the checkout (building leaves build/ in the tree), holds every module of the
  package and imports from where pip installs it."""
  command = _make_notebooks().WHEEL_COMMAND
  assert f"`{command}`" in (ROOT / "README.md").read_text()
  src = tmp_path / "checkout"
  shutil.copytree(ROOT / "seq2seq", src / "seq2seq", ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src)
  assert command.startswith("pip ")
  build = subprocess.run([sys.executable, "-m", *command.split()], cwd=src, capture_output=True,
                         text=True)
  assert build.returncode == 0, build.stdout + build.stderr
  wheels = list((src / "dist").glob("*.whl"))
  assert len(wheels) == 1 and wheels[0].name.startswith("seq2seq-"), wheels
  modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "seq2seq").rglob("*.py")}
  missing = modules - set(zipfile.ZipFile(wheels[0]).namelist())
  assert not missing, sorted(missing)
  site = tmp_path / "site"
  install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                            str(site), str(wheels[0])], capture_output=True, text=True)
  assert install.returncode == 0, install.stderr
  probe = subprocess.run(
      [sys.executable, "-c", "import seq2seq, seq2seq.translate, seq2seq.data; print(seq2seq.__file__)"],
      cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
  assert probe.returncode == 0, probe.stderr
  assert Path(probe.stdout.strip()).is_relative_to(site)


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


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, notebook_env, monkeypatch):
  for k, v in notebook_env.items():
    monkeypatch.setenv(k, v)
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
