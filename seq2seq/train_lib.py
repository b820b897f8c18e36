"""Training: `train` runs (or resumes) a config in a workdir: the loop, with its resume,
signals, logging, periodic evaluation and checkpoints. The steps it runs are in steps.py,
the evaluation in evaluate.py, the workdir's layout and lock in workdir.py.

Everything here is importable from a notebook; train.py only parses flags and calls `train`.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Callable

import jax

from seq2seq import checkpoint as ckpt_lib
from seq2seq import config as config_lib
from seq2seq import hosts
from seq2seq import metrics as metrics_lib
from seq2seq.config import Config
from seq2seq.errors import UserError
from seq2seq.evaluate import run_eval
from seq2seq.kernels import malloc
from seq2seq.state import schedule
from seq2seq.net import run_failures, divergence_hint, step_with_fallback
from seq2seq.steps import NO_STEP, Trainer, accumulate, check_runnable
from seq2seq.workdir import Workdir

# Importable from here as before the steps and the workdir's preparation moved.
from seq2seq.losses import shift_right  # noqa: E402,F401
from seq2seq.state import TrainState, init_state, optimizer  # noqa: E402,F401
from seq2seq.steps import NO_STEP as _NO_STEP, eval_step, loss_and_metrics, train_step  # noqa
from seq2seq.workdir import prepare_workdir  # noqa: E402,F401

CUDNN_WATCH_STEPS = 50   # steps checked as they end while on cuDNN (net.step_with_fallback)
_DEBUG_SIGKILL_AT = int(os.environ.get("SEQ2SEQ_DEBUG_SIGKILL_AT_STEP", "-1"))


class NonFiniteLoss(UserError):
  pass


@dataclasses.dataclass
class TrainResult:
  step: int
  workdir: str
  train_metrics: dict
  eval_metrics: dict
  test_metrics: dict
  seconds: float
  stopped_early: bool = False


def _is_main() -> bool:
  return jax.process_index() == 0


def _print(*a, **kw):
  if _is_main():
    print(*a, **kw, file=sys.stderr, flush=True)


def _say(bar, line: str) -> None:   # on standard error, above the progress bar if any
  if bar is None:
    return _print(line)
  bar.set_description("")
  bar.write(line, file=sys.stderr)


def resolve_config(workdir: Workdir | str | os.PathLike, name: str | None = None,
                   overrides: list[str] = ()) -> Config:
  """The run's Config: the workdir's own when resuming (unless `name` is given), else the
  experiment `name` (default "numbers"); then the `KEY=VALUE` overrides."""
  wd = Workdir.checked(workdir, must_exist=False)   # not "", a URL or a file
  base = wd.read_config() if wd.path.is_dir() and name is None else None
  if base is None:
    name = name or "numbers"
    if name not in config_lib.EXPERIMENTS:
      raise UserError(f"unknown config {name!r}; choose one of "
                      f"{', '.join(config_lib.EXPERIMENTS)}")
    base = config_lib.get_experiment(name)
  cfg = config_lib.override(base, list(overrides))
  return cfg.replace(data=cfg.data.with_absolute_paths())


def summary(r: "TrainResult") -> str:
  """What the run did, its final metrics, and how to translate with it: a sentence of its
  own data (the workdir's train_sources.json) and, where it can be said, what it reads."""
  import shlex
  from seq2seq.data import sources
  wd = Workdir(r.workdir)
  record, cfg = sources.read(wd), wd.read_config()
  if r.train_metrics:
    lines = [f"trained to step {r.step} in {r.seconds:.0f} s; workdir {r.workdir}"]
  else:   # train() logs whenever it has taken a step
    steps = f"train.steps {cfg.train.steps}; " if cfg is not None else ""
    lines = [f"nothing to train: workdir {r.workdir} is already at step {r.step} ({steps}"
             f"--steps N trains on to step N)"
             + (f"; evaluated it in {r.seconds:.0f} s" if r.eval_metrics or r.test_metrics
                else "")]
  for split, m in (("validation", r.eval_metrics), ("test", r.test_metrics)):
    if m:
      stale = m.get("step", r.step) != r.step
      at = f" (at step {m['step']}, the last evaluation)" if stale else ""
      lines.append(f"{split}{at}: loss {m['loss']:.3f}, perplexity {m['perplexity']:.3f}, "
                   f"token accuracy {m['accuracy']:.4f}, "
                   f"BLEU {m['bleu']:.1f}, chrF {m['chrf']:.1f}, exact match "
                   f"{m['exact_match']:.4f} on {m['examples']} examples")
  example = record.example if record is not None and record.example else "SENTENCE"
  lines.append(f"translate with: python decode.py --workdir {shlex.quote(str(r.workdir))} "
               f"{shlex.quote(example)}")
  reads = sources.what_the_model_reads(cfg.data) if cfg is not None else None
  if reads:
    lines.append(f"this model reads {reads}; anything else gets a confident guess")
  return "\n".join(lines)


def _start(cfg: Config, wd: Workdir, progress: bool):
  """Everything before the first step: the config checked against the workdir's, the data,
  the trainer, the state (restored or new), each stage agreed by the hosts. Returns (cfg,
  ds, trainer, ckpts, state, start, resuming)."""
  from seq2seq.data import load_dataset
  with hosts.stage("workdir"):
    resuming = wd.config.exists()
    cfg = wd.prepare(cfg)
  ds = load_dataset(cfg, wd, progress=None if progress else False)   # (bars on a terminal)
  malloc.release_freed_memory()   # what preparing the data held, before the model
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=ds.tokenizer.vocab_size))
  ckpts = None
  try:
    with hosts.stage("state"):
      trainer = Trainer(cfg, bos_id=ds.tokenizer.bos_id)
      ckpts = ckpt_lib.Checkpoints(wd, keep=cfg.train.keep_checkpoints)
      restored = ckpts.restore(trainer.abstract_state)
      if restored is None:
        state, start = trainer.init(jax.random.key(cfg.train.seed)), 0
      else:
        state, start = restored[0], int(restored[1]["step"])
        _print(f"resuming from {ckpts.directory / str(start)} (step {start})")
      if _is_main() and resuming:       # a resumed run's new train settings, once they work
        wd.write_config(cfg)
  except BaseException:
    if ckpts is not None:
      ckpts.close()
    raise
  hosts.started()
  return cfg, ds, trainer, ckpts, state, start, resuming


