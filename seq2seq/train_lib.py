"""Training: the loss, the jitted train/eval steps over a Mesh, the loop, evaluation.

Everything here is importable from a notebook; train.py only parses flags and calls `train`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import queue
import signal
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from seq2seq import checkpoint as ckpt_lib
from seq2seq import config as config_lib
from seq2seq import kernels
from seq2seq import metrics as metrics_lib
from seq2seq import sharding as shd
from seq2seq.config import Config
from seq2seq.errors import UserError
from seq2seq.kernels import malloc
from seq2seq.losses import accuracy, cross_entropy, shift_right
from seq2seq.model import Transformer, head_weights
from seq2seq.state import TrainState, as_float32, init_state, optimizer, schedule
from seq2seq.lock import WorkdirLock, WorkdirLocked
from seq2seq.workdir import Workdir
from seq2seq.workdir import prepare_workdir  # noqa: F401 (importable from here as before)


class NonFiniteLoss(UserError):
  pass


# --- the steps ----------------------------------------------------------------------------

def loss_and_metrics(cfg: Config, params, batch: dict, bos_id: int, *, train: bool,
                     rng=None, label_smoothing: float | None = None):
  """The label-smoothed loss summed over non-pad targets, and the batch's sums
  {"loss_sum", "tokens", "correct"}. Teacher forcing: the decoder reads the target shifted
  right behind BOS and predicts every position at once."""
  ls = cfg.train.label_smoothing if label_smoothing is None else label_smoothing
  tgt_BxT = batch["tgt"]
  tgt_in_BxT = shift_right(tgt_BxT, bos_id, batch.get("tgt_segments"))
  ops = kernels.get(cfg.model.kernels)
  logits_or_features = Transformer(cfg.model).apply(
      {"params": params}, batch["src"], tgt_in_BxT, batch.get("src_segments"),
      batch.get("tgt_segments"), batch.get("src_positions"), batch.get("tgt_positions"),
      train=train, rngs=None if rng is None else {"dropout": rng},
      return_features=ops.head_loss is not None)
  if ops.head_loss is None:   # the logits, then the loss
    loss_sum, n = cross_entropy(logits_or_features, tgt_BxT, ls)
    correct, _ = accuracy(logits_or_features, tgt_BxT)
  else:                       # the output head, loss and accuracy as one fused op
    w, b, w_is_VxD = head_weights(cfg.model, params)
    loss_sum, correct, n = ops.head_loss(
        logits_or_features, w, b, tgt_BxT, (tgt_BxT != 0).astype(jnp.float32),
        label_smoothing=ls, dtype=cfg.model.dtype, w_is_VxD=w_is_VxD)
  return loss_sum, {"loss_sum": loss_sum, "tokens": n, "correct": correct}


def train_step(state: TrainState, batch: dict, *, cfg: Config, bos_id: int) -> tuple:
  """One update. Gradients are of the summed loss over the whole (global) batch divided by
  its number of target tokens, so the result does not depend on how the batch is split
  across devices or micro-batches. A non-finite loss or gradient leaves the state unchanged;
  an update that makes the parameters non-finite is kept but flagged like it
  (`first_bad_update`): the loop stops before it saves a checkpoint either way."""
  rng = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step)
  grad_fn = jax.grad(lambda p, b, r: loss_and_metrics(cfg, p, b, bos_id, train=True, rng=r),
                     has_aux=True)
  k = cfg.train.grad_accum_steps
  if k == 1:
    grads, m = grad_fn(state.params, batch, rng)
  else:
    micro = jax.tree_util.tree_map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

    def body(carry, i):
      g, m = grad_fn(state.params, jax.tree_util.tree_map(lambda x: x[i], micro),
                     jax.random.fold_in(rng, i))
      return jax.tree_util.tree_map(jnp.add, carry, (g, m)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, (state.params, {
        "loss_sum": jnp.zeros(()), "tokens": jnp.zeros(()), "correct": jnp.zeros(())}))
    (grads, m), _ = jax.lax.scan(body, zeros, jnp.arange(k))
  n = jnp.maximum(m["tokens"], 1.0)
  grads = jax.tree_util.tree_map(lambda g: g / n, as_float32(grads))
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(m["loss_sum"]) & jnp.isfinite(grad_norm)

  def update(s: TrainState):
    updates, opt_state = optimizer(cfg).update(grads, s.opt_state, s.params)
    params = optax.apply_updates(s.params, updates)
    # Adam's moments need no check: from zero, with finite gradients (a finite norm bounds
    # every g^2), they stay finite. A learning rate can still carry the parameters past it.
    return (TrainState(step=s.step + 1, params=params, opt_state=opt_state),
            _all_finite(params))

  # A branch, not a select of old and new state: updates Adam's state in place (a select
  # makes XLA copy every moment buffer: ~4x the optimizer's time).
  new, updated_finite = jax.lax.cond(
      finite, update, lambda s: (s.replace(step=s.step + 1), jnp.array(True)), state)
  m = dict(m, grad_norm=grad_norm,
           first_bad_step=jnp.where(finite, _NO_STEP, state.step + 1),
           first_bad_update=jnp.where(finite & updated_finite, _NO_STEP, state.step + 1))
  return new, m


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


_NO_STEP = 2 ** 30
_DEBUG_SIGKILL_AT = int(os.environ.get("SEQ2SEQ_DEBUG_SIGKILL_AT_STEP", "-1"))


def _accumulate(acc: dict | None, m: dict) -> dict:
  if acc is None:
    return m
  return {k: jnp.minimum(acc[k], v) if k.startswith("first_bad_") else acc[k] + v
          for k, v in m.items()}


def eval_step(params, batch: dict, *, cfg: Config, bos_id: int) -> dict:
  """The train step's loss and accuracy without dropout, and the negative log-likelihood
  of the targets (no label smoothing: what a perplexity is of)."""
  _, m = loss_and_metrics(cfg, params, batch, bos_id, train=False)
  nll_sum = m["loss_sum"]
  if cfg.train.label_smoothing > 0:
    nll_sum = loss_and_metrics(cfg, params, batch, bos_id, train=False, label_smoothing=0.0)[0]
  return dict(m, nll_sum=nll_sum)


class Trainer:
  """The model, optimizer and jitted steps of one config on one mesh."""

  def __init__(self, cfg: Config, mesh=None, bos_id: int = 1):
    self.cfg = cfg
    self.mesh = mesh if mesh is not None else shd.make_mesh(cfg.train.mesh_shape)
    self.bos_id = bos_id
    self.batch_sharding = shd.batch_sharding(self.mesh)
    abstract = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
    self.state_sharding = shd.state_shardings(self.mesh, abstract, cfg.train.fsdp)
    self.abstract_state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract, self.state_sharding)
    self.init = jax.jit(lambda rng: init_state(cfg, rng), out_shardings=self.state_sharding)
    self.step = jax.jit(
        lambda s, b: train_step(s, b, cfg=cfg, bos_id=bos_id),
        in_shardings=(self.state_sharding, self.batch_sharding),
        out_shardings=(self.state_sharding, shd.replicated(self.mesh)), donate_argnums=0)
    self.eval = jax.jit(
        lambda p, b: eval_step(p, b, cfg=cfg, bos_id=bos_id),
        in_shardings=(self.state_sharding.params, self.batch_sharding),
        out_shardings=shd.replicated(self.mesh))

  @property
  def data_parallel(self) -> int:
    return self.mesh.size

  def global_batch(self, local: dict) -> dict:
    return shd.global_batch({k: v for k, v in local.items()
                             if isinstance(v, np.ndarray) and v.dtype != object},
                            self.batch_sharding)

  def local_params(self, state: TrainState):
    """Parameters on this host's first device (for decoding outside the mesh)."""
    rep = jax.jit(lambda p: p, out_shardings=shd.replicated(self.mesh))(state.params)
    return jax.tree_util.tree_map(lambda x: x.addressable_data(0), rep)


