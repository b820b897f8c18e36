"""The net under cuDNN's attention, through train.py's own code (train_lib.train, its steps,
evaluation and decoding) with a cuDNN emulated to fail in the run's programs but not in
the probe's: the probe's small program passes where a run's large one fails (compiling,
running, or with NaN), as on the GPUs of JAX's issues. No such failure ends a run: the
forms move to XLA's attention for every role, the work is done again, one line says so,
and the move is stored only where the evidence names cuDNN."""
import contextlib
import functools
import io
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from seq2seq import train_lib
from seq2seq.config import DataConfig
from seq2seq.data import testing as data_testing
from seq2seq.kernels import accelerator as acc
from test_attention_guard import _cfg, _verdicts_kept, _xla, fake_cudnn, in_probe  # noqa: F401


def _called_from(name: str) -> bool:
  frame = sys._getframe()
  while frame is not None:
    if frame.f_code.co_name == name:
      return True
    frame = frame.f_back
  return False


def _uncompilable(x):
  """A call the compiler refuses (NOT_FOUND: no kernel of that name), named as cuDNN's are."""
  return jax.ffi.ffi_call("__cudnn$fmhaEmulated", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


# What the running programs' emulated cuDNN does, read when they run (`io_callback`): set
# from `on_log`, after a step has ended.
ARMED = {"raise": None, "nan": False}


def _when_armed(x):
  """`x`, NaN once ARMED["nan"]; raising ARMED["raise"] while the program runs, once set."""
  def check(_):
    if ARMED["raise"]:
      raise RuntimeError(ARMED["raise"])
    return np.bool_(ARMED["nan"])
  nan = io_callback(check, jax.ShapeDtypeStruct((), jnp.bool_), x.reshape(-1)[0],
                    ordered=False)
  return jnp.where(nan, jnp.nan, x).astype(x.dtype)


def _cudnn_failing(forward=None, backward=None, where=None):
  """XLA's attention (values and gradients equal to it) whose output (`forward`, applied to
  it) or dq (`backward`) fails, in programs traced outside the probe (and inside function
  `where`, if given)."""
  def failing():
    return not in_probe() and (where is None or _called_from(where))

  @jax.custom_vjp
  def attend(q, k, v, mask):
    y = _xla(q, k, v, mask)
    return forward(y) if forward is not None and failing() else y

  def fwd(q, k, v, mask):
    return jax.vjp(lambda q, k, v: _xla(q, k, v, mask), q, k, v)

  def bwd(vjp, g):
    dq, dk, dv = vjp(g)
    return (backward(dq) if backward is not None and failing() else dq), dk, dv, None
  attend.defvjp(fwd, bwd)
  return attend


@pytest.fixture(autouse=True)
def disarmed():
  ARMED.update({"raise": None, "nan": False})
  yield
  ARMED.update({"raise": None, "nan": False})


@functools.lru_cache(maxsize=None)
def _corpus(root: str) -> dict:
  pairs = data_testing.sentence_pairs(132, seed=3)
  return {f"{split}_files": data_testing.write_tsv(f"{root}/{split}.tsv", part)
          for split, part in (("train", pairs[:120]), ("validation", pairs[120:126]),
                              ("test", pairs[126:]))}


def _train(root, name, steps=4, on_log=None, **train):
  """train.py's run of a tiny bf16 model on the accelerator kernels: (its result, its
  final parameters)."""
  cfg = _cfg()
  cfg = cfg.replace(
      data=DataConfig(dataset="parallel_text", data_dir=str(root / "tfds"), vocab_size=300,
                      max_src_len=32, max_tgt_len=32, **_corpus(str(root))),
      train=cfg.train.replace(steps=steps, log_every=train.pop("log_every", 2),
                              checkpoint_every=steps, eval_every=1000, num_eval_examples=4,
                              eval_batch_size=4, **train))
  result = train_lib.train(cfg, root / name, progress=False, on_log=on_log)
  from seq2seq.load import load_workdir
  return result, load_workdir(root / name)[1]


@pytest.fixture(scope="module")
def on_xla(tmp_path_factory):
  """The same run on XLA's attention from the start: (its result, its parameters)."""
  root = tmp_path_factory.mktemp("on_xla")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(acc.ENV, "xla")
    return _train(root, "xla")


def _same_run(got, want) -> None:
  """The same parameters as `want`'s run, and its evaluations (within bf16's reordering: a
  form left on the emulated cuDNN evaluates through another fusion of the same sums)."""
  (result, params), (plain, plain_params) = got, want
  assert result.step == plain.step
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(plain_params)):
    np.testing.assert_array_equal(a, b)
  for split in ("eval_metrics", "test_metrics"):
    a, b = getattr(result, split), getattr(plain, split)
    assert a and all(np.isclose(a[k], b[k], rtol=1e-3, atol=0) for k in
                     ("loss", "accuracy", "bleu")), (a, b)