def train(cfg: Config, workdir: Workdir | str | os.PathLike, *, progress: bool = True,
          on_log: Callable[[int, dict], None] | None = None) -> TrainResult:
  """Trains (or resumes) `cfg` in `workdir`. Returns the final metrics.

  The workdir is locked for the run (`seq2seq.lock`); everything that can refuse the run
  is checked before anything is written, and a run refused (or interrupted) before its
  first step removes what it wrote, so the workdir is as it was."""
  t_start = time.time()
  wd = Workdir.checked(workdir, must_exist=False)
  made, lock = [], None
  try:
    with hosts.stage("lock"):   # process 0 takes it for the run's hosts; all learn the outcome
      check_runnable(cfg)
      if _is_main():   # (and puts it back if the run is refused)
        made, lock = wd.create(), wd.lock()
    before = wd.run_files()
    try:
      cfg, ds, trainer, ckpts, state, start, resuming = _start(cfg, wd, progress)
    except BaseException:
      if _is_main():
        wd.remove_new_run_files(before)
      raise
  except BaseException:
    if lock is not None:
      lock.release()
    wd.remove_made(made)
    raise
  try:   # a failure in one line (out of memory, cuDNN's); on several hosts, all stop
    with run_failures(cfg, trainer.data_parallel):
      return _loop(cfg, wd, ds, trainer, ckpts, state, start, resuming, lock, progress,
                   on_log, t_start)
  finally:
    if lock is not None:
      lock.release()


