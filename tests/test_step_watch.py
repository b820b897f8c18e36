"""The step watch (seq2seq/watchdog.py) under train.py with a cuDNN emulated to fail
(tests/fake_cudnn_train.py) on a host of several devices: one device fails inside a step
while the step's other devices wait for it in its collectives (no error reaches the host),
or the step hangs. Before, the run waited for good, on every host. Now every host stops
within seconds, exit 2, each with one line naming the step; a failure that names cuDNN
stores the move, and the rerun resumes on XLA's attention."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from hosts import run_two_hosts
from test_attention_hosts import DRIVER, _args, _corpus, _env, _train_rows

FAILED = (r"step 1: device cpu:\d+ failed while the step's other devices waited for it in its "
          r"collectives \(JaxRuntimeError: INTERNAL: CpuCallback error calling callback: "
          r"RuntimeError: CUDNN_STATUS_EXECUTION_FAILED: fmha backward \(emulated\)\), cuDNN's "
          r"attention in the run's programs \(query x key lengths [\dx, ]+\): {who}; rerun to "
          r"resume from the last checkpoint on XLA's attention")
HUNG = (r"step 1 hung: no result from its devices in \d+ s, the slowest step so far "
        r"[\d.]+ s \(its compile included\), cuDNN's attention in the run's programs \(query "
        r"x key lengths [\dx, ]+\): every host stops; rerun with SEQ2SEQ_ATTENTION=xla to "
        r"resume from the last checkpoint on XLA's attention")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  return _corpus(root / "corpus"), root / "tfds"


def _two_hosts(corpus, tmp_path, failure: str, timeout: float) -> list[tuple]:
  """(standard error, exit code, seconds) of each of two processes of 2 devices training
  with the cuDNN stand-in failing as `failure` says on process 1, the watch's bound 3 times
  the slowest step or batch so far."""
  sources, data_dir = corpus
  env = _env(2, SEQ2SEQ_DIST_TIMEOUT="60", SEQ2SEQ_HEARTBEAT_TIMEOUT="100",
             FAKE_CUDNN_FAILURE=failure, FAKE_CUDNN_FAILS_ON="1", FAKE_STEP_WATCH="0,3")
  outs = run_two_hosts([sys.executable, str(DRIVER), *_args(sources, tmp_path / "w", data_dir)],
                       env, timeout=timeout, check=False)
  return [(err, code, seconds) for _, err, code, seconds in outs]


def _error_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]


@pytest.mark.slow   # two training processes that stop at their first step (~15-25 s)
@pytest.mark.parametrize("failure, says", [("run", FAILED.format(who="every host stops")),
                                           ("hang", HUNG)])
def test_a_device_failing_or_hanging_inside_a_step_stops_every_host(corpus, tmp_path, failure,
                                                                     says):
  """Two processes of 2 devices each. `run`: the last device of process 1 fails inside the
  first step, the 3 others wait for it there; process 1 stops at once with its error,
  process 0 within seconds, saying process 1 stopped the run. `hang`: that device never
  returns, no error anywhere; each process stops once the step has waited past the bound
  (here 3 times the slowest step so far, its compile included)."""
  (err0, code0, t0), (err1, code1, t1) = _two_hosts(corpus, tmp_path, failure, 150)
  lines = [_error_lines(err0), _error_lines(err1)]
  assert code1 == 2 and len(lines[1]) == 1 and re.fullmatch(
      rf"error: (process 0 stopped the run: )?{says}", lines[1][0]), err1[-3000:]
  assert code0 == 2 and len(lines[0]) == 1 and re.fullmatch(
      rf"error: (process 1 stopped the run: )?{says}", lines[0][0]), err0[-3000:]
  if failure == "run":   # (the process whose device failed says so itself)
    assert lines[0][0].startswith("error: process 1 stopped the run: "), lines
  assert abs(t0 - t1) < 10, (t0, t1)


@pytest.mark.slow   # a training process that stops at its first step, and its rerun (~25 s)
def test_one_host_s_device_failing_stops_the_run_and_the_rerun_resumes_on_xla(corpus,
                                                                             tmp_path):
  """One process of 2 devices, the last failing inside the first step while the other waits
  for it (nothing could be redone on it: it runs nothing after the collective it waits
  in). The run stops at once in one line, exit 2; the error names cuDNN, so the move to
  XLA's attention is stored, and the same command, rerun, trains to its end on XLA's
  attention."""
  sources, data_dir = corpus
  env = dict(_env(2, FAKE_CUDNN_FAILURE="run", FAKE_CUDNN_FAILS_ON="0",
                  FAKE_CUDNN_VERDICTS=str(tmp_path / "verdicts")),
             SEQ2SEQ_COMPILE_CACHE=str(tmp_path / "cache"))   # (the verdicts are kept there)
  command = [sys.executable, str(DRIVER), *_args(sources, tmp_path / "w", data_dir)]
  start = time.monotonic()
  first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
  assert first.returncode == 2 and _error_lines(first.stderr) == [
      line for line in first.stderr.splitlines() if re.fullmatch(
          "error: " + FAILED.format(who="the run stops"), line)], first.stderr[-3000:]
  assert time.monotonic() - start < 120
  stored = json.loads((tmp_path / "cache" / "attention_verdicts.json").read_text())
  (machine,) = stored.values()
  assert machine and all(not v["forward"][0] and not v["train"][0] for v in machine.values())
  again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert not [line for line in again.stderr.splitlines() if "cuDNN" in line], again.stderr
  assert [r["step"] for r in _train_rows(tmp_path / "w")] == [2, 4]
  verdicts = {json.dumps(list(v["signature"].values())): v
              for v in json.loads((tmp_path / "verdicts.0").read_text())}
  assert all(not verdicts[key]["forward"]["ok"] and not verdicts[key]["train"]["ok"]
             for key in machine), verdicts   # the step's forms took XLA's attention


EVAL_FAILED = (r"the evaluation of validation at step 4: device cpu:\d+ failed while the other "
               r"devices waited for it in its collectives \(JaxRuntimeError: INTERNAL: "
               r"CpuCallback error calling callback: RuntimeError: "
               r"CUDNN_STATUS_EXECUTION_FAILED: fmha forward \(emulated\)\), cuDNN's attention "
               r"in the run's programs \(query x key lengths [\dx, ]+\): every host stops; "
               r"rerun to resume from the last checkpoint on XLA's attention")
EVAL_HUNG = (r"the evaluation of validation at step 4 hung: no batch done in \d+ s, the slowest "
             r"step or batch so far [\d.]+ s \(compiles included\), cuDNN's attention in the "
             r"run's programs \(query x key lengths [\dx, ]+\): every host stops; rerun with "
             r"SEQ2SEQ_ATTENTION=xla to resume from the last checkpoint on XLA's attention")


@pytest.mark.slow   # two training processes that stop at their evaluation (~30-45 s)
@pytest.mark.parametrize("failure, says", [("eval_run", EVAL_FAILED), ("eval_hang", EVAL_HUNG),
                                           ("decode_hang", EVAL_HUNG)])
def test_a_device_failing_or_hanging_in_an_evaluation_stops_every_host(corpus, tmp_path,
                                                                        failure, says):
  """The train steps are well; in the evaluation after the last step, the last device of
  process 1 fails (`eval_run`) or hangs (`eval_hang`) inside the evaluation's loss, the 3
  others waiting for it in its collectives, or process 1's decoding hangs (`decode_hang`).
  Before, every host waited for good. Now each stops within seconds of the other, one line
  each naming the evaluation, exit 2; the last checkpoint is intact."""
  (err0, code0, t0), (err1, code1, t1) = _two_hosts(corpus, tmp_path, failure, 200)
  lines = [_error_lines(err0), _error_lines(err1)]
  for code, found, err in ((code0, lines[0], err0), (code1, lines[1], err1)):
    assert code == 2 and len(found) == 1 and re.fullmatch(
        rf"error: (process [01] stopped the run: )?{says}", found[0]), err[-3000:]
  if failure == "eval_run":   # (the process whose device failed says so itself)
    assert lines[0][0].startswith("error: process 1 stopped the run: "), lines
  assert abs(t0 - t1) < 10, (t0, t1)
  assert [r["step"] for r in _train_rows(tmp_path / "w")] == [2, 4]
  assert (tmp_path / "w" / "checkpoints" / "4").is_dir()