# --- evaluation ---------------------------------------------------------------------------

def evaluate_loss(trainer: Trainer, params, ds, split: str, max_examples: int = 0) -> dict:
  """Teacher-forced metrics over a split (padded, none dropped), per target token: `loss` as
  trained (label-smoothed: the KL divergence to the smoothed target, 0 at best), `nll` (the
  targets' negative log-likelihood), `perplexity` = exp(nll), and token `accuracy`."""
  cfg = trainer.cfg
  bs = _eval_batch_size(cfg, trainer.data_parallel)
  tot = {"loss_sum": 0.0, "nll_sum": 0.0, "tokens": 0.0, "correct": 0.0}
  for batch in _local_eval_batches(ds, split, bs, max_examples):
    m = trainer.eval(params, trainer.global_batch(batch))
    for k in tot:
      tot[k] += float(m[k])
  n = max(tot["tokens"], 1.0)
  nll = tot["nll_sum"] / n
  return {"loss": tot["loss_sum"] / n, "nll": nll, "accuracy": tot["correct"] / n,
          "perplexity": math.exp(min(nll, 50.0))}


def _eval_batch_size(cfg: Config, data_parallel: int) -> int:
  bs = cfg.train.eval_batch_size
  return -(-bs // data_parallel) * data_parallel


def _local_eval_batches(ds, split, batch_size, max_examples):
  """Each host's rows of every global eval batch."""
  p, n = jax.process_index(), jax.process_count()
  per = batch_size // n
  for b in ds.eval_batches(split, batch_size, max_examples):
    yield {k: v[p * per:(p + 1) * per] for k, v in b.items()
           if isinstance(v, np.ndarray) and k in ("src", "tgt")}


def evaluate_translations(cfg: Config, params, ds, split: str, max_examples: int = 0,
                          strategy=None) -> tuple[dict, list[tuple[str, str, str]]]:
  """Decodes a split and scores it: BLEU, chrF and exact match. Returns (metrics, samples).

  A source longer than the model's max_len is cut to it, as the loss's batches cut it, and
  counted in metrics["truncated"]."""
  from seq2seq import search, translate
  if strategy is None:
    t = cfg.train
    strategy = (search.get_strategy("beam", beam_size=t.beam_size, alpha=t.length_penalty)
                if t.decode_strategy == "beam" else search.get_strategy("greedy"))
  srcs, refs = [], []
  for b in ds.eval_batches(split, cfg.train.eval_batch_size, max_examples):
    valid = b["valid"]
    srcs += [s for s, v in zip(b["src_text"], valid) if v]
    refs += [t for t, v in zip(b["tgt_text"], valid) if v]
  out = translate.translate_nbest(params, cfg.model, ds.tokenizer, srcs, strategy,
                                 batch_size=cfg.train.eval_batch_size, truncate=True,
                                 skip_empty=False)
  hyps = [t[0] for t in out.texts]
  m = {"bleu": metrics_lib.bleu(hyps, refs), "chrf": metrics_lib.chrf(hyps, refs),
       "exact_match": metrics_lib.exact_match(hyps, refs), "examples": len(hyps),
       "truncated": len(out.truncated)}
  return m, list(zip(srcs, refs, hyps))


# --- the loop -----------------------------------------------------------------------------

class _Prefetch:
  """Prepares the next batches on a background thread while the device computes."""

  def __init__(self, it, size: int = 4):
    self._q: queue.Queue = queue.Queue(size)
    self._it = it
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()

  def _run(self):
    try:
      for x in self._it:
        self._q.put(x)
    except BaseException as e:  # surfaced on the main thread
      self._q.put(e)

  def __next__(self):
    x = self._q.get()
    if isinstance(x, BaseException):
      raise x
    return x


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


def check_runnable(cfg: Config) -> None:
  """What can refuse `cfg` on these devices and hosts before any data is read: the mesh and
  how the batch splits over hosts, shards and devices. Checked before anything is written."""
  t = cfg.train
  hosts, devices = jax.process_count(), jax.device_count()
  shd.parse_mesh_shape(t.mesh_shape, devices)
  if t.batch_size % hosts:
    raise UserError(f"batch_size {t.batch_size} is not divisible by the number of hosts "
                    f"({hosts})")
  shards = cfg.data.num_shards or hosts
  if shards % hosts or t.batch_size % shards:
    raise UserError(f"num_shards {shards} must be a multiple of the number of hosts "
                    f"({hosts}) and divide batch_size ({t.batch_size})")
  if t.batch_size % devices:   # each device takes an equal part of every batch
    raise UserError(f"batch_size {t.batch_size} must be divisible by the number of devices "
                    f"({devices})")


def _lock(wd: Workdir) -> WorkdirLock | None:
  """Process 0 takes the workdir's lock for the run's hosts; all of them learn the outcome
  (so that a refused multi-host run ends on every host at once)."""
  lock, error = None, None
  if _is_main():
    try:
      lock = wd.lock()
    except UserError as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not ok and error is None:
      error = WorkdirLocked(f"workdir {wd} is in use by another run (see process 0)")
  if error is not None:
    raise error
  return lock


def _start(cfg: Config, wd: Workdir):
  """Everything before the first step: the config checked against the workdir's, the data,
  the trainer, the state (restored or new). Returns (cfg, ds, trainer, ckpts, state, start,
  resuming)."""
  from seq2seq.data import load_dataset
  resuming = wd.config.exists()
  cfg = wd.prepare(cfg)
  ds = load_dataset(cfg, wd)
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=ds.tokenizer.vocab_size))
  trainer = Trainer(cfg, bos_id=ds.tokenizer.bos_id)
  ckpts = ckpt_lib.Checkpoints(wd, keep=cfg.train.keep_checkpoints)
  try:
    restored = ckpts.restore(trainer.abstract_state)
  except BaseException:
    ckpts.close()
    raise
  if restored is None:
    state = trainer.init(jax.random.key(cfg.train.seed))
    start = 0
  else:
    state, meta = restored
    start = int(meta["step"])
    _print(f"resuming from {ckpts.directory / str(start)} (step {start})")
  if _is_main() and resuming:       # a resumed run's new train settings, once they work
    wd.write_config(cfg)
  return cfg, ds, trainer, ckpts, state, start, resuming


