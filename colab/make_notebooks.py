"""Keeps the notebooks of colab/ in step with their sources.

    python colab/make_notebooks.py          # write colab/*.ipynb from colab/NN_*.py
    python colab/make_notebooks.py --check  # exit 1 if a .py or an .ipynb is out of date
    python colab/make_notebooks.py --repo https://github.com/you/seq2seq  # for a fork

Each notebook's source is a jupytext percent file (colab/01_quickstart.py, ...): plain
Python to read and diff, `# %%` code cells and `# %% [markdown]` text cells, paired with the
.ipynb that Colab and Jupyter open (`jupytext --sync colab/01_quickstart.py` works too).
The .ipynb are committed without outputs; tests/test_notebooks.py checks them with
--check and executes them.

What jupytext cannot do, this script does: every notebook opens with an "Open in Colab"
badge and the same install cell (INSTALL below), both holding the repository URL, whose
one source is `[project.urls] Repository` in pyproject.toml (still a placeholder). The
script writes them into each .py, then each .ipynb from its .py.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parent / "pyproject.toml"
NOTEBOOKS = ("01_quickstart", "02_anatomy", "03_fast_decoding")
# While pyproject.toml's URL is the placeholder, the install cell refuses to pip-install it.
PLACEHOLDER_OWNER = "/your-org/"
# The one command that builds the file the install cell installs on Colab (README).
WHEEL_COMMAND = "pip wheel --no-deps -w dist ."

BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
PAIRING = {"formats": "ipynb,py:percent",
           # no jupytext version in the .py: another version rewrites nothing
           "notebook_metadata_filter": "-jupytext.text_representation.jupytext_version"}
IPYNB_METADATA = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
    "colab": {"provenance": [], "toc_visible": True},
}

INSTALL = '''
# Install the project (this cell is written by colab/make_notebooks.py, the same in every
# notebook). Nothing to do when `seq2seq` is importable (a local run, or this runtime
# installed it already). Otherwise pip installs, with the JAX of a GPU or TPU runtime:
#   1. $SEQ2SEQ_SRC (a checkout or a wheel), if set;
#   2. a wheel seq2seq-*.whl uploaded next to this notebook (on Colab: the Files panel),
#      built in a checkout with `@WHEEL_COMMAND@`;
#   3. the checkout this notebook is in (a folder above it holding pyproject.toml);
#   4. REPO_URL.
REPO_URL = "@REPO_URL@"  # the project's repository (or your fork's)

import importlib, importlib.metadata, importlib.util, os, pathlib, re, shutil, subprocess, sys, tempfile

class InstallStopped(Exception):
  """Stops "Run all" with a one-line message instead of a traceback."""
  def _render_traceback_(self):  # how IPython shows it
    return [f"{type(self).__name__}: {self}"]

def _uploaded_wheel(folder):
  """The newest seq2seq-*.whl in `folder`, under a name pip accepts (a browser saves a
  second upload as "name (1).whl", which pip refuses)."""
  wheels = sorted(pathlib.Path(folder).glob("seq2seq-*.whl"), key=lambda p: p.stat().st_mtime)
  if not wheels:
    return None
  name = re.sub(r" \\(\\d+\\)(?=\\.whl$)", "", wheels[-1].name)
  if name == wheels[-1].name:
    return str(wheels[-1])
  return shutil.copy(wheels[-1], pathlib.Path(tempfile.mkdtemp()) / name)

def _checkout(folder):
  folder = pathlib.Path(folder)
  if (folder / "pyproject.toml").is_file() and (folder / "seq2seq").is_dir():
    return str(folder)

def _source():
  """What to pip-install: a wheel or checkout found here, else None."""
  here, given = pathlib.Path.cwd(), os.environ.get("SEQ2SEQ_SRC")
  if given:
    return given
  return _uploaded_wheel(here) or next(filter(None, map(_checkout, (here, *here.parents))), None)

JAX_WHEELS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt", "libtpu")

def _installed_versions(names):
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions

if importlib.util.find_spec("seq2seq") is None:
  source = _source()
  if source is None and "@PLACEHOLDER_OWNER@" in REPO_URL:  # no repository to install from
    raise InstallStopped(
        f"seq2seq is not installed, no seq2seq-*.whl is next to this notebook and REPO_URL "
        f"({REPO_URL}) is a placeholder: upload the wheel (in a checkout: @WHEEL_COMMAND@) "
        f"or set REPO_URL to your fork's URL, then run this cell again.")
  packages = [source or f"git+{REPO_URL}"]
  # The runtime's JAX stays as it is: pip may not replace jax, jaxlib or the GPU or TPU
  # plugin they came with (a jax replaced under its plugin is a broken accelerator).
  present = {n: v for n, v in _installed_versions(JAX_WHEELS).items() if v}
  if "jax" not in present:
    if shutil.which("nvidia-smi"):                                   # GPU runtime
      packages.append("jax[cuda12]")
    elif os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"):  # TPU runtime
      packages.append("jax[tpu]")
  keep = pathlib.Path(tempfile.mkdtemp()) / "runtime-jax.txt"
  keep.write_text("".join(f"{n}=={v}\\n" for n, v in present.items()))
  # Packages this runtime has imported already: if pip replaces one, Python keeps the old.
  imported = _installed_versions(m for m in ("jax", "jaxlib", "ml_dtypes", "numpy") if m in sys.modules)
  print("pip install", *packages, "..." + (f" (keeping jax {present['jax']})" if "jax" in present else ""))
  constraints = " ".join(filter(None, (os.environ.get("PIP_CONSTRAINT"), str(keep))))
  pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages],
                       capture_output=True, text=True,
                       env={**os.environ, "PIP_CONSTRAINT": constraints})
  if pip.returncode != 0:
    sys.stderr.write(pip.stdout + pip.stderr)
    kept = f" with this runtime's jax {present['jax']}" if "jax" in present else ""
    raise InstallStopped(f"pip could not install {packages[0]}{kept} (exit code "
                         f"{pip.returncode}, its messages are above): fix the wheel, REPO_URL "
                         f"or the network, then run this cell again.")
  importlib.invalidate_caches()
  replaced = [m for m, v in imported.items() if _installed_versions([m])[m] != v]
  if replaced:
    raise InstallStopped(f"pip replaced {', '.join(replaced)}, which this runtime had already "
                         f"imported: restart the runtime (Runtime → Restart session), then "
                         f"run all (this cell will find seq2seq installed).")
  print("installed seq2seq")
'''


def repository_url(pyproject: Path = PYPROJECT) -> str:
  """`[project.urls] Repository` of pyproject.toml."""
  text = pyproject.read_text(encoding="utf-8")
  try:
    import tomllib
  except ModuleNotFoundError:  # Python 3.10: read the one key by hand
    m = re.search(r'^\[project\.urls\][^\[]*?^Repository\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not m:
      raise SystemExit(f"{pyproject}: no [project.urls] Repository")
    return m.group(1)
  return tomllib.loads(text)["project"]["urls"]["Repository"]


def colab_url(repo_url: str) -> str:
  """Where Colab opens the notebooks of a GitHub repository's main branch."""
  m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(?:\.git)?/?", repo_url)
  if not m:
    raise SystemExit(f"{repo_url!r}: not a GitHub repository URL (https://github.com/OWNER/NAME), "
                     f"which Colab's badge needs")
  return f"https://colab.research.google.com/github/{m.group(1)}/blob/main/colab/"


