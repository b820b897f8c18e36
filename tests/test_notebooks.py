"""The Colab notebooks (colab/*.ipynb): committed as colab/make_notebooks.py writes them,
without outputs, and each runs top to bottom without an error.

The notebooks run in order in one shared workdir (notebooks 2 and 3 reuse the model that
notebook 1 trains; run alone, they train it themselves) in their small setting,
SEQ2SEQ_NOTEBOOK_SMOKE=1, on a Jupyter kernel of this very interpreter (a kernelspec
written to a temporary JUPYTER_PATH), so the test needs no registered kernel.
SEQ2SEQ_NOTEBOOK_KEEP=1 keeps the executed notebooks (with outputs) in the test's workdir.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("01_quickstart", "02_anatomy", "03_fast_decoding")
KERNEL = "seq2seq-test-python"
CELL_TIMEOUT = 600  # seconds per cell


def test_notebooks_are_generated_and_committed_without_outputs():
  assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)
  check = subprocess.run([sys.executable, str(COLAB / "make_notebooks.py"), "--check"],
                         capture_output=True, text=True)
  assert check.returncode == 0, check.stderr
  for name in NOTEBOOKS:
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0].source
    assert "colab.research.google.com/github/" in first and f"colab/{name}.ipynb" in first
    assert "**Runtime:**" in first
    assert "pip" in nb.cells[1].source and "REPO_URL" in nb.cells[1].source
    for cell in nb.cells:
      if cell.cell_type == "code":
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: outputs committed"


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
