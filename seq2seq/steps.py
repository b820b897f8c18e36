"""The steps: the loss, one training update and one evaluation of a batch, and `Trainer`,
which jits them over a Mesh. `check_runnable` says before a run writes anything whether
its mesh and batch fit these devices and hosts; `raise_if_out_of_memory`, when a step ran
out of device memory, which batch did and what it could not get."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from seq2seq import kernels
from seq2seq import sharding as shd
from seq2seq.config import Config
from seq2seq.errors import UserError
from seq2seq.kernels import accelerator
from seq2seq.layout import head_weights
from seq2seq.losses import accuracy, cross_entropy, shift_right
from seq2seq.model import Transformer
from seq2seq.state import TrainState, as_float32, init_state, optimizer

# `first_bad_step` and `first_bad_update` of a step with none.
NO_STEP = 2 ** 30


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
           first_bad_step=jnp.where(finite, NO_STEP, state.step + 1),
           first_bad_update=jnp.where(finite & updated_finite, NO_STEP, state.step + 1))
  return new, m


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def accumulate(acc: dict | None, m: dict) -> dict:
  """The sums of the steps' metrics `acc` and `m` (None: no step yet); the first of their
  first bad steps."""
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
    # What the train step's trace gave cuDNN's attention (accelerator.Recording; None until
    # it is traced): the forms the net (seq2seq/net.py) watches.
    self.attention = None

    def step(s, b):
      with accelerator.recording() as traced:
        try:
          return train_step(s, b, cfg=cfg, bos_id=bos_id)
        finally:
          self.attention = traced
    self.step = jax.jit(
        step, in_shardings=(self.state_sharding, self.batch_sharding),
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


class OutOfMemory(UserError):
  """A step could not get the device memory it needs (XLA's RESOURCE_EXHAUSTED): its batch
  is too large for the device."""


def raise_if_out_of_memory(e: BaseException, cfg: Config, devices: int,
                           evaluation: bool = False) -> None:
  """OutOfMemory in one line, naming the batch of the training step (or of the evaluation)
  and the memory XLA could not allocate, if `e` is XLA's RESOURCE_EXHAUSTED; else nothing.
  Called where a step's error arrives: no checkpoint is written after it."""
  text = str(e)
  if not (isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in text):
    return
  t = cfg.train
  if evaluation:
    what = f"the evaluation on batches of {t.eval_batch_size} rows (train.eval_batch_size)"
    fix = "lower --config.train.eval_batch_size"
  else:
    split = [f"{t.batch_size // devices} rows on each of {devices} devices"] * (devices > 1)
    split += [f"in {t.grad_accum_steps} micro-batches"] * (t.grad_accum_steps > 1)
    what = (f"the training step on a batch of {t.batch_size} × {t.seq_len} tokens "
            f"(train.batch_size × seq_len{'; ' if split else ''}{', '.join(split)})")
    fix = ("lower --config.train.batch_size or raise --config.train.grad_accum_steps (the "
           "same batch in micro-batches, in less memory)")
  raise OutOfMemory(f"out of memory: {what} could not allocate {_wanted(text)}"
                    f"{_device_memory()}; {fix}; the checkpoints saved before it are "
                    f"intact") from None


def _wanted(text: str) -> str:
  """What XLA's message says it could not allocate: "Out of memory while trying to allocate
  N bytes" (GPU; "allocating" on CPU), "Failed to allocate request for 3.00GiB (N B)",
  TPU's "Used 20.53G of 15.48G hbm"."""
  n = re.search(r"(\d{4,}) ?(?:bytes|B\b)", text)
  if n:
    return f"{int(n[1]) / 2 ** 30:.1f} GiB ({int(n[1]):,} bytes)"
  used = re.search(r"Used ([\d.]+\s*[KMGT]i?B?) of ([\d.]+\s*[KMGT]i?B?) (\w+)", text)
  if used:
    return f"{used[1]} (of {used[2]} {used[3]})"
  return f"the memory it needs (XLA's message names no size: {text.splitlines()[0][:160]})"


def _device_memory() -> str:
  """", of the N GiB JAX may use on each <device>" where JAX knows it (not on CPU)."""
  try:
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:
    return ""
  return (f", of the {limit / 2 ** 30:.1f} GiB JAX may use on each {device.device_kind}"
          if limit else "")
