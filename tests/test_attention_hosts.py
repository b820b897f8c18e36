"""Several hosts decide alike about cuDNN's attention: two processes (jax.distributed over
gloo on loopback) whose emulated cuDNN passes its probe on one and fails it on the other
agree, run the same programs and end as a run on XLA's attention does, without hanging;
where one fails inside a step the other waits in, both stop within seconds, one line
each."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_XLA_FLAGS
from hosts import run_two_hosts

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "fake_cudnn_train.py"


def _corpus(d: Path) -> Path:
  from num2words import num2words
  d.mkdir()
  for name, numbers in (("train", range(0, 200)), ("validation", range(300, 308)),
                        ("test", range(320, 328))):
    lines = [f"{num2words(n)}\t{num2words(n, lang='fr')}" for n in numbers]
    (d / f"{name}.tsv").write_text("\n".join(lines) + "\n")
  return d


def _args(corpus: Path, workdir: Path, data_dir: Path) -> list[str]:
  return ["--workdir", str(workdir), "--config", "tiny", "--dataset", "parallel_text",
          "--train_files", str(corpus / "train.tsv"),
          "--validation_files", str(corpus / "validation.tsv"),
          "--test_files", str(corpus / "test.tsv"), "--data_dir", str(data_dir),
          "--steps", "4", "--no_progress",
          "--config.model.kernels=accelerator", "--config.model.dtype=bfloat16",
          "--config.model.dropout_rate=0.0",
          "--config.model.d_model=32", "--config.model.num_heads=2",
          "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
          "--config.model.d_ff=64", "--config.model.max_len=64",
          "--config.data.vocab_size=300", "--config.data.max_src_len=32",
          "--config.data.max_tgt_len=32", "--config.data.num_shards=2",
          "--config.train.batch_size=8", "--config.train.seq_len=32",
          "--config.train.warmup_steps=10", "--config.train.log_every=2",
          "--config.train.checkpoint_every=4", "--config.train.eval_every=1000",
          "--config.train.num_eval_examples=4", "--config.train.eval_batch_size=4"]


def _train_rows(workdir: Path) -> list[dict]:
  return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
          if r["split"] == "train"]


@pytest.fixture(scope="module")
def on_xla(tmp_path_factory):
  """(corpus, data_dir, workdir) of one process with 4 devices on XLA's attention."""
  root = tmp_path_factory.mktemp("on_xla")
  corpus, data_dir, one = _corpus(root / "corpus"), root / "tfds", root / "one"
  subprocess.run([sys.executable, str(ROOT / "train.py"), *_args(corpus, one, data_dir)],
                 env=_env(4, SEQ2SEQ_ATTENTION="xla"), check=True, capture_output=True,
                 timeout=300)
  return corpus, data_dir, one


def _env(devices: int, **extra) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", SEQ2SEQ_COMPILE_CACHE="off",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
             **extra)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # no verdicts kept between the runs
  return env