def _cudnn_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if "cuDNN" in line]


@pytest.mark.slow   # a training run with its evaluations (~10-20 s on 2 cores)
@pytest.mark.parametrize("where, what", [("evaluate_loss", "evaluation"),
                                         ("translate_nbest", "decoding")])
@pytest.mark.parametrize("how", ["compile", "nan"])
def test_evaluation_and_decoding_run_under_the_net(fake_cudnn, tmp_path, capsys, monkeypatch,
                                                   on_xla, where, what, how):
  """cuDNN's forward fails in the evaluation's programs (teacher-forced loss) or in
  decoding's: it does not compile (before, the run died at its first evaluation, and again
  at each resume's), or it gives NaN (before, NaN metrics or garbled translations, said
  nowhere). The evaluation is done again on XLA's attention, said in one line (a split);
  its forms take XLA's attention for every role (train step included); the run ends as one
  on XLA's attention from the start. The compiler's error names cuDNN: the move is stored; a NaN
  names nothing and the probe at the run's form passes: it is not."""
  stored = _verdicts_kept(tmp_path, monkeypatch)
  fault = _uncompilable if how == "compile" else (lambda y: y * jnp.nan)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _cudnn_failing(forward=fault, where=where))
  run = _train(tmp_path, "w")
  lines = _cudnn_lines(capsys.readouterr().err)
  why = r"JaxRuntimeError: NOT_FOUND: .*" if how == "compile" else "non-finite results"
  kept = r"kept for later runs" if how == "compile" else r"not kept for later runs: .*"
  assert 1 <= len(lines) <= 2 and all(re.fullmatch(   # (one a split: their forms differ)
      rf"{what}: cuDNN's attention failed \({why}; query x key lengths [\dx, ]+\): moved "
      rf"to XLA's attention and did the {what} again \({kept}\)", line) for line in lines), lines
  moved = [v for v in acc.verdicts() if not v["forward"]["ok"]]
  assert moved and all(v["train"]["ok"] is False for v in moved), acc.verdicts()
  assert not set(map(acc._key_text, acc.in_use())) & {
      acc._key_text(tuple(v["signature"].values())) for v in moved}
  (machine,) = stored().values()
  assert any(not v["forward"][0] and not v["train"][0] for v in machine.values()) == \
      (how == "compile"), machine
  _same_run(run, on_xla)


@pytest.mark.slow   # two training runs (~20-30 s on 2 cores)
@pytest.mark.parametrize("error, kept", [
    ("CUDNN_STATUS_EXECUTION_FAILED: fmha backward (emulated)", True),
    ("Failed to capture gpu graph (emulated)", False)])
def test_a_step_failing_while_it_runs_is_redone_from_an_intact_state(
    fake_cudnn, tmp_path, capsys, monkeypatch, on_xla, error, kept):
  """cuDNN's backward raises while the train step runs (the state it was given is donated:
  before, the run died there). The step is redone on XLA's attention from the state it
  started from, kept on the host; the run ends with the parameters of a run on XLA's
  attention from the start. The move is stored where the error names cuDNN, not where it
  names nothing and the probe at the run's form passes."""
  stored = _verdicts_kept(tmp_path, monkeypatch)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _cudnn_failing(backward=_when_armed))
  ARMED["raise"] = error   # (in the run's programs: the probe's pass)
  run = _train(tmp_path, "w")
  lines = _cudnn_lines(capsys.readouterr().err)
  suffix = r"kept for later runs" if kept else r"not kept for later runs: .*"
  assert len(lines) == 1 and re.fullmatch(
      rf"step 1: cuDNN's attention failed while the step ran \(JaxRuntimeError: INTERNAL: "
      rf"CpuCallback error calling callback: RuntimeError: {re.escape(error)}; query x key "
      rf"lengths [\dx, ]+\): moved to XLA's attention and redid the step \({suffix}\)",
      lines[0]), lines
  (machine,) = stored().values()
  assert any("failed (step 1)" in v.get("train", (0, ""))[1] for v in machine.values()) == \
      kept, machine
  _same_run(run, on_xla)


