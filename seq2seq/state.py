"""The training state and what builds it: what the trainer and the checkpoints both need."""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from seq2seq.config import Config
from seq2seq.kernels import accelerator
from seq2seq.model import Transformer
from seq2seq.optim import make_optimizer, warmup_rsqrt_schedule


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # number of updates applied so far
  params: Any
  opt_state: Any


def schedule(cfg: Config) -> Callable:
  t = cfg.train
  return warmup_rsqrt_schedule(cfg.model.d_model, t.warmup_steps, t.learning_rate_scale,
                               t.cooldown_steps, t.steps)


def optimizer(cfg: Config) -> optax.GradientTransformation:
  t = cfg.train
  return make_optimizer(schedule(cfg), b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps,
                        clip_grad_norm=t.clip_grad_norm, weight_decay=t.weight_decay)


def as_float32(tree):
  """Floating leaves as float32. Adam's moments and updates are kept in float32 whatever
  model.param_dtype is: a bfloat16 second moment loses the small squared gradients, and
  the update is cast to the parameters' dtype only when applied (optax.apply_updates)."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@functools.partial(jax.jit, static_argnums=0)   # one program, not one per operation
def init_state(cfg: Config, rng: jax.Array) -> TrainState:
  dummy = jnp.ones((1, 8), jnp.int32)
  with accelerator.plain():   # no attention choice for a form only the init has
    params = Transformer(cfg.model).init(rng, dummy, dummy)["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer(cfg).init(as_float32(params)))


def abstract_state(cfg: Config) -> TrainState:
  """Shapes and dtypes of the TrainState of `cfg` (nothing is computed)."""
  return jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
