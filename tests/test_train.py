"""train.py and train_lib: sharded step equivalence, exact resume after SIGKILL, SIGTERM,
broken checkpoints, non-finite loss, bad input, and a real 2-process run."""
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train as train_script  # noqa: E402

from seq2seq import checkpoint as ckpt_lib  # noqa: E402
from seq2seq import state as state_lib  # noqa: E402
from seq2seq.config import ConfigError, get_experiment, override  # noqa: E402
from seq2seq.load import load_workdir  # noqa: E402
from seq2seq.state import abstract_state  # noqa: E402
from conftest import TEST_XLA_FLAGS  # noqa: E402
from hosts import free_port, run_two_hosts  # noqa: E402


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A tiny English→French TSV corpus (numbers 0..339 in words)."""
  from num2words import num2words
  d = tmp_path_factory.mktemp("corpus")
  for name, rng in (("train", range(0, 300)), ("validation", range(300, 320)),
                    ("test", range(320, 340))):
    lines = [f"{num2words(n)}\t{num2words(n, lang='fr')}" for n in rng]
    (d / f"{name}.tsv").write_text("\n".join(lines) + "\n")
  return d


def tiny_args(corpus, workdir, data_dir, steps=30, extra=()):
  return ["--workdir", str(workdir), "--config", "tiny", "--dataset", "parallel_text",
          "--train_files", str(corpus / "train.tsv"),
          "--validation_files", str(corpus / "validation.tsv"),
          "--test_files", str(corpus / "test.tsv"), "--data_dir", str(data_dir),
          "--steps", str(steps), "--no_progress",
          "--config.model.d_model=32", "--config.model.num_heads=2",
          "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
          "--config.model.d_ff=64", "--config.model.max_len=64",
          "--config.data.vocab_size=300", "--config.data.max_src_len=32",
          "--config.data.max_tgt_len=32", "--config.train.batch_size=8",
          "--config.train.seq_len=32", "--config.train.warmup_steps=10",
          "--config.train.log_every=5", "--config.train.checkpoint_every=10",
          "--config.train.eval_every=1000", "--config.train.num_eval_examples=4",
          "--config.train.eval_batch_size=4", *extra]


def run_train(args, env_extra=None, timeout=240, check=True):
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  env.update(env_extra or {})
  p = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=env,
                     capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
  if check and p.returncode != 0:
    raise AssertionError(f"train.py exited {p.returncode}:\n{p.stderr[-3000:]}")
  return p


def params_of(workdir, step=None):
  _, params, _ = load_workdir(workdir, step)
  return jax.tree_util.tree_map(np.asarray, params)


def tree_hash(d: Path) -> str:
  h = hashlib.sha256()
  for p in sorted(d.rglob("*")):
    if p.is_file():
      h.update(str(p.relative_to(d)).encode())
      h.update(p.read_bytes())
  return h.hexdigest()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
  """One uninterrupted 30-step run (checkpoints at 10, 20, 30)."""
  root = tmp_path_factory.mktemp("trained")
  run_train(tiny_args(corpus, root / "w", root / "tfds"))
  return root / "w", root / "tfds"


@pytest.mark.slow
# --- the step -----------------------------------------------------------------------------

def test_sharded_step_equals_single_device_step():
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(ROOT / "tests" / "step_equivalence.py")],
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["devices"] == 8
  for name in ("data8", "fsdp", "data8_head3", "accum2"):
    assert r[name]["loss"] < 1e-5 and r[name]["params"] < 1e-5, (name, r[name])
  # the comparison is sharp enough to see another initialisation
  assert r["other_seed"]["params"] > 1e-3


# --- the run ------------------------------------------------------------------------------

def test_run_writes_a_complete_workdir(trained):
  workdir, _ = trained
  assert (workdir / "config.json").exists() and (workdir / "vocab.model").exists()
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20, 30]
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if r["split"] == "train"]
  assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
  assert train_rows[-1]["loss"] < train_rows[0]["loss"]
  assert {"validation", "test"} <= {r["split"] for r in rows}
  test_row = [r for r in rows if r["split"] == "test"][-1]
  assert {"bleu", "chrf", "exact_match", "loss", "nll", "perplexity", "accuracy"} <= set(test_row)
  assert test_row["perplexity"] == pytest.approx(np.exp(test_row["nll"]))
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  cfg, params, tok = load_workdir(workdir)
  assert cfg.model.d_model == 32 and cfg.model.vocab_size == tok.vocab_size


@pytest.mark.slow
def test_eval_cuts_a_source_longer_than_the_model_reads(corpus, tmp_path):
  """A validation sentence of more than model.max_len tokens is evaluated cut, as the loss
  batches cut it (it used to stop the run at its first evaluation)."""
  from num2words import num2words
  long_src = " ".join(num2words(n) for n in range(300, 330))   # > 64 tokens
  val = tmp_path / "validation.tsv"
  val.write_text((corpus / "validation.tsv").read_text() + f"{long_src}\tcourt\n")
  wd = tmp_path / "w"
  args = tiny_args(corpus, wd, tmp_path / "tfds", steps=2)
  args[args.index("--validation_files") + 1] = str(val)
  run_train(args)
  rows = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
  (v,) = [r for r in rows if r["split"] == "validation"]
  (t,) = [r for r in rows if r["split"] == "test"]
  assert (v["examples"], v["truncated"]) == (21, 1)
  assert (t["examples"], t["truncated"]) == (20, 0)


def test_sigkill_then_resume_is_bit_identical(corpus, trained, tmp_path):
  reference, data_dir = trained
  workdir = tmp_path / "killed"
  args = tiny_args(corpus, workdir, data_dir)
  p = run_train(args, {"SEQ2SEQ_DEBUG_SIGKILL_AT_STEP": "15"}, check=False)
  assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
  assert 10 in ckpt_lib.Checkpoints(workdir, read_only=True).steps()
  assert (workdir / "train.lock").exists()     # the killed run could not remove its lock
  p = run_train(args)
  assert "resuming from" in p.stderr and "(step 10)" in p.stderr
  assert re.search(r"^first step in \d+\.\d s \(tracing and compiling the train step", p.stderr,
                   re.M), p.stderr[-2000:]
  assert "warning: took over the lock of workdir" in p.stderr, p.stderr[-2000:]
  assert "its process is not running" in p.stderr
  assert not (workdir / "train.lock").exists()
  a, b = params_of(reference, 30), params_of(workdir, 30)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)
  # the log reads as the uninterrupted run's: the resumed run's rows replace the killed one's
  from seq2seq.metrics import read_metrics
  losses = lambda w: [(r["step"], r["loss"]) for r in read_metrics(w) if r["split"] == "train"]
  assert losses(workdir) == losses(reference)
  assert [s for s, _ in losses(workdir)] == [5, 10, 15, 20, 25, 30]
  p = run_train(args)   # once more: done already, so it says so and only evaluates
  assert "already at step 30: nothing to train" in p.stderr
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps()[-1] == 30


def test_a_run_written_before_stacked_layers_resumes_and_decodes(corpus, trained, tmp_path):
  """A workdir of one module per layer whose config.json has no `scan_layers` (as every run
  written before the field): it resumes as that layout, bit-identical to the uninterrupted
  run, and decode.py reads it."""
  _, data_dir = trained
  old, whole = tmp_path / "old", tmp_path / "whole"
  unrolled = ["--config.model.scan_layers=false"]
  run_train(tiny_args(corpus, old, data_dir, steps=10, extra=unrolled))
  run_train(tiny_args(corpus, whole, data_dir, steps=20, extra=unrolled))
  written = json.loads((old / "config.json").read_text())
  del written["model"]["scan_layers"]
  (old / "config.json").write_text(json.dumps(written))
  p = run_train(tiny_args(corpus, old, data_dir, steps=20))
  assert "(step 10)" in p.stderr
  a, b = params_of(old, 20), params_of(whole, 20)
  assert "layers_0" in a["encoder"]
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)
  d = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--workdir", str(old),
                      "--no_progress", "one hundred and two"], capture_output=True, text=True,
                     timeout=240, cwd=str(ROOT))
  assert d.returncode == 0 and d.stdout.strip(), d.stderr[-2000:]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_save_and_exit_cleanly(corpus, trained, tmp_path, signum, code):
  """SIGTERM (preemption) and Ctrl-C save a checkpoint at the step they arrive in, then exit
  as a process killed by them would: 143 (128 + 15), so that a scheduler does not take a
  preempted run for a finished one, and 130 for Ctrl-C."""
  _, data_dir = trained
  workdir = tmp_path / "term"
  args = tiny_args(corpus, workdir, data_dir, steps=100000)
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 180
    metrics = workdir / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
      assert proc.poll() is None, proc.stderr.read()[-2000:]
      time.sleep(0.2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == code, err[-2000:]
  said = [l for l in err.splitlines() if f"{signum.name} at step " in l]
  assert said and "checkpoint saved" in said[0], err[-2000:]
  at = int(said[0].split(" at step ")[1].split(":")[0])
  steps = ckpt_lib.Checkpoints(workdir, read_only=True).steps()
  assert steps[-1] == at and 0 < at < 100000   # saved at the step the signal came in
  cfg, params, _ = load_workdir(workdir)  # the saved state reads back


def test_broken_latest_checkpoint_falls_back_with_warning(trained, tmp_path):
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  ckdir = workdir / "checkpoints" / "30" / "state"
  for f in ckdir.rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  before = tree_hash(workdir / "checkpoints" / "30")
  abstract = state_lib.abstract_state(ckpt_lib.read_config(workdir))
  reader = ckpt_lib.Checkpoints(workdir, read_only=True)     # decode.py: skips, moves nothing
  with pytest.warns(UserWarning, match="skipping unreadable checkpoint .*30: "):
    assert reader.restore(abstract)[1]["step"] == 20
  assert reader.steps() == [10, 20, 30]
  ckpts = ckpt_lib.Checkpoints(workdir)                      # a resuming run: moves it aside
  with pytest.warns(UserWarning, match="skipping unreadable checkpoint .*30 .moved to "
                    ".*checkpoints_unreadable/30.: "):
    state, meta = ckpts.restore(abstract)
  assert meta["step"] == 20 and ckpts.steps() == [10, 20]
  assert tree_hash(workdir / "checkpoints_unreadable" / "30") == before   # kept, not deleted
  ckpts.save(30, state, meta)         # the run can write step 30 again (it used to fail here)
  ckpts.close()
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20, 30]


def test_average_checkpoints(trained):
  workdir, _ = trained
  steps, avg = ckpt_lib.average_checkpoints(workdir, last=2)
  assert steps == [20, 30]
  a, b = params_of(workdir, 20), params_of(workdir, 30)
  for x, y, m in zip(*(jax.tree_util.tree_leaves(t) for t in (a, b, avg))):
    np.testing.assert_allclose(m, (x.astype(np.float64) + y) / 2, rtol=1e-6, atol=1e-7)


def test_averaged_workdir_decodes_with_mean_parameters(trained, tmp_path):
  workdir, _ = trained
  out = tmp_path / "avg"
  assert ckpt_lib.main(["average", "--workdir", str(workdir), "--output", str(out),
                        "--last", "3"]) == 0
  leaves = [jax.tree_util.tree_leaves(params_of(workdir, s)) for s in (10, 20, 30)]
  for got, *xs in zip(jax.tree_util.tree_leaves(params_of(out)), *leaves):
    np.testing.assert_allclose(got, np.mean(np.stack(xs).astype(np.float64), 0), rtol=1e-6,
                               atol=1e-7)
  assert (out / "vocab.model").read_bytes() == (workdir / "vocab.model").read_bytes()
  # an existing output is refused, the source workdir untouched
  before = tree_hash(workdir)
  assert ckpt_lib.main(["average", "--workdir", str(workdir), "--output", str(out)]) == 2
  assert tree_hash(workdir) == before


def test_average_reports_bad_output_and_broken_checkpoints_in_one_line(trained, tmp_path,
                                                                        capfd):
  from seq2seq import train_lib
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  assert ckpt_lib.main(["average", "--workdir", str(trained[0]), "--output", str(a_file)]) == 2
  assert capfd.readouterr().err == f"error: cannot write {a_file}: File exists\n"
  for argv, says in ((["average", "--workdir", "w"], "required: --output"),
                     (["averag", "--workdir", "w", "--output", "o"], "invalid choice")):
    with pytest.raises(SystemExit) as e:
      ckpt_lib.main(argv)
    err = capfd.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and says in err, err
    assert len(err.splitlines()) == 1, err
  # A model with enough arrays that Orbax's other reads are still in flight when one fails.
  workdir = tmp_path / "w"
  workdir.mkdir()
  cfg = get_experiment("numbers")
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=368))
  ckpt_lib.write_config(workdir, cfg)
  ckpts = ckpt_lib.Checkpoints(workdir, async_save=False)
  state = train_lib.init_state(cfg, jax.random.key(0))
  for step in (10, 20):
    ckpts.save(step, state, {"step": step})
  ckpts.close()
  data = workdir / "checkpoints" / "20" / "state" / "ocdbt.process_0" / "d"
  biggest = max(data.iterdir(), key=lambda f: f.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:1000])       # truncated, as by a full disk
  # A real process: pytest's own hooks would catch the tracebacks of Orbax's failing reads.
  p = subprocess.run([sys.executable, "-m", "seq2seq.checkpoint", "average", "--workdir",
                      str(workdir), "--output", str(tmp_path / "avg")], cwd=str(ROOT),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 2
  assert p.stderr.startswith(f"error: checkpoint {workdir}/checkpoints/20 is unreadable: "), (
      p.stderr[:3000])
  assert len(p.stderr.splitlines()) == 1, p.stderr[:3000]


def test_read_debris_covers_tensorstore_errors_of_other_reads():
  # What a CI run printed after the one-line error (asyncio logging an unretrieved future of
  # another read): TensorStore's error, not wrapped by Orbax.
  ts = ('OUT_OF_RANGE: Error reading "params.encoder.layers_1.self_attn.key.kernel/0.0.0" in '
        'OCDBT database at local file "/tmp/w/checkpoints/20/state/": Requested byte range '
        '[162672, 177800) is not valid for value of size 1000')
  assert ckpt_lib._is_read_debris(ValueError(ts))
  assert ckpt_lib._is_read_debris(f"Future exception was never retrieved\nfuture: <Future "
                                  f"finished exception=ValueError({ts!r})>")
  assert ckpt_lib._is_read_debris(ValueError("Encountered error while reading array index: x"))
  assert ckpt_lib._is_read_debris(RuntimeError("Event loop is closed"))
  assert not ckpt_lib._is_read_debris(ValueError("OUT_OF_RANGE: index 3 is out of range"))
  assert not ckpt_lib._is_read_debris(RuntimeError("Event loop is running"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # 1e40 as float32
def test_nonfinite_parameters_stop_the_run_before_any_checkpoint(corpus, trained, tmp_path,
                                                                capsys, monkeypatch):
  """A learning rate past validation's bound (lifted here) makes the parameters infinite at
  step 1 with a finite loss; the run stops naming that step and no checkpoint of them is
  written (one used to be, and every resume failed)."""
  from seq2seq import config
  monkeypatch.setattr(config, "MAX_PEAK_LEARNING_RATE", float("inf"))
  _, data_dir = trained
  assert train_script.main(tiny_args(corpus, tmp_path / "w", data_dir, 20, [
      "--config.train.learning_rate_scale=1e40", "--config.train.checkpoint_every=1",
      "--config.train.log_every=1"])) == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last == ("error: non-finite parameters after the update of step 1: stopped; no "
                  "checkpoint was written after it (lower the learning rate?)"), last
  assert not (tmp_path / "w" / "checkpoints").exists() or not any(
      (tmp_path / "w" / "checkpoints").iterdir())
  assert not (tmp_path / "w" / "config.json").exists()   # no run: the workdir binds nothing
  assert not (tmp_path / "w" / "train.lock").exists()


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--config", "huge"], "unknown config 'huge'"),
    (["--config.train.stepz=3"], "unknown config key; did you mean 'train.steps'"),
    (["--config.model.d_model=abc"], "cannot read 'abc' as int"),
    (["--config.model.num_heads=7"], "divisible by num_heads"),
    (["--config.train.label_smoothing=1.5"], "label_smoothing"),
    (["--config.nosuchsection.x=1"], "unknown section"),
    (["--config.train.adam_b2=2"], "adam_b2 must be in [0, 1), got 2.0"),
    (["--config.train.clip_grad_norm=-1"], "clip_grad_norm must be >= 0 (0 = off), got -1.0"),
    (["--config.data.vocab_size=100"], "vocab_size 100 is too small"),
    (["--config.train.seed=99999999999999999999999"], "seed must be an integer in [0, 2**32)"),
    (["--steps", "3000000000"], "steps must be < 2**31, got 3000000000"),
    (["--config.train.length_penalty=-1"], "length_penalty must be >= 0, got -1.0"),
    (["--config.train.num_eval_examples=-5"], "num_eval_examples must be an integer >= 0"),
    (["--config.data.max_tgt_len=65"], "data.max_tgt_len (65) must be <= model.max_len (64)"),
    (["--config", "base", "--config.model.max_len=128"], "data.max_src_len (256) must be <="),
    (["--dataset", "parallel_text", "--train_files", "/nonexistent/train.tsv"], "/nonexistent"),
    (["--config", "small_cpu"], "dataset=parallel_text needs --config.data.train_files"),
    (["--steps", "3", "--config.train.steps=20"], "give --steps or --config.train.steps"),
    (["--tgt_lang", "de"], "the numbers task's target language is --config.data.target_lang"),
    (["--dataset", "wmt14_translate/de-en", "--src_lang", "de"],
     "--src_lang names the files of dataset parallel_text, not 'wmt14_translate/de-en'"),
    (["--data_dir", "/proc/no/such/dir"], "check that --data_dir (TFDS_DATA_DIR) is a writable"),
    (["--coordinator_address", "bad", "--num_processes", "2", "--process_id", "0"],
     "coordinator address must be HOST:PORT, got 'bad'"),
    (["--num_processes", "2", "--process_id", "1"], "give --coordinator_address HOST:PORT"),
    (["--coordinator_address", "localhost:1234", "--num_processes", "2", "--process_id", "5"],
     "--process_id must be in [0, 2)"),
    # refused before anything is written (each used to leave config.json or vocab.model)
    (["--config.train.mesh_shape=data=3"], "mesh_shape 'data=3' needs 3 devices, there are 1"),
    (["--config.data.num_shards=3"], "num_shards 3 must be a multiple of the number of hosts"),
    (["--config.train.learning_rate_scale=inf"], "learning_rate_scale must be a finite number"),
    (["--config.train.learning_rate_scale=1e40"], "gives a peak learning rate of 1.02e+38"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
  code = train_script.main(["--workdir", str(tmp_path / "runs" / "w"), "--no_progress", *argv])
  err = capsys.readouterr().err.strip()
  assert code == 2
  assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
  assert list(tmp_path.iterdir()) == []     # no empty workdir (nor its parent) left behind


@pytest.mark.parametrize("name", ["SEQ2SEQ_DIST_TIMEOUT", "SEQ2SEQ_HEARTBEAT_TIMEOUT"])
def test_bad_distributed_timeouts_are_one_line(name, tmp_path, capsys, monkeypatch):
  monkeypatch.setenv(name, "10s")
  code = train_script.main(["--workdir", str(tmp_path / "w"), "--no_progress",
                            "--coordinator_address", "127.0.0.1:1", "--num_processes", "2",
                            "--process_id", "0"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and err == f"error: {name} must be a whole number of seconds >= 1, got '10s'"


def test_empty_workdir_is_refused_not_the_current_directory(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert train_script.main(["--workdir", "", "--no_progress", "--steps", "2"]) == 2
  assert capsys.readouterr().err == "error: workdir is empty: give a directory (--workdir DIR)\n"
  assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_refused_new_run_leaves_nothing_and_the_corrected_command_runs(corpus, trained,
                                                                         tmp_path, capsys):
  """Every training pair too long: refused once the data is read, before the vocabulary or
  the tokenized data are written (a vocabulary left behind used to be reused by the next
  run, whatever its data); the next run, with other data and model, is a new run."""
  _, data_dir = trained
  long_pairs = tmp_path / "data" / "hundreds.tsv"    # two words or more: 3+ tokens with EOS
  long_pairs.parent.mkdir()
  long_pairs.write_text("".join((corpus / "train.tsv").read_text().splitlines(True)[100:]))
  workdir = tmp_path / "runs" / "w"
  args = tiny_args(corpus, workdir, data_dir, 2, ["--config.data.max_src_len=2"])
  args[args.index("--train_files") + 1] = str(long_pairs)
  assert train_script.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert err.splitlines()[-1].startswith("error: all 200 training pairs of shard 0 are "
                                         "longer"), err
  assert "Traceback" not in err
  assert list(tmp_path.iterdir()) == [long_pairs.parent]
  assert train_script.main(tiny_args(corpus, workdir, data_dir, 2,
                                     ["--config.model.d_ff=32"])) == 0
  assert ckpt_lib.read_config(workdir).model.d_ff == 32
  built_from = json.loads((workdir / "vocab.json").read_text())["built_from"]
  assert built_from["training_pairs"] == 300


def test_unwritable_workdir(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  assert train_script.main(["--workdir", str(blocker / "w"), "--no_progress"]) == 2
  err = capsys.readouterr().err.strip()
  assert "not writable" in err and len(err.splitlines()) == 1


def test_workdir_url_is_refused_not_made_a_local_directory(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert train_script.main(["--workdir", "gs://bucket/run1", "--no_progress"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: workdir gs://bucket/run1 is a URL") and "\n" not in err, err
  assert list(tmp_path.iterdir()) == []


def test_workdir_that_is_a_file(tmp_path, capsys):
  f = tmp_path / "run"
  f.write_text("someone's notes")
  assert train_script.main(["--workdir", str(f), "--no_progress"]) == 2
  assert capsys.readouterr().err.strip() == f"error: workdir {f} is a file, not a directory"
  assert f.read_text() == "someone's notes"


def test_different_model_config_on_existing_workdir_is_refused_untouched(corpus, trained,
                                                                          capsys):
  workdir, data_dir = trained
  before = tree_hash(workdir)
  args = tiny_args(corpus, workdir, data_dir, extra=["--config.model.d_model=64"])
  assert train_script.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert "different model config" in err and "d_model: 32 -> 64" in err
  assert tree_hash(workdir) == before


def test_resume_cannot_turn_clipping_on_and_changes_nothing(corpus, trained, capsys):
  """The optimizer's state has another form with clipping or weight decay on: a checkpoint
  saved without them cannot be resumed with them (it used to be taken for a corrupt one,
  moved aside with every other checkpoint, and the run started again from step 0)."""
  workdir, data_dir = trained
  before = tree_hash(workdir)
  args = tiny_args(corpus, workdir, data_dir, steps=40,
                   extra=["--config.train.clip_grad_norm=1.0"])
  assert train_script.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "\n" not in err, err
  assert "clip_grad_norm: 0.0 -> 1.0" in err and "new --workdir" in err, err
  assert tree_hash(workdir) == before


def test_a_checkpoint_of_another_optimizer_is_an_error_not_debris(trained, tmp_path):
  """Past the config check (say, a checkpoint of another version of seq2seq): a checkpoint
  whose tree differs is refused in one line and stays where it is."""
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  cfg = ckpt_lib.read_config(workdir)
  other = cfg.replace(train=cfg.train.replace(weight_decay=0.1))
  with pytest.raises(ckpt_lib.UserError, match="another structure than this run's"):
    ckpt_lib.Checkpoints(workdir).restore(state_lib.abstract_state(other))
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20, 30]
  assert not (workdir / ckpt_lib.UNREADABLE_DIR).exists()


def test_a_failed_resume_leaves_config_json_and_decoding_as_they_were(corpus, trained,
                                                                      tmp_path, capsys):
  """A resume that fails before training (here: a mesh this machine cannot make) does not
  write its new train settings into config.json. Decoding reads the parameters alone, so it
  does not depend on the optimizer settings in config.json either."""
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  before = (workdir / "config.json").read_bytes()
  args = tiny_args(corpus, workdir, trained[1], steps=40,
                   extra=["--config.train.mesh_shape=data=3"])
  assert train_script.main(args) == 2
  assert "mesh_shape 'data=3'" in capsys.readouterr().err
  assert (workdir / "config.json").read_bytes() == before
  cfg = json.loads(before)
  cfg["train"]["weight_decay"] = 0.1         # another optimizer state than the checkpoints'
  (workdir / "config.json").write_text(json.dumps(cfg))
  for x, y in zip(jax.tree_util.tree_leaves(params_of(workdir)),
                  jax.tree_util.tree_leaves(params_of(trained[0]))):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_two_runs_on_one_workdir_one_trains_the_other_is_refused(corpus, trained, tmp_path):
  """Started together on one workdir, one run trains to the end and the other is refused in
  one line naming it, before writing anything (both used to train, or to fail saving)."""
  _, data_dir = trained
  workdir = tmp_path / "w"
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                             *tiny_args(corpus, workdir, data_dir, 20)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = sorted(p.returncode for p in procs)
  assert codes == [0, 2], [err[-2000:] for _, err in outs]
  (winner,) = [p for p in procs if p.returncode == 0]
  (_, err), = [o for p, o in zip(procs, outs) if p.returncode == 2]
  assert err == (f"error: workdir {workdir} is in use by another run (host "
                 f"{socket.gethostname()}, pid {winner.pid}, since " + err.split(" since ")[1])
  assert len(err.splitlines()) == 1 and "Traceback" not in err
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20]
  assert not (workdir / "train.lock").exists()


@pytest.mark.slow
def test_a_save_whose_directory_vanishes_ends_the_run_in_one_line_at_once(corpus, trained,
                                                                         tmp_path):
  """Another process takes the directory of a save in progress (as a second run once did,
  moving it aside as unfinished): the run says so in one line and exits at once, the
  checkpoints before it intact (it used to end in a traceback, or wait minutes for Orbax's
  threads)."""
  _, data_dir = trained
  workdir = tmp_path / "w"
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *tiny_args(
      corpus, workdir, data_dir, 100000, ["--config.train.checkpoint_every=1",
                                          "--config.train.log_every=1"])],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  checkpoints, aside = workdir / "checkpoints", tmp_path / "aside"
  aside.mkdir()
  try:
    deadline = time.time() + 240
    while not (checkpoints / "2").exists():
      assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
      time.sleep(0.05)
    first, n = None, 0
    while proc.poll() is None and (first is None or time.time() - first < 60):
      for tmp in checkpoints.glob("*.orbax-checkpoint-tmp*"):
        try:
          os.replace(tmp, aside / f"{tmp.name}.{n}")
          first, n = first or time.time(), n + 1
        except OSError:   # finished meanwhile
          pass
      time.sleep(0.001)
    _, err = proc.communicate(timeout=60)
    took = time.time() - first
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 2, err[-3000:]
  assert took < 30, took
  assert "Traceback" not in err and "ERROR" not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"error: cannot write checkpoint {checkpoints.absolute()}/"), last
  assert last.endswith(" (the checkpoints saved before it are intact)"), last
  params_of(workdir)   # the newest checkpoint left reads back
  assert not (workdir / "train.lock").exists()


def test_a_full_disk_is_one_line_and_the_next_run_resumes(corpus, trained, tmp_path):
  """A checkpoint that cannot be written (the file size limit stands in for a full disk)
  ends the run with one line and exit 2; the checkpoints before it are intact, and the next
  run moves the unfinished one aside with a warning and resumes from the last good one."""
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  args = tiny_args(corpus, workdir, trained[1], steps=40)
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  p = subprocess.run(["bash", "-c", 'ulimit -f 8 && exec "$0" "$@"', sys.executable,
                      str(ROOT / "train.py"), *args], env=env, text=True,
                     capture_output=True, timeout=240, cwd=str(ROOT))
  assert p.returncode == 2, p.stderr[-3000:]
  assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr[-3000:]
  assert p.stderr.strip().splitlines()[-1] == (
      f"error: cannot write checkpoint {workdir.absolute() / 'checkpoints' / '40'}: File too "
      f"large (the checkpoints saved before it are intact)"), p.stderr[-2000:]
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20, 30]
  assert list((workdir / "checkpoints").glob("40.orbax-checkpoint-tmp*"))
  p = run_train(args)
  assert "warning: moved the unfinished checkpoint" in p.stderr and "(step 30)" in p.stderr
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [20, 30, 40]
  assert list((workdir / "checkpoints_unreadable").glob("40.orbax-checkpoint-tmp*"))


# A file system of its own, really full: a tmpfs mounted in a private user and mount
# namespace (`unshare`, no root needed), holding DIR/disk/w (a copy of DIR/w) and a filler
# that leaves FREE KiB; the command runs there, then the workdir is copied back to DIR/w.
FULL_DISK = r"""set -u
dir=$1 free=$2; shift 2
mount -t tmpfs -o size=8m tmpfs "$dir/disk" || exit 99
cp -a "$dir/w" "$dir/disk/w" && rm -rf "$dir/w"
head -c 16m /dev/zero > "$dir/disk/filler" 2>/dev/null        # fails once the disk is full
truncate -s -"${free}k" "$dir/disk/filler"
"$@"
rc=$?
cp -a "$dir/disk/w" "$dir/w"
exit $rc
"""


def on_a_full_disk(tmp_path, free_kib, command, timeout=240):
  """Runs `command` (which finds the workdir at tmp_path/disk/w) on a full file system."""
  (tmp_path / "disk").mkdir()
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c",
                      FULL_DISK, "full_disk", str(tmp_path), str(free_kib), *command],
                     env=env, text=True, capture_output=True, timeout=timeout, cwd=str(ROOT))
  if p.returncode == 99 or (p.returncode == 1 and "unshare" in p.stderr):
    pytest.skip(f"cannot mount a file system of its own here: {p.stderr.strip()[-300:]}")
  return p


@pytest.mark.skipif(not shutil.which("unshare"), reason="no unshare (util-linux)")
def test_a_really_full_disk_is_one_line_and_the_checkpoints_still_load(corpus, trained,
                                                                       tmp_path):
  """The disk fills during the save of step 40: one line, exit 2, no traceback (the
  TensorBoard writer used to write to the full disk after the checkpoint error: exit 1,
  three tracebacks); nothing logged after it; the checkpoints before it load; unlocked."""
  shutil.copytree(trained[0], tmp_path / "w")
  p = on_a_full_disk(tmp_path, 64, [sys.executable, str(ROOT / "train.py"), *tiny_args(
      corpus, tmp_path / "disk" / "w", trained[1], steps=40)])
  assert p.returncode == 2, p.stderr[-3000:]
  assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]
  assert p.stderr.strip().splitlines()[-1] == (
      f"error: cannot write checkpoint {tmp_path / 'disk' / 'w' / 'checkpoints' / '40'}: No "
      f"space left on device (the checkpoints saved before it are intact)"), p.stderr[-2000:]
  workdir = tmp_path / "w"
  assert ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10, 20, 30]
  for step in (10, 20, 30):
    assert tree_hash(workdir / "checkpoints" / str(step)) == \
        tree_hash(trained[0] / "checkpoints" / str(step))
  jax.tree_util.tree_map(np.testing.assert_array_equal, params_of(workdir),
                         params_of(trained[0]))
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [(r["split"], r["step"]) for r in rows if r["step"] > 30] == [("train", 35),
                                                                      ("train", 40)]
  assert not (workdir / "train.lock").exists()


FILL_THE_LOG = """
import json, sys
from seq2seq.metrics import MetricsWriter
from seq2seq.errors import UserError
w, n, said = MetricsWriter(sys.argv[1]), 0, None
try:
  while n < 100000:
    w.write(n, "train", {"loss": 1.0 / (n + 1), "accuracy": 0.5})
    n += 1