@pytest.mark.slow   # two training processes (~30 s on 2 cores), after one (~10 s)
@pytest.mark.parametrize("failure, said", [
    ("nan", None),
    ("compile", r"step 1: cuDNN's attention failed \(on another host; query x key lengths "
                r"[\dx, ]+\): moved to XLA's attention and redid the step \(not kept for "
                r"later runs: .*\)"),
])
def test_hosts_whose_cudnn_disagree_agree_and_do_not_hang(on_xla, tmp_path, failure, said):
  """Process 1's cuDNN fails, process 0's does not: `nan`, process 1's probe refuses cuDNN
  and process 0's passes (its train step is then non-finite); `compile`, both probes pass
  and process 1's train step fails to compile. The two agree (before, process 0 redid a
  step alone, or waited for process 1 in its step: hangs), train on XLA's attention as one
  process does, and process 0 says what moved to XLA in one line (`nan`: nothing did)."""
  corpus, data_dir, one = on_xla
  two = tmp_path / "two"
  env = _env(2, SEQ2SEQ_DIST_TIMEOUT="60", SEQ2SEQ_HEARTBEAT_TIMEOUT="20",
             FAKE_CUDNN_FAILURE=failure, FAKE_CUDNN_FAILS_ON="1",
             FAKE_CUDNN_VERDICTS=str(tmp_path / "verdicts"))
  outs = run_two_hosts([sys.executable, str(DRIVER), *_args(corpus, two, data_dir)], env)
  lines = [line for line in outs[0][1].splitlines() if "cuDNN" in line]
  assert (len(lines) == 1 and re.fullmatch(said, lines[0])) if said else not lines, outs[0][1]
  assert not any("cuDNN" in line for line in outs[1][1].splitlines())   # process 0 speaks
  verdicts = [json.loads((tmp_path / f"verdicts.{i}").read_text()) for i in range(2)]
  chosen = [[(v["signature"], v["forward"]["ok"], v["train"]["ok"]) for v in host]
            for host in verdicts]
  assert chosen[0] == chosen[1] and chosen[0], verdicts
  assert any(train is False for *_, train in chosen[0]), verdicts
  assert not any(train for *_, train in chosen[0]), verdicts
  if failure == "nan":
    assert any("refused on process 1" in v["train"]["reason"] for v in verdicts[0]), verdicts
  rows_one, rows_two = _train_rows(one), _train_rows(two)
  assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == [2, 4]
  for a, b in zip(rows_one, rows_two):   # (bf16: sums split over 4 devices either way)
    assert abs(a["loss"] - b["loss"]) < 1e-3 * a["loss"], (rows_one, rows_two)


@pytest.mark.slow   # two training processes that stop at their first step (~15-25 s)
@pytest.mark.parametrize("failure, says", [
    ("run", r"step 1: cuDNN's attention failed while the step ran \(JaxRuntimeError: "
            r"INTERNAL: CpuCallback error calling callback: RuntimeError: "
            r"CUDNN_STATUS_EXECUTION_FAILED: fmha backward \(emulated\); query x key lengths "
            r"[\dx, ]+\): every host stops; rerun to resume from the last checkpoint on XLA's "
            r"attention"),
    ("late", r"the train step failed: JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out "
             r"\(emulated\)")], ids=["run", "late"])
def test_one_host_s_failure_stops_every_host_within_seconds(on_xla, tmp_path, failure, says):
  """Process 1's cuDNN fails inside the first step (`run`: while it runs, on one device a
  process, process 0 waiting for it in the step's collectives; `late`: a timeout while it
  is traced, process 0 waiting for the hosts' agreement). Before: process 1 raised a traceback, and process 0 waited
  until JAX's heartbeat ended it (or for good, in a gather of another size). Now each
  stops within seconds of the other, exit 2, with one line: process 1 its failure,
  process 0 that process 1 stopped the run (`late`: that the step timed out on another
  host, or process 1's line)."""
  corpus, data_dir, _ = on_xla
  env = _env(1 if failure == "run" else 2, SEQ2SEQ_DIST_TIMEOUT="60",
             SEQ2SEQ_HEARTBEAT_TIMEOUT="100", FAKE_CUDNN_FAILURE=failure, FAKE_CUDNN_FAILS_ON="1")
  outs = run_two_hosts([sys.executable, str(DRIVER), *_args(corpus, tmp_path / "w", data_dir)],
                       env, check=False)
  (_, err0, code0, t0), (_, err1, code1, t1) = outs
  lines = [[line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
           for err in (err0, err1)]
  assert code1 == 2 and len(lines[1]) == 1 and re.fullmatch(f"error: {says}", lines[1][0]), err1
  assert code0 == 2 and len(lines[0]) == 1 and re.fullmatch(
      rf"error: (process 1 stopped the run: {says}|the train step ran out of memory or timed "
      rf"out on another host)", lines[0][0]), err0
  assert abs(t0 - t1) < 10, (t0, t1)
