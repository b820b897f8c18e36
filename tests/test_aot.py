"""The GPU programs compiled with no GPU (seq2seq/aot.py): what XLA:GPU builds for an H100 and
an H200 from the shipped target configs, what cuDNN's attention is handed, and what fits.

The compiles need the CUDA plugin of the installed JAX and NVIDIA's cuDNN wheel. Without
them these tests skip, saying so; where SEQ2SEQ_REQUIRE_AOT is set (CI, .ci/newer_jax) they
fail instead."""
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from seq2seq import config as config_lib
from seq2seq import versions
from seq2seq.aot import TARGETS_DIR

OOM_BATCH = 8192   # the GPU check's out-of-memory stage (bench/gpu/run.py): bible_gpu's rows
JAX_GPU_SHARE = 0.75   # XLA_PYTHON_CLIENT_MEM_FRACTION's default: what JAX's allocator takes


def _missing_wheels() -> str | None:
  if (importlib.util.find_spec("jax_plugins") is None
      or importlib.util.find_spec("jax_plugins.xla_cuda13") is None):
    return "no CUDA plugin (pip install \"jax-cuda13-plugin==<jax version>\")"
  try:
    importlib.metadata.version("nvidia-cudnn-cu13")
  except importlib.metadata.PackageNotFoundError:
    return "no cuDNN wheel (pip install \"nvidia-cudnn-cu13==9.19.*\")"
  return None


@pytest.fixture
def gpu_wheels():
  missing = _missing_wheels()
  if missing and os.environ.get("SEQ2SEQ_REQUIRE_AOT"):
    pytest.fail(f"SEQ2SEQ_REQUIRE_AOT is set and the offline GPU compile cannot run: {missing}")
  if missing:
    pytest.skip(f"offline GPU compile: {missing}")


def aot(tmp_path, *args, script=("-m", "seq2seq.aot")):
  """Runs the command; returns (the process, its --json results or None)."""
  out = tmp_path / f"aot{len(list(tmp_path.iterdir()))}.json"
  argv = [*args, "--json", str(out)] if script[0] == "-m" else list(args)
  env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  p = subprocess.run([sys.executable, *script, *argv], cwd=ROOT, capture_output=True,
                     text=True, timeout=900, env=env)
  return p, (json.loads(out.read_text()) if out.exists() else None)


def usable_bytes(target_file: str) -> int:
  """What a program may use on the GPU of a shipped target config: JAX's share of it."""
  memory = int(re.search(r"device_memory_size:\s*(\d+)", (TARGETS_DIR / target_file)
                         .read_text())[1])
  return int(memory * JAX_GPU_SHARE)


def attention_operands(cfg, rows: int, q_len: int, k_len: int) -> tuple:
  """The [rows, length, heads, head size] bf16 operands of a call, and its bias: one mask
  per row ([rows, 1, Q, K]), as packed rows have."""
  m = cfg.model
  t = lambda n: f"{rows}x{n}x{m.num_heads}x{m.head_dim}xbf16"
  return t(q_len), t(k_len), f"{rows}x1x{q_len}x{k_len}xbf16"


def check_programs(res, usable: int, attention: str = "cudnn") -> dict:
  """The command's results by program, each compiled within the memory it may use, its
  cuDNN calls all bf16."""
  programs = {r["program"]: r for r in res["programs"]}
  assert res["attention"] == attention and res["usable"] == usable
  for r in programs.values():
    assert r["fits"] and 0 < r["peak"] + r["beside"] <= usable, r["program"]
    assert r["ops"] > 500
    assert all(c["operands"][0].endswith("bf16") for c in r["lowered_fmha"])
  return programs