except UserError as e:
  said = str(e)
w.write(n + 1, "train", {"loss": 0.0})   # after the failure: nothing, quietly
w.close()
from seq2seq.config import get_experiment
from seq2seq.workdir import Workdir
try:
  Workdir(sys.argv[1]).write_config(get_experiment("tiny"))
  config = None
except UserError as e:
  config = str(e)
print(json.dumps({"rows": n, "error": said, "config": config}))
"""


@pytest.mark.skipif(not shutil.which("unshare"), reason="no unshare (util-linux)")
def test_the_log_on_a_really_full_disk_is_one_error_then_silence(tmp_path):
  """metrics.jsonl and the TensorBoard file fill the disk: the write that fails raises one
  UserError naming the file and the full disk (train.py: one line, exit 2), and the
  writer writes nothing after it, nor fails again. config.json, then, is a UserError too."""
  (tmp_path / "w").mkdir()
  p = on_a_full_disk(tmp_path, 32, [sys.executable, "-c", FILL_THE_LOG,
                                    str(tmp_path / "disk" / "w")], timeout=120)
  assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert 10 < out["rows"] < 100000, out
  assert out["error"] is not None and out["error"].startswith(
      f"cannot write {tmp_path / 'disk' / 'w'}/"), out
  assert out["error"].endswith(": No space left on device (the checkpoints saved before it "
                               "are intact)"), out
  rows = (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(r)["step"] for r in rows[:-1]] == list(range(len(rows) - 1))
  assert f'"step": {out["rows"] + 1},' not in rows[-1]    # nothing after the failure
  assert out["config"] == (f"cannot write {tmp_path / 'disk' / 'w' / 'config.json'}: No space "
                           f"left on device")   # and no half-written config.json.tmp:
  assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["metrics.jsonl", "tensorboard"]


def test_a_batch_too_large_for_memory_is_one_line_and_the_checkpoints_stay(corpus, trained,
                                                                          tmp_path):
  """A resume with a batch the memory cannot hold: one line naming the batch and what XLA
  could not allocate, exit 2, no checkpoint written, those before it unchanged, unlocked.
  The address space is capped (ulimit -v, 6 GB: the run needs under 2) so that XLA:CPU's
  allocation of the step's 21 GB fails with RESOURCE_EXHAUSTED, as XLA:GPU's does on a GPU."""
  workdir = tmp_path / "w"
  shutil.copytree(trained[0], workdir)
  before = tree_hash(workdir / "checkpoints")
  env = dict(os.environ, JAX_PLATFORMS="cpu")   # (a GPU's runtime needs more address space)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  p = subprocess.run(["bash", "-c", 'ulimit -v 6000000 && exec "$0" "$@"', sys.executable,
                      str(ROOT / "train.py"), *tiny_args(
                          corpus, workdir, trained[1], 40,
                          ["--config.train.batch_size=65536"])],
                     env=env, text=True, capture_output=True, timeout=240, cwd=str(ROOT))
  assert p.returncode == 2, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: out of memory: the training step on a batch of 65536 × 32 "
                         "tokens (train.batch_size × seq_len) could not allocate "), last
  needed = re.search(r"could not allocate ([\d.]+) GiB \(([\d,]+) bytes\)", last)
  assert needed and int(needed[2].replace(",", "")) > 6e9, last
  assert last.endswith("; lower --config.train.batch_size or raise "
                       "--config.train.grad_accum_steps (the same batch in micro-batches, in "
                       "less memory); the checkpoints saved before it are intact"), last
  assert tree_hash(workdir / "checkpoints") == before
  params_of(workdir)
  assert not (workdir / "train.lock").exists()


@pytest.mark.parametrize("message, says", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 26843545600 bytes.",
     "could not allocate 25.0 GiB (26,843,545,600 bytes)"),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 3.00GiB (3221225472B) on device "
     "ordinal 0", "could not allocate 3.0 GiB (3,221,225,472 bytes)"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
     "hbm. Used 20.53G of 15.48G hbm. Exceeded hbm capacity by 5.05G.",
     "could not allocate 20.53G (of 15.48G hbm)"),
    ("RESOURCE_EXHAUSTED: ran out of something", "could not allocate the memory it needs "
     "(XLA's message names no size: RESOURCE_EXHAUSTED: ran out of something)"),
])
def test_out_of_memory_names_the_batch_and_the_memory(message, says):
  """XLA's words for it on GPU and TPU (JAX's own exception type; on CPU the test above
  makes a real one), as the training step and the evaluation say them."""
  from seq2seq.steps import OutOfMemory, raise_if_out_of_memory
  cfg = override(get_experiment("base"), ["train.batch_size=256", "train.grad_accum_steps=2"])
  with pytest.raises(OutOfMemory) as e:
    raise_if_out_of_memory(jax.errors.JaxRuntimeError(message), cfg, devices=8)
  assert str(e.value).startswith("out of memory: the training step on a batch of 256 × 256 "
                                 "tokens (train.batch_size × seq_len; 32 rows on each of 8 "
                                 "devices, in 2 micro-batches) " + says), str(e.value)
  with pytest.raises(OutOfMemory) as e:
    raise_if_out_of_memory(jax.errors.JaxRuntimeError(message), cfg, 8, evaluation=True)
  assert str(e.value).startswith("out of memory: the evaluation on batches of 64 rows "
                                 "(train.eval_batch_size) " + says), str(e.value)
  assert "; lower --config.train.eval_batch_size;" in str(e.value)
  # other runtime errors are not its business
  raise_if_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else"), cfg, 8)
  raise_if_out_of_memory(MemoryError("RESOURCE_EXHAUSTED"), cfg, 8)


@pytest.mark.parametrize("what", ["checkpoints", "metrics.jsonl"])
def test_unwritable_run_files_are_refused_before_training(trained, tmp_path, capsys, what):
  """The workdir's checkpoints/ and metrics.jsonl are probed before anything runs (a
  checkpoints/ that cannot be written into used to hang the run at exit)."""
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  if what == "checkpoints":
    shutil.rmtree(workdir / what)
    (workdir / what).write_text("")          # not a directory: nothing can be written in it
  else:
    os.chmod(workdir / what, 0o444)
    if os.access(workdir / what, os.W_OK):
      pytest.skip("this user writes read-only files (root)")
  before = tree_hash(workdir)
  assert train_script.main(["--workdir", str(workdir), "--no_progress", "--steps", "40"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"error: {workdir / what} is not writable: ") and "\n" not in err, err
  assert tree_hash(workdir) == before


def test_ctrl_c_in_the_final_evaluation_stops_at_once(corpus, trained, tmp_path):
  """Once trained and saved, Ctrl-C interrupts the final evaluation where it is (it used to
  be held until both evaluations had run, then their results were dropped)."""
  import shutil
  workdir = tmp_path / "copy"
  shutil.copytree(trained[0], workdir)
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  from test_decode_cli import WITH_CTRL_C   # train.py with Ctrl-C handled, as from a terminal
  proc = subprocess.Popen([sys.executable, "-c", WITH_CTRL_C, str(ROOT / "train.py"),
                           *tiny_args(corpus, workdir, trained[1])], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    seen = []
    for line in proc.stderr:
      seen.append(line)
      if "nothing to train, evaluating only" in line:
        proc.send_signal(signal.SIGINT)
        break
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  err = "".join(seen) + err
  assert proc.returncode == 130, err[-2000:]
  assert "[validation @" not in err and "[test @" not in err, err[-2000:]
  assert err.strip().splitlines()[-1] == "interrupted", err[-2000:]


def test_data_paths_are_stored_absolute_so_a_run_resumes_from_anywhere(corpus, trained,
                                                                       tmp_path, monkeypatch):
  from seq2seq import train_lib
  monkeypatch.chdir(corpus)
  cfg = train_lib.resolve_config(str(tmp_path / "w"), "tiny",
                                 ["data.dataset=parallel_text", "data.train_files=train.tsv",
                                  "data.data_dir=~/tfds"])
  assert cfg.data.train_files == str(corpus / "train.tsv")
  assert cfg.data.data_dir == os.path.expanduser("~/tfds")
  # a workdir stored with a relative path (before this change) resumes from where it was
  old = cfg.replace(data=cfg.data.replace(train_files="train.tsv"))
  (tmp_path / "w").mkdir()
  ckpt_lib.write_config(tmp_path / "w", old)
  again = train_lib.prepare_workdir(cfg, tmp_path / "w")
  assert again.data.train_files == str(corpus / "train.tsv")


def test_config_overrides():
  cfg = override(get_experiment("numbers"), ["model.d_model=256", "steps=7", "pack=false"])
  assert cfg.model.d_model == 256 and cfg.train.steps == 7 and cfg.data.pack is False
  with pytest.raises(ConfigError, match="ambiguous"):
    override(cfg, ["vocab_size=5"])
  with pytest.raises(ConfigError, match="expected --config.KEY=VALUE"):
    override(cfg, ["steps"])


def test_data_files_without_a_dataset_mean_parallel_text(tmp_path, capsys):
  def cfg_of(argv):
    args, overrides = train_script.parse_args(argv)
    return override(get_experiment("numbers"),
                    train_script.config_items(args, overrides) + overrides)
  cfg = cfg_of(["--train_files", "corpus/train", "--test_files", "corpus/test"])
  assert (cfg.data.dataset, cfg.data.train_files, cfg.data.test_files) == \
      ("parallel_text", "corpus/train", "corpus/test")
  assert cfg_of(["--config.data.dataset=numbers"]).data.dataset == "numbers"
  # files with another dataset would be ignored: an error instead, whatever the order given
  for argv in (["--dataset", "numbers", "--train_files", "corpus/train"],
               ["--config.data.validation_files=corpus/validation"]):
    with pytest.raises(ConfigError, match="only when the dataset is parallel_text"):
      cfg_of(argv)
  assert override(get_experiment("numbers"), ["data.train_files=t", "data.dataset=parallel_text"]
                  ).data.train_files == "t"
  # ... in one line from train.py, before anything is written
  work = tmp_path / "w"
  assert train_script.main(["--workdir", str(work), "--dataset", "wmt14_translate/de-en",
                            "--train_files", "corpus/train"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: data.train_files is read only") and "\n" not in err, err
  assert not work.exists()


# --- multi-host ---------------------------------------------------------------------------

def test_two_processes_agree_with_one(corpus, trained, tmp_path):
  """2 processes × 2 CPU devices over gloo on loopback == 1 process × 4 devices."""
  _, data_dir = trained
  steps = 6
  # A fixed shard count makes the batches independent of the number of hosts.
  extra = ["--config.train.checkpoint_every=6", "--config.train.log_every=2",
           "--config.data.num_shards=2"]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}",
             JAX_PLATFORMS="cpu")
  one = tmp_path / "one"
  subprocess.run([sys.executable, str(ROOT / "train.py"),
                  *tiny_args(corpus, one, data_dir, steps, extra)], env=env, check=True,
                 capture_output=True, timeout=300)
  env2 = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}",
              SEQ2SEQ_DIST_TIMEOUT="60")
  two = tmp_path / "two"
  run_two_hosts([sys.executable, str(ROOT / "train.py"),
                 *tiny_args(corpus, two, data_dir, steps, extra)], env2)
  rows = lambda w: [r for r in map(json.loads, (w / "metrics.jsonl").read_text().splitlines())
                    if r["split"] == "train"]
  for a, b in zip(rows(one), rows(two)):
    assert a["step"] == b["step"]
    assert abs(a["loss"] - b["loss"]) < 1e-5
  for x, y in zip(jax.tree_util.tree_leaves(params_of(one)),
                  jax.tree_util.tree_leaves(params_of(two))):
    np.testing.assert_allclose(x, y, atol=1e-5)


def test_when_one_process_dies_the_other_stops_and_the_run_resumes(corpus, trained, tmp_path):
  """Process 1 is killed after a checkpoint: process 0 stops within the heartbeat timeout
  (it does not hang), and the checkpoint it leaves resumes."""
  _, data_dir = trained
  extra = ["--config.train.checkpoint_every=10", "--config.train.log_every=10",
           "--config.data.num_shards=2"]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}",
             JAX_PLATFORMS="cpu", SEQ2SEQ_DIST_TIMEOUT="60", SEQ2SEQ_HEARTBEAT_TIMEOUT="5")
  work = tmp_path / "w"
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, str(ROOT / "train.py"), *tiny_args(corpus, work, data_dir, 100_000, extra),
       "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
       "--process_id", str(i)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      text=True) for i in range(2)]
  try:
    deadline = time.time() + 240
    while not any(c.name.isdigit() for c in (work / "checkpoints").glob("*")):
      assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint"
      time.sleep(0.5)
    procs[1].kill()
    killed = time.time()
    _, err = procs[0].communicate(timeout=120)
    waited = time.time() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  assert procs[0].returncode != 0, err[-2000:]
  assert waited < 5 + 45, waited
  assert "another task died" in err, err[-2000:]
  last = ckpt_lib.Checkpoints(work, read_only=True).steps()[-1]
  params_of(work, last)  # the newest checkpoint restores
  four = f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}"
  p = run_train(tiny_args(corpus, work, data_dir, last + 5, extra), env_extra={"XLA_FLAGS": four})
  assert f"resuming from {work / 'checkpoints' / str(last)} (step {last})" in p.stdout + p.stderr
  rows = [json.loads(r) for r in (work / "metrics.jsonl").read_text().splitlines()]
  assert rows[-1]["step"] == last + 5


@pytest.mark.slow
def test_logged_tokens_per_sec_leaves_out_evaluation_time(corpus, tmp_path):
  """The evaluation at step 10 (it compiles the decode loop: seconds against milliseconds per
  tiny step) falls in the interval logged at 15, whose tokens_per_sec is its tokens over its
  logged seconds: the training steps' time only."""
  p = run_train(tiny_args(corpus, tmp_path / "w", tmp_path / "tfds", 30,
                          ["--config.train.eval_every=10", "--config.train.num_eval_examples=20"]))
  rows = [json.loads(r) for r in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  evals = {r["step"]: r for r in rows if r["split"] == "validation"}
  train = {r["step"]: r for r in rows if r["split"] == "train"}
  assert list(evals)[:2] == [10, 20], p.stderr
  # Were the evaluation counted, the interval would last longer than the evaluation alone.
  assert train[15]["seconds"] < evals[10]["seconds"], (train, evals)


def test_summary_names_the_step_of_stale_metrics():
  from seq2seq import train_lib
  m = dict(loss=1.0, perplexity=3.5, accuracy=0.5, bleu=10.0, chrf=30.0, exact_match=0.25,
           examples=8)
  r = train_lib.TrainResult(step=120, workdir="w", train_metrics={},
                            eval_metrics=dict(m, step=100), test_metrics={}, seconds=1.0,
                            stopped_early=True)
  assert "validation (at step 100, the last evaluation): loss 1.000" in train_lib.summary(r)
  r = dataclasses.replace(r, eval_metrics=dict(m, step=120))
  assert "validation: loss 1.000" in train_lib.summary(r)