@pytest.mark.slow   # a training run (~10 s on 2 cores)
def test_a_non_finite_step_after_the_watched_steps_names_cudnn(fake_cudnn, tmp_path,
                                                                monkeypatch):
  """Past the watched steps (here 1), cuDNN's gradients turn NaN at step 3: the run stops
  as a diverging one does, no checkpoint written after it, and its message names cuDNN's
  attention and SEQ2SEQ_ATTENTION=xla (before: "lower the learning rate?" alone)."""
  monkeypatch.setattr(train_lib, "CUDNN_WATCH_STEPS", 1)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _cudnn_failing(backward=_when_armed))
  arm = lambda step, m: ARMED.update(nan=step >= 2)
  with pytest.raises(train_lib.NonFiniteLoss) as e:
    _train(tmp_path, "w", steps=4, log_every=1, on_log=arm)
  assert re.fullmatch(
      r"non-finite loss or gradient at step 3: stopped; no checkpoint was written after it "
      r"\(cuDNN's attention trains in it, query x key lengths [\dx, ]+: rerun with "
      r"SEQ2SEQ_ATTENTION=xla to resume on XLA's attention; if that diverges too, lower the "
      r"learning rate\)", str(e.value)), str(e.value)
  assert not (tmp_path / "w" / "checkpoints" / "3").exists()


@pytest.mark.slow   # a training run (~10 s on 2 cores)
@pytest.mark.parametrize("when", ["timeout while traced", "out of memory while running"])
def test_a_timeout_or_out_of_memory_is_never_a_verdict(fake_cudnn, tmp_path, monkeypatch,
                                                       when):
  """A timeout (a host late to agree) while the step is traced, or the device running out
  of memory while it runs: the run stops in one line (before, the timeout moved every form
  to XLA's attention and stored it for every later run), nothing moves, nothing is
  stored."""
  stored = _verdicts_kept(tmp_path, monkeypatch)
  if when == "timeout while traced":
    def late(dq):
      raise jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: Barrier timed out (emulated)")
    fake, arm, says = _cudnn_failing(backward=late), None, (
        r"the train step failed: JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out")
  else:
    fake = _cudnn_failing(backward=_when_armed)
    arm = lambda step, m: ARMED.update({"raise": "RESOURCE_EXHAUSTED: Out of memory while "
                                                 "trying to allocate 123456789 bytes."})
    says = r"out of memory: the training step .* could not allocate 0.1 GiB"
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", fake)
  with pytest.raises(train_lib.UserError, match=says):
    _train(tmp_path, "w", log_every=1, on_log=arm)
  assert all(v["forward"]["ok"] and v["train"]["ok"] is not False for v in acc.verdicts())
  (machine,) = stored().values()
  assert all(v["forward"][0] and v.get("train", (True,))[0] for v in machine.values()), machine