@pytest.mark.slow
@pytest.mark.aot
def test_bible_gpu_train_step_compiles_for_an_h100_with_every_attention_on_cudnn(
    tmp_path, gpu_wheels):
  """bible_gpu's train step, for an H100: it fits, and every attention reaches cuDNN in the
  form the model makes, forward and backward, and stays there through XLA's optimization."""
  p, res = aot(tmp_path, "--target", "h100", "--config", "bible_gpu", "--programs", "train")
  assert p.returncode == 0, p.stderr[-3000:]
  assert res["kind"] == "NVIDIA H100 80GB HBM3"
  cfg = config_lib.get_experiment("bible_gpu")
  t = cfg.train
  (train,) = check_programs(res, usable_bytes("h100_sxm.txtpb")).values()
  # The model's three attentions (encoder self, decoder self, decoder cross; one layer of
  # each stack is traced, the others are its scan), each forward and backward, every one on
  # cuDNN, with a bias of one mask per packed row.
  calls = train["lowered_fmha"]
  forward = [c for c in calls if c["call"] == "__cudnn$fmhaScaleBiasSoftmax"]
  backward = [c for c in calls if c["call"] == "__cudnn$fmhaScaleBiasSoftmaxBackward"]
  assert len(forward) == 3 and len(backward) == 3 and len(calls) == 6, calls
  q, k, bias = attention_operands(cfg, t.batch_size, t.seq_len, t.seq_len)
  for c in forward:
    assert (c["q"], c["k"], c["bias"]) == (q, k, bias)
  for c in backward:
    assert c["operands"][:2] == [q, k] and bias in c["operands"]
  assert train["kept_fmha"] == 6     # none turned back into XLA's attention by the optimizer
  assert train["beside"] == 0        # its state is its argument


@pytest.mark.slow
@pytest.mark.aot
def test_bible_gpu_evaluation_and_decoding_compile_for_an_h100(tmp_path, gpu_wheels):
  """The other programs of the bible_gpu run, for an H100: its evaluation step and its
  greedy and beam-4 decoding fit beside the training state, with cuDNN's forward attention
  in the forms they make."""
  p, res = aot(tmp_path, "--target", "h100", "--config", "bible_gpu", "--programs",
               "eval,greedy,beam")
  assert p.returncode == 0, p.stderr[-3000:]
  cfg = config_lib.get_experiment("bible_gpu")
  programs = check_programs(res, usable_bytes("h100_sxm.txtpb"))
  assert list(programs) == ["eval", "greedy", "beam"]
  # Evaluation: forward only, the loss and the unsmoothed likelihood (the two passes are
  # one program, whose identical calls XLA may merge).
  evaluation = programs["eval"]
  assert {c["call"] for c in evaluation["lowered_fmha"]} == {"__cudnn$fmhaScaleBiasSoftmax"}
  assert len(evaluation["lowered_fmha"]) == 6 and 3 <= evaluation["kept_fmha"] <= 6
  assert evaluation["beside"] > 0    # the optimizer's moments stay on the device meanwhile
  # Decoding: the encoder's six unrolled layers on the whole source, then steps of one
  # query (greedy) or of the 4 beams' queries sharing their source's keys (beam search).
  n, src = cfg.model.num_encoder_layers, cfg.data.max_src_len
  rows = cfg.train.eval_batch_size
  for name, step_queries in (("greedy", 1), ("beam", 4)):
    r = programs[name]
    assert not any("Backward" in c["call"] for c in r["lowered_fmha"])
    encoder = [c for c in r["lowered_fmha"] if c["q"].startswith(f"{rows}x{src}x")]
    assert len(encoder) == n and r["forms"].count(f"{src}x{src} bias B") == n
    assert f"{step_queries}x{src} bias B" in r["forms"], r["forms"]
    assert r["kept_fmha"] == len(r["lowered_fmha"])
    assert r["beside"] > evaluation["beside"]   # and a copy of the parameters


@pytest.mark.slow
@pytest.mark.aot
def test_the_paper_presets_at_their_batches_on_an_h100(tmp_path, gpu_wheels):
  """base and big as their presets are (float32: XLA's attention, cuDNN takes none), at
  their batches of 128 rows of 256 tokens: base fits one H100; big does not (it needs
  bf16, micro-batches or more devices), and the table says so."""
  usable = usable_bytes("h100_sxm.txtpb")
  for preset, fits in (("base", True), ("big", False)):
    p, res = aot(tmp_path, "--target", "h100", "--config", preset, "--programs", "train")
    assert p.returncode == 0, p.stderr[-3000:]
    (train,) = {r["program"]: r for r in res["programs"]}.values()
    assert res["attention"] == "xla" and train["lowered_fmha"] == []
    assert train["fits"] is fits and (train["peak"] <= usable) is fits, (preset, train)
    assert ("| train | 1 |" in p.stdout) and (("| NO |" in p.stdout) is not fits)