def install_cell(repo_url: str) -> str:
  return (INSTALL.strip().replace("@REPO_URL@", repo_url)
          .replace("@PLACEHOLDER_OWNER@", PLACEHOLDER_OWNER)
          .replace("@WHEEL_COMMAND@", WHEEL_COMMAND))


def with_shared_cells(nb, name: str, repo_url: str):
  """The notebook read from its .py, with this repository's badge and install cell."""
  badge = (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
           f"({colab_url(repo_url)}{name}.ipynb)")
  head, install = nb.cells[0], nb.cells[1]
  if head.cell_type != "markdown" or not BADGE.match(head.source):
    raise SystemExit(f"{name}.py: the first cell must be markdown starting with the Colab badge")
  if install.cell_type != "code" or "REPO_URL" not in install.source:
    raise SystemExit(f"{name}.py: the second cell must be the install cell")
  head.source = BADGE.sub(badge.replace("\\", "\\\\"), head.source, count=1)
  install.source = install_cell(repo_url)
  nb.metadata.setdefault("jupytext", {}).update(PAIRING)
  return nb


def as_ipynb(nb) -> nbformat.NotebookNode:
  """The .ipynb of a notebook read from its .py: no outputs, stable cell ids."""
  nb = nbformat.from_dict(nb)
  nb.metadata.update(IPYNB_METADATA)
  nb.metadata["jupytext"].pop("text_representation", None)  # as `jupytext --sync` writes it
  for i, cell in enumerate(nb.cells):
    cell["id"] = f"cell-{i:02d}"
  return nb


def _content(nb) -> list:
  """What a notebook says (cell types, sources and outputs), whatever wrote it."""
  return [(c.cell_type, c.source, c.get("outputs", [])) for c in nb.cells]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="compare instead of writing")
  ap.add_argument("--repo", metavar="URL", default=None,
                  help="the repository the notebooks install from and open in Colab (a fork's, "
                       "https://github.com/OWNER/NAME); default: [project.urls] Repository of "
                       "pyproject.toml")
  args = ap.parse_args(argv)
  repo_url = (args.repo or repository_url()).rstrip("/")
  colab_url(repo_url)  # a GitHub URL, or exit
  stale = []
  for name in NOTEBOOKS:
    py, ipynb = HERE / f"{name}.py", HERE / f"{name}.ipynb"
    text = py.read_text(encoding="utf-8")
    nb = with_shared_cells(jupytext.reads(text, fmt="py:percent"), name, repo_url)
    new_text = jupytext.writes(nb, fmt="py:percent")
    new_nb = as_ipynb(nb)
    if args.check:
      if new_text != text:
        stale.append(py.name)
      if (not ipynb.exists() or _content(nbformat.read(ipynb, as_version=4)) != _content(new_nb)
          or nbformat.read(ipynb, as_version=4).metadata.get("jupytext", {}).get("formats")
          != PAIRING["formats"]):
        stale.append(ipynb.name)
      continue
    if new_text != text:
      py.write_text(new_text, encoding="utf-8")
      print("wrote", py)
    nbformat.write(new_nb, ipynb)
    print("wrote", ipynb)
  if stale:
    print("out of date (run python colab/make_notebooks.py):", ", ".join(stale), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