def train(cfg: Config, workdir: Workdir | str | os.PathLike, *, progress: bool = True,
          on_log: Callable[[int, dict], None] | None = None) -> TrainResult:
  """Trains (or resumes) `cfg` in `workdir`. Returns the final metrics.

  The workdir is locked for the run (`seq2seq.lock`); everything that can refuse the run
  is checked before anything is written, and a run refused (or interrupted) before its
  first step removes what it wrote, so the workdir is as it was."""
  t_start = time.time()
  wd = Workdir.checked(workdir, must_exist=False)
  check_runnable(cfg)
  made = wd.create()
  lock = None
  try:
    lock = _lock(wd)
    before = wd.run_files()
    try:
      cfg, ds, trainer, ckpts, state, start, resuming = _start(cfg, wd)
    except BaseException:
      if _is_main():
        wd.remove_new_run_files(before)
      raise
  except BaseException:
    if lock is not None:
      lock.release()
    wd.remove_made(made)
    raise
  try:
    return _loop(cfg, wd, ds, trainer, ckpts, state, start, resuming, lock, progress,
                 on_log, t_start)
  finally:
    if lock is not None:
      lock.release()


def _loop(cfg: Config, wd: Workdir, ds, trainer: Trainer, ckpts, state, start: int,
          resuming: bool, lock, progress: bool, on_log, t_start: float) -> TrainResult:
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

  batches = _Prefetch(iter(ds.train_batches(start)))
  sched = schedule(cfg)
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
  try:
    while step < tc.steps:
      local = next(batches)
      state, m = trainer.step(state, trainer.global_batch(local))
      step += 1
      if step == start + 1:      # compiled: give the compiler's memory back (tuned malloc
        jax.block_until_ready(m)   # keeps what is freed, see seq2seq.malloc)
        malloc.release_freed_memory()
      if prev_m is not None:
        # Wait for the previous step: one step queued keeps the device busy, while running
        # further ahead holds more steps' buffers (+0.6 GB, and slower, on the Bible run).
        jax.block_until_ready(prev_m)
        if bar is not None and bar.n < step - 1:   # the bar moves as steps finish
          bar.update(step - 1 - bar.n)
      prev_m = m
      acc = _accumulate(acc, m)
      last = step == tc.steps
      if step % tc.log_every == 0 or last or stop["signal"] or step % tc.checkpoint_every == 0:
        host = {k: float(v) for k, v in acc.items()}
        if host["first_bad_update"] < _NO_STEP:
          bad = int(host["first_bad_update"])
          what = (f"non-finite loss at step {bad}" if host["first_bad_step"] == bad else
                  f"non-finite parameters after the update of step {bad}")
          raise NonFiniteLoss(f"{what}: stopped; no checkpoint was written after it (lower "
                              f"the learning rate?)")
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
        eval_metrics = _run_eval(trainer, cfg, state, ds, "validation", writer, step, bar)
        t_log += time.time() - t_eval   # tokens/s counts the training time only
    ckpts.wait()
    for signum, handler in old_handlers.items():  # trained and saved: Ctrl-C now stops the
      signal.signal(signum, handler)              # final evaluation at once
    old_handlers = {}
    stopped_early = stopped_early or stop["signal"] is not None   # (one came just now)
    if not stopped_early:
      eval_metrics = _run_eval(trainer, cfg, state, ds, "validation", writer, step, bar,
                               final=True)
      test_metrics = _run_eval(trainer, cfg, state, ds, "test", writer, step, bar, samples=5,
                               final=True)
  finally:
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