@pytest.mark.slow
@pytest.mark.aot
def test_the_oom_stage_batch_does_not_fit_an_h200_and_the_batch_named_does(tmp_path, gpu_wheels):
  """train.py --check_memory, offline for an H200: the GPU check's out-of-memory batch does
  not fit, said in one line before anything is written, with a batch that fits; that
  batch, checked again, fits."""
  workdir = tmp_path / "run"
  train = ("train.py",)
  p, _ = aot(tmp_path, "--config", "bible_gpu", "--workdir", str(workdir), "--check_memory",
             "h200", f"--config.train.batch_size={OOM_BATCH}", script=train)
  assert p.returncode == 2, p.stderr[-3000:]
  errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in p.stderr and p.stdout == ""
  m = re.fullmatch(r"error: does not fit: the train step on a batch of 8192 x 64 tokens .*"
                   r"needs ([\d.]+) GiB of the ([\d.]+) GiB .*NVIDIA H200.*; a batch of (\d+) "
                   r"rows fits \(--config.train.batch_size=\3,.*", errors[0])
  assert m, errors[0]
  need, usable, fit = float(m[1]), float(m[2]), int(m[3])
  assert need > usable
  assert abs(usable * 2 ** 30 - usable_bytes("h200.txtpb")) < 0.01 * 2 ** 30
  assert 128 <= fit < OOM_BATCH * usable / need
  assert not workdir.exists()

  p, _ = aot(tmp_path, "--config", "bible_gpu", "--workdir", str(workdir), "--check_memory",
             "h200", f"--config.train.batch_size={fit}", script=train)
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stdout.startswith(f"fits: the train step on a batch of {fit} x 64 tokens"), p.stdout
  assert not workdir.exists()


def test_bad_requests_answer_in_one_line_before_compiling(tmp_path):
  for args, says in [
      (("--target", "h100", "--programs", "train,sample"), "--programs"),
      (("--target", "v5e", "--attention", "cudnn"), "cuDNN is NVIDIA's"),
      (("--target", "v5e", "--devices", "3"), "--devices must be one of 1, 4, 8"),
      (("--target", "h100", "--devices", "3"), "must be divisible by the devices (3)"),
      (("--target", "h100", "--memory_fraction", "1.5"), "--memory_fraction"),
      (("--target", "h100", "--config", "large"), "unknown config 'large'"),
      (("--target", "a100",), "invalid choice"),
      (("--target", "h100", "--config.model.d_model=100"), "divisible by num_heads"),
      (("--target", "h100", "--config", "base", "--attention", "cudnn"), "dtype float32")]:
    p, res = aot(tmp_path, *args)
    assert p.returncode == 2, (args, p.stderr)
    assert p.stderr.startswith("error: ") and says in p.stderr, (args, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and res is None, (args, p.stderr)


def test_train_check_memory_on_a_cpu_names_the_targets(tmp_path):
  p, _ = aot(tmp_path, "--workdir", str(tmp_path / "run"), "--check_memory",
             script=("train.py",))
  assert p.returncode == 2
  assert p.stderr.strip() == ("error: --check_memory: no GPU or TPU here; name one to compile "
                              "for offline: --check_memory h100 (or h200, v5e, v6e; h100:8 for 8)")
  p, _ = aot(tmp_path, "--workdir", str(tmp_path / "run"), "--check_memory", "a100",
             script=("train.py",))
  assert p.returncode == 2 and "unknown target 'a100'" in p.stderr
  assert not (tmp_path / "run").exists()


def test_a_jax_newer_than_any_tested_gets_a_notice():
  newest = max(versions.TESTED_JAX, key=versions._release)
  for tested in versions.TESTED_JAX:
    assert versions.notice(tested) is None
  assert versions.notice("0.10.0") is None
  for newer in ("0.12.1", "0.13.0", "0.13.0rc1", "1.0", newest + ".1"):
    line = versions.notice(newer)
    assert line.startswith(f"notice: jax {newer} is newer than any") and newest in line


def test_the_installed_jax_is_one_the_ci_runs():
  """CI's venvs (.ci/run, .ci/newer_jax) install exactly the versions versions.py names."""
  import jax
  ci = (ROOT / ".ci" / "run").read_text()
  for version in versions.TESTED_JAX[1:]:
    assert re.search(rf"\b{re.escape(version)}\b", ci), version
  if os.environ.get("CI"):
    assert jax.__version__ in versions.TESTED_JAX
