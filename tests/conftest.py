"""Shared by every test file."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The tests compile many tiny programs and run each a few times, so compiling is most
# of their time: they ask XLA:CPU for its quick code generation (the same HLO passes
# and fusions, less optimised machine code: ~25% less time per compile) and for its
# fusions without the MLIR fusion emitters (a third less again: a kernels-table test
# 19 -> 13 s on 2 cores; left out where a jaxlib no longer knows the flag). On a GPU
# they skip XLA's autotuning (each backend ignores the other's flags) and use
# deterministic ops: scatter-adds and cuDNN's attention backward otherwise sum in a
# varying order (on the first GPU run, a resumed run was not bit-identical to the
# uninterrupted one without them). The scripts the tests start inherit them (those that
# set their own XLA_FLAGS add TEST_XLA_FLAGS); the README's main job (`default_run`) runs
# as a user runs it, with the flags pytest was started with.
def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib starts with `flag` (XLA aborts on a flag it does not know)."""
  p = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                     env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}, timeout=120)
  return p.returncode == 0


# Decided once, in the process that starts pytest; its workers (pytest -n) read them back.
if "SEQ2SEQ_TEST_XLA_FLAGS" not in os.environ:
  os.environ["SEQ2SEQ_USER_XLA_FLAGS"] = json.dumps(os.environ.get("XLA_FLAGS"))
  os.environ["SEQ2SEQ_TEST_XLA_FLAGS"] = " ".join(
      ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
       "--xla_gpu_autotune_level=0", "--xla_gpu_deterministic_ops=true"] +
      [f for f in ["--xla_cpu_use_fusion_emitters=false"] if _xla_knows(f)])
USER_XLA_FLAGS = json.loads(os.environ["SEQ2SEQ_USER_XLA_FLAGS"])
TEST_XLA_FLAGS = os.environ["SEQ2SEQ_TEST_XLA_FLAGS"]
os.environ["XLA_FLAGS"] = f"{USER_XLA_FLAGS or ''} {TEST_XLA_FLAGS}".strip()


def _session_dir(tmp_path_factory) -> Path:
  """The session's temporary directory, the one all parallel workers (pytest -n) share."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
  """train.py and decode.py keep compiled programs in ~/.cache/seq2seq/jax (and the C++
  kernels in ~/.cache/seq2seq/native); tests (and the scripts they start) leave the home
  directory alone and share one cache in the session's temporary directory instead: most scripts the tests start compile the same tiny programs.
  Tests of the cache itself, or of compile times, give their own."""
  if "SEQ2SEQ_COMPILE_CACHE" not in os.environ:
    os.environ["SEQ2SEQ_COMPILE_CACHE"] = str(_session_dir(tmp_path_factory) / "jax_cache")
  if "SEQ2SEQ_NATIVE_DIR" not in os.environ:   # the C++ kernels, built once per session
    os.environ["SEQ2SEQ_NATIVE_DIR"] = str(_session_dir(tmp_path_factory) / "native")
  # The scripts the tests start keep every program, however quick to compile (XLA:CPU's
  # quick code generation above makes most take under JAX's default 1 s): they compile the
  # same ones again and again (test_train.py and test_decode_cli.py: 5 min 14 s -> 4 min
  # 47 s). Not the tests' own process (JAX read its setting on import), whose eager
  # operations would each be written to disk (the fast tier: 1.7x the time).
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  from seq2seq import compile_cache  # the tests' own programs too: many compile alike
  compile_cache.enable()


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
  """The main job as README.md gives it, run once per session: `python train.py` (about 1.5
  minutes on 2 cores). Returns (workdir, the finished process, its environment); tests
  only read the workdir. With parallel workers (pytest -n), the first to need it runs it
  and the others wait for it and share it."""
  from filelock import FileLock
  root = _session_dir(tmp_path_factory) / "default_run"
  env = {**os.environ, "TFDS_DATA_DIR": str(root / "tfds")}
  env.pop("XLA_FLAGS")
  if USER_XLA_FLAGS is not None:
    env["XLA_FLAGS"] = USER_XLA_FLAGS
  done = root / "process.json"
  with FileLock(str(root) + ".lock"):
    if not done.exists():
      root.mkdir(exist_ok=True)
      p = subprocess.run([sys.executable, "train.py", "--workdir", str(root / "run"),
                          "--no_progress"], cwd=ROOT, env=env, check=True, timeout=1200,
                         capture_output=True, text=True)
      done.write_text(json.dumps({"args": p.args, "stdout": p.stdout, "stderr": p.stderr}))
  p = json.loads(done.read_text())
  return root / "run", subprocess.CompletedProcess(p["args"], 0, p["stdout"], p["stderr"]), env


# Fixtures that train with train.py in a subprocess: every test that uses one is slow.
TRAINING_FIXTURES = {"default_run", "trained", "workdir"}


# The files that take longest, first: with one file per worker (`--dist loadfile`) a long
# file started last keeps the run going while the other workers wait.
LONGEST_FIRST = ("test_train", "test_export", "test_kernels", "test_notebooks",
                 "test_gpu_script", "test_decode_cli", "test_model", "test_slots",
                 "test_native", "test_scorecard")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  for item in items:
    if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
      item.add_marker(pytest.mark.slow)
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: files' order
