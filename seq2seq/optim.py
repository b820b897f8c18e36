"""The paper's learning-rate schedule and the Adam optimizer factory."""
from __future__ import annotations

import jax.numpy as jnp
import optax


def warmup_rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0,
                          cooldown_steps: int = 0, total_steps: int = 0):
  """lr(step) = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), step from 1.

  Linear warm-up for `warmup_steps`, then decay with the inverse square root of the step.
  With `cooldown_steps` > 0 (not in the paper), the last `cooldown_steps` steps up to
  `total_steps` (all of them, if fewer) are also scaled linearly down to 1/cooldown_steps at
  the last step.
  """
  cooldown_steps = min(cooldown_steps, total_steps)
  def schedule(step):
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
    lr = scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
    if cooldown_steps > 0:
      lr = lr * jnp.clip((total_steps + 1 - step) / cooldown_steps, 0.0, 1.0)
    return lr
  return schedule


def make_optimizer(learning_rate, b1: float = 0.9, b2: float = 0.98, eps: float = 1e-9,
                   clip_grad_norm: float = 0.0, weight_decay: float = 0.0
                   ) -> optax.GradientTransformation:
  """Adam(β1, β2, ε) as in the paper; optional global-norm clipping and decoupled weight decay.

  `learning_rate` is a float or a schedule of the 1-based step (as `warmup_rsqrt_schedule`);
  the first update uses step 1.
  """
  lr = (lambda count: learning_rate(count + 1)) if callable(learning_rate) else learning_rate
  parts = []
  if clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(clip_grad_norm))
  if weight_decay > 0:
    parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  else:
    parts.append(optax.adam(lr, b1=b1, b2=b2, eps=eps))
  return optax.chain(*parts)