def _loop(cfg: Config, wd: Workdir, ds, trainer: Trainer, ckpts, state, start: int,
          resuming: bool, lock, progress: bool, on_log, t_start: float) -> TrainResult:
  from seq2seq.data.pipeline import Prefetch
  tc = cfg.train
  # A new run's config.json is written with its first checkpoint: until then the workdir
  # holds no run (a first attempt that fails, say out of memory, binds no later one to its
  # model config).
  config_written = resuming
  writer = metrics_lib.MetricsWriter(wd, enabled=_is_main())

  # SIGTERM (preemption) and a first Ctrl-C stop the run after the current step with a
  # checkpoint; a second Ctrl-C interrupts at once.
  stop = {"signal": None}

  def on_signal(signum, frame):
    stop.update(signal=signum)
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  old_handlers = {}
  if threading.current_thread() is threading.main_thread():
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

  batches = Prefetch(iter(ds.train_batches(start)))
  sched = jax.jit(schedule(cfg))   # for the log: one program, not one per operation
  n_dev = trainer.data_parallel
  _print(f"training {cfg.model.d_model}-d {cfg.model.num_encoder_layers}+"
         f"{cfg.model.num_decoder_layers}-layer model on {_train_pairs(ds):,} pairs, "
         f"{n_dev} device(s) ({jax.devices()[0].platform}), steps {start}->{tc.steps}"
         + (f" (already at step {start}: nothing to train, evaluating only)"
            if start >= tc.steps else ""))
  bar = None
  if progress and _is_main():
    from tqdm.auto import tqdm
    bar = tqdm(total=tc.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

  acc = None
  t_log, tokens_since = time.time(), 0.0
  train_metrics, eval_metrics, test_metrics = {}, {}, {}
  step, stopped_early = start, False

  def save(step):
    nonlocal config_written
    if lock is not None:
      lock.check()   # never two writers: a run that lost the workdir stops unsaved
    if not config_written and _is_main():
      wd.write_config(cfg)
    config_written = True
    ckpts.save(step, state, {"step": step, "data_position": step, "seed": tc.seed})

  prev_m = None
  t_first = time.time()
  if bar is not None:
    bar.set_description("compiling")   # the first step traces and compiles the program
  try:
    while step < tc.steps:
      batch = trainer.global_batch(next(batches))
      trainer, state, m, said = step_with_fallback(   # the net under cuDNN's attention
          trainer, state, batch, watch=step - start < CUDNN_WATCH_STEPS)
      for line in said:
        _say(bar, line)
      step += 1
      if step == start + 1:      # compiled: give the compiler's memory back (tuned malloc
        jax.block_until_ready(m)   # keeps what is freed, see seq2seq.malloc)
        malloc.release_freed_memory()
        _say(bar, f"first step in {time.time() - t_first:.1f} s (tracing and compiling the "
                  f"train step, or loading it from the compile cache)")
      if prev_m is not None:
        # Wait for the previous step: one step queued keeps the device busy, while running
        # further ahead holds more steps' buffers (+0.6 GB, and slower, on the Bible run).
        jax.block_until_ready(prev_m)
        if bar is not None and bar.n < step - 1:   # the bar moves as steps finish
          bar.update(step - 1 - bar.n)
      prev_m = m
      acc = accumulate(acc, m)
      last = step == tc.steps
      if step % tc.log_every == 0 or last or stop["signal"] or step % tc.checkpoint_every == 0:
        host = {k: float(v) for k, v in acc.items()}
        if host["first_bad_update"] < NO_STEP:
          bad = int(host["first_bad_update"])
          what = (f"non-finite loss or gradient at step {bad}" if host["first_bad_step"] == bad else
                  f"non-finite parameters after the update of step {bad}")
          raise NonFiniteLoss(f"{what}: stopped; no checkpoint was written after it "
                              f"({divergence_hint()})")
        now = time.time()
        n = max(host["tokens"], 1.0)
        tokens_since += host["tokens"]
        seconds = now - t_log   # training time since the last log
        train_metrics = {"loss": host["loss_sum"] / n, "accuracy": host["correct"] / n,
                         "learning_rate": float(sched(step)),
                         "tokens_per_sec": tokens_since / max(seconds, 1e-9),
                         "seconds": seconds}
        writer.write(step, "train", train_metrics)
        if on_log:
          on_log(step, train_metrics)
        if bar is not None:
          bar.set_postfix(loss=f"{train_metrics['loss']:.3f}",
                          lr=f"{train_metrics['learning_rate']:.2e}",
                          tok_s=f"{train_metrics['tokens_per_sec']:,.0f}", refresh=False)
          bar.update(step - bar.n)
        acc, t_log, tokens_since = None, now, 0.0
      if step % tc.checkpoint_every == 0 or last or stop["signal"]:
        save(step)
      if stop["signal"]:
        _print(f"\n{signal.Signals(stop['signal']).name} at step {step}: checkpoint saved, "
               f"exiting (run the same command to resume)")
        stopped_early = True
        break
      if step == _DEBUG_SIGKILL_AT:  # tests: die as a preempted machine would, once the
        ckpts.wait()                 # checkpoints saved so far are on disk
        os.kill(os.getpid(), signal.SIGKILL)
      if step % tc.eval_every == 0 and not last:
        t_eval = time.time()
        eval_metrics = run_eval(trainer, cfg, state, ds, "validation", writer, step, bar)
        t_log += time.time() - t_eval   # tokens/s counts the training time only
    ckpts.wait()
    for signum, handler in old_handlers.items():  # trained and saved: Ctrl-C now stops the
      signal.signal(signum, handler)              # final evaluation at once
    old_handlers = {}
    stopped_early = stopped_early or stop["signal"] is not None   # (one came just now)
    if not stopped_early:
      eval_metrics = run_eval(trainer, cfg, state, ds, "validation", writer, step, bar,
                               final=True)
      test_metrics = run_eval(trainer, cfg, state, ds, "test", writer, step, bar, samples=5,
                               final=True)
  finally:
    batches.close()   # the input pipeline's threads end before the interpreter does
    if bar is not None:
      bar.close()
    try:
      ckpts.close()
    finally:
      writer.close()
      for signum, handler in old_handlers.items():
        signal.signal(signum, handler)
  if stop["signal"] == signal.SIGINT:
    raise KeyboardInterrupt  # after the checkpoint: the caller reports the interruption
  return TrainResult(step=step, workdir=str(wd), train_metrics=train_metrics,
                     eval_metrics=eval_metrics, test_metrics=test_metrics,
                     seconds=time.time() - t_start, stopped_early=stopped_early)


def _train_pairs(ds) -> int:
  """Training pairs the run reads: those kept by the length policy (on one host)."""
  return ds.stats["kept"] if jax.process_count() == 1 else ds.num_examples("train")