@pytest.mark.slow   # the benchmark's train steps (~15 s on 2 cores)
def test_bench_train_steps_through_the_net(fake_cudnn, tmp_path, monkeypatch):
  """bench_train.run_one on the dry workload (bf16, the accelerator kernels) with a cuDNN
  whose train step does not compile: its row says the step was redone on XLA's attention,
  every loss is finite, and it has no error (before: the benchmark died)."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
  import bench_train
  from num2words import num2words
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for split, numbers in (("train", range(200)), ("validation", range(200, 204)),
                         ("test", range(204, 208))):
    (corpus / f"{split}.en").write_text("".join(num2words(n) + "\n" for n in numbers))
    (corpus / f"{split}.fr").write_text("".join(num2words(n, lang="fr") + "\n" for n in numbers))
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _cudnn_failing(backward=_uncompilable))
  r = bench_train.run_one("tiny", "bfloat16", steps=2, warmup=1, kernels="accelerator",
                          workload_set="dry", peak_n=64, corpus=str(corpus),
                          data_dir=str(tmp_path / "data"))
  assert "error" not in r and all(np.isfinite(r["losses"])) and len(r["losses"]) == 4
  assert len(r["redone_on_xla"]) == 1 and re.match(
      r"step 1: cuDNN's attention failed \(JaxRuntimeError: NOT_FOUND: .*\): moved to XLA's "
      r"attention and redid the step", r["redone_on_xla"][0]), r["redone_on_xla"]
  assert r["attention"] and not any(v["train"]["ok"] for v in r["attention"])



# --- decoding outside training: decode.py and the translation API -------------------------

SOURCES = [src for src, _ in data_testing.sentence_pairs(132, seed=3)[126:]]
FLAGS = {"beam": ["--n_best", "2"],                   # fixed batches; scores written too
         "greedy_slots": ["--beam_size", "1", "--batch_size", "2"]}   # slots


def _decode_py(workdir, flags) -> str:
  """decode.py's standard output for SOURCES (run in this process; its exit code 0)."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import decode
  with contextlib.redirect_stdout(io.StringIO()) as out:
    assert decode.main(["--workdir", str(workdir), "--no_progress", *flags, *SOURCES]) == 0
  return out.getvalue()


@pytest.fixture(scope="module")
def decoded_on_xla(tmp_path_factory):
  """The workdir of train.py's tiny bf16 run on the accelerator kernels, and decode.py's
  translations of it on XLA's attention from the start, by FLAGS' names."""
  root = tmp_path_factory.mktemp("decoded_on_xla")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(acc.ENV, "xla")
    _train(root, "w", steps=2)
    return root / "w", {name: _decode_py(root / "w", flags) for name, flags in FLAGS.items()}


@pytest.mark.slow   # decode.py twice on a tiny model, after its training (~10-20 s on 2 cores)
@pytest.mark.parametrize("how, strategy", [("compile", "beam"), ("run", "greedy_slots"),
                                           ("nan", "beam"), ("nan", "greedy_slots")])
def test_decode_py_runs_under_the_net(fake_cudnn, tmp_path, monkeypatch, recwarn,
                                      decoded_on_xla, how, strategy):
  """decode.py (translate_nbest: fixed batches, or slots) with a cuDNN whose forward fails
  in decoding's programs: it does not compile, it raises while it runs, or it gives NaN.
  Before, decode.py ended in a traceback, or wrote garbled translations and said nothing.
  Now the decoding is done again on XLA's attention, one warning says so, and the
  translations written are those of XLA's attention from the start. The move is stored
  where the error names cuDNN, not for a NaN (nothing names it, its probe passes)."""
  workdir, on_xla = decoded_on_xla
  stored = _verdicts_kept(tmp_path, monkeypatch)
  fault = {"compile": _uncompilable, "run": _when_armed, "nan": lambda y: y * jnp.nan}[how]
  ARMED["raise"] = "CUDNN_STATUS_EXECUTION_FAILED: fmha forward (emulated)"
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _cudnn_failing(forward=fault))
  jax.clear_caches()   # (decoding's programs as a new process traces them)
  monkeypatch.setattr(acc, "_IN_USE", set())
  assert _decode_py(workdir, FLAGS[strategy]) == on_xla[strategy]
  lines = [str(w.message) for w in recwarn if "cuDNN" in str(w.message)]
  why = {"compile": r"JaxRuntimeError: NOT_FOUND: .*",
         "run": r"JaxRuntimeError: INTERNAL: CpuCallback error calling callback: RuntimeError: "
                r"CUDNN_STATUS_EXECUTION_FAILED: fmha forward \(emulated\)",
         "nan": "non-finite results"}[how]
  kept = r"not kept for later runs: .*" if how == "nan" else r"kept for later runs"
  assert len(lines) == 1 and re.fullmatch(
      rf"decoding: cuDNN's attention failed \({why}; query x key lengths [\dx, ]+\): moved to "
      rf"XLA's attention and did the decoding again \({kept}\)", lines[0]), lines
  moved = [v for v in acc.verdicts() if not v["forward"]["ok"]]
  assert moved and all(v["train"]["ok"] is False for v in moved), acc.verdicts()
  assert not acc.in_use(), acc.verdicts()   # nothing left on cuDNN
  (machine,) = stored().values()
  assert any(not v["forward"][0] for v in machine.values()) == (how != "nan"), machine
