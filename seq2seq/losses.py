"""Teacher forcing and the training objective."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shift_right(tgt_BxT: jax.Array, bos_id: int, segments_BxT: jax.Array | None = None):
  """Teacher forcing: the decoder input is the target shifted right behind BOS.

  [a b c EOS 0] -> [BOS a b c EOS]. In packed rows every example starts with BOS and
  padding stays 0.
  """
  shifted = jnp.concatenate(
      [jnp.full_like(tgt_BxT[:, :1], bos_id), tgt_BxT[:, :-1]], axis=1)
  if segments_BxT is None:
    return shifted
  prev_seg = jnp.concatenate([jnp.zeros_like(segments_BxT[:, :1]), segments_BxT[:, :-1]], 1)
  shifted = jnp.where(segments_BxT != prev_seg, bos_id, shifted)
  return jnp.where(segments_BxT > 0, shifted, 0)


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                  label_smoothing: float = 0.0, weights_BxT: jax.Array | None = None):
  """Label-smoothed cross-entropy summed over non-pad targets: (loss_sum, weight_sum).

  The smoothed target puts 1-ε on the true token and ε/(V-1) on every other token; the
  entropy of that target is subtracted so that a perfect prediction scores 0.
  """
  vocab = logits_BxTxV.shape[-1]
  if weights_BxT is None:
    weights_BxT = (targets_BxT != 0).astype(jnp.float32)
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  true_logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  sum_logp_BxT = jnp.sum(logp_BxTxV, axis=-1) if label_smoothing > 0 else None
  xent_BxT = smoothed_xent(true_logp_BxT, sum_logp_BxT, vocab, label_smoothing)
  return jnp.sum(xent_BxT * weights_BxT), jnp.sum(weights_BxT)


def smoothed_xent(true_logp, sum_logp, vocab: int, label_smoothing: float):
  """-Σ_v q_v·log p_v minus the entropy of q, from log p of the target and Σ_v log p_v;
  q = 1-ε at the target and ε/(V-1) elsewhere."""
  if label_smoothing <= 0:
    return -true_logp
  conf, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  xent = -(conf * true_logp + low * (sum_logp - true_logp))
  return xent + (conf * jnp.log(conf) + (vocab - 1) * low * jnp.log(low + 1e-20))


def accuracy(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
             weights_BxT: jax.Array | None = None):
  """Token accuracy over non-pad targets: (correct_sum, weight_sum)."""
  if weights_BxT is None:
    weights_BxT = (targets_BxT != 0).astype(jnp.float32)
  correct = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT).astype(jnp.float32)
  return jnp.sum(correct * weights_BxT), jnp.sum(weights_BxT)
