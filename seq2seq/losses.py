"""Teacher forcing and the training objective."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seq2seq.layers import dot_nt, dot_tn


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
  xent_BxT = _smoothed_xent(true_logp_BxT, sum_logp_BxT, vocab, label_smoothing)
  return jnp.sum(xent_BxT * weights_BxT), jnp.sum(weights_BxT)


def _smoothed_xent(true_logp, sum_logp, vocab: int, label_smoothing: float):
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


# --- the fast path: output head + loss + accuracy in one custom-gradient op ---------------

def _head_logits(y_NxD, w, b_V, dtype, w_is_VxD):
  spec = "nd,vd->nv" if w_is_VxD else "nd,dv->nv"
  logits_NxV = jnp.einsum(spec, y_NxD.astype(dtype), w.astype(dtype),
                          preferred_element_type=jnp.float32)
  return logits_NxV if b_V is None else logits_NxV + b_V.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def head_cross_entropy(y_NxD, w, b_V, targets_N, weights_N, label_smoothing: float = 0.0,
                       dtype: str = "float32", w_is_VxD: bool = True):
  """Output projection + label-smoothed cross-entropy + accuracy, fused.

  Same values as `cross_entropy(logits, ...)` and `accuracy(...)` on
  logits = y·Wᵀ + b (W [V, D], the tied embedding) or y·W + b (W [D, V]), returned as
  (loss_sum, correct_sum, weight_sum). Its hand-written gradient is (softmax - q)·weight,
  fed straight into the two bf16/f32 matmuls of the head: no [N, V] log-softmax,
  one-hot, broadcast or transposed copy is materialised for autodiff, and the argmax is
  read off the max the softmax needs anyway (a tie with the target counts as correct).
  """
  return _head_fwd(y_NxD, w, b_V, targets_N, weights_N, label_smoothing, dtype, w_is_VxD)[0]


def _head_fwd(y_NxD, w, b_V, targets_N, weights_N, label_smoothing, dtype, w_is_VxD):
  logits_NxV = _head_logits(y_NxD, w, b_V, dtype, w_is_VxD)
  vocab = logits_NxV.shape[-1]
  m_N = jnp.max(logits_NxV, axis=-1)
  lse_N = m_N + jnp.log(jnp.sum(jnp.exp(logits_NxV - m_N[:, None]), axis=-1))
  true_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
  sum_logp_N = (jnp.sum(logits_NxV, axis=-1) - vocab * lse_N) if label_smoothing > 0 else None
  xent_N = _smoothed_xent(true_N - lse_N, sum_logp_N, vocab, label_smoothing)
  weights_N = weights_N.astype(jnp.float32)
  out = (jnp.sum(xent_N * weights_N), jnp.sum((true_N >= m_N) * weights_N), jnp.sum(weights_N))
  return out, (y_NxD, w, b_V, targets_N, weights_N, logits_NxV, lse_N)


def _head_bwd(label_smoothing, dtype, w_is_VxD, res, g):
  y_NxD, w, b_V, targets_N, weights_N, logits_NxV, lse_N = res
  vocab = logits_NxV.shape[-1]
  conf, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  # d loss / d logits = (softmax - q) · weight, q = smoothed one-hot target.
  p_NxV = jnp.exp(logits_NxV - lse_N[:, None])
  onehot_NxV = jnp.arange(vocab)[None, :] == targets_N[:, None]
  q_NxV = jnp.where(onehot_NxV, conf, low) if label_smoothing > 0 else onehot_NxV
  d_NxV = ((p_NxV - q_NxV) * (g[0] * weights_N)[:, None]).astype(dtype)
  w_c, y_c = w.astype(dtype), y_NxD.astype(dtype)
  if w_is_VxD:
    dy = jnp.dot(d_NxV, w_c, preferred_element_type=jnp.float32)
    dw = dot_tn(d_NxV, y_c)
  else:
    dy = dot_nt(d_NxV, w_c)
    dw = dot_tn(y_c, d_NxV)
  db = None if b_V is None else jnp.sum(d_NxV.astype(jnp.float32), axis=0).astype(b_V.dtype)
  return dy.astype(y_NxD.dtype), dw.astype(w.dtype), db, None, None


head_cross_entropy.defvjp(_head_fwd, _head_bwd)