def _run_eval(trainer, cfg, state, ds, split, writer, step, bar, samples: int = 3,
              final: bool = False) -> dict:
  if split not in ds.splits:
    return {}
  n = 0 if final else cfg.train.num_eval_examples
  t0 = time.time()
  malloc.release_freed_memory()   # the train steps' kept buffers, before the evaluation's
  m = evaluate_loss(trainer, state.params, ds, split, n)
  tm, examples = evaluate_translations(cfg, trainer.local_params(state), ds, split, n)
  malloc.release_freed_memory()   # and the evaluation's, before the next train step
  m.update(tm, seconds=time.time() - t0)
  writer.write(step, split, m)
  if _is_main():
    lines = [f"[{split} @ {step}] loss {m['loss']:.3f}  ppl {m['perplexity']:.2f}  "
             f"acc {m['accuracy']:.3f}  "
             f"BLEU {m['bleu']:.1f}  chrF {m['chrf']:.1f}  exact {m['exact_match']:.3f} "
             f"({m['examples']} examples"
             + (f", {m['truncated']} sources cut to {cfg.model.max_len} tokens)"
                if m.get("truncated") else ")")]
    for src, ref, hyp in examples[:samples]:
      lines.append(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
    if bar is not None:
      bar.write("\n".join(lines), file=sys.stderr)
    else:
      _print("\n".join(lines))
  return dict(m, step=step)
