"""Shared by every test file."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# train.py and decode.py keep compiled programs in ~/.cache/seq2seq/jax; tests (and the
# scripts they start) leave the home directory alone. test_decode_cli turns it on in a
# temporary directory to test it.
os.environ.setdefault("SEQ2SEQ_COMPILE_CACHE", "off")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
  """The main job as README.md gives it, run once per session: `python train.py` (about 1.5
  minutes on 2 cores). Returns (workdir, the finished process, its environment); tests
  only read the workdir."""
  root = tmp_path_factory.mktemp("default_run")
  env = {**os.environ, "TFDS_DATA_DIR": str(root / "tfds")}
  p = subprocess.run([sys.executable, "train.py", "--workdir", str(root / "run"), "--no_progress"],
                     cwd=ROOT, env=env, check=True, timeout=1200, capture_output=True, text=True)
  return root / "run", p, env


# Fixtures that train with train.py in a subprocess: every test that uses one is slow.
TRAINING_FIXTURES = {"default_run", "trained", "workdir"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  for item in items:
    if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.slow)
