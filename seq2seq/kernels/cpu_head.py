"""The output head, log-softmax, label-smoothed loss and accuracy of the train step as one op
with its gradient computed in the forward pass, where the logits are at hand: no [B·T, V]
array is kept for the backward pass. On CPU, cut into cache-sized slices of the target
length. Equal to `model.output_head` then `losses.cross_entropy` and `losses.accuracy`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seq2seq.kernels.cpu import dot_nt, dot_tn, row_major
from seq2seq.losses import smoothed_xent


def _head_piece(y_NxD, w, b_V, t_N, wt_N, label_smoothing, dtype, w_is_VxD, grads: bool):
  """(loss_sum, correct_sum, weight_sum) of N rows and, with `grads`, the gradients of
  loss_sum: (dy [N, D], dW [D, V] (always this way round), db [V] or None)."""
  y_c, w_c = y_NxD.astype(dtype), w.astype(dtype)
  logits_NxV = dot_nt(y_c, w_c) if w_is_VxD else jnp.dot(y_c, w_c,
                                                          preferred_element_type=jnp.float32)
  if b_V is not None:
    logits_NxV = logits_NxV + b_V.astype(jnp.float32)
  vocab = logits_NxV.shape[-1]
  m_N = jnp.max(logits_NxV, axis=-1)
  lse_N = m_N + jnp.log(jnp.sum(jnp.exp(logits_NxV - m_N[:, None]), axis=-1))
  true_N = jnp.take_along_axis(logits_NxV, t_N[:, None], axis=-1)[:, 0]
  sum_logp_N = (jnp.sum(logits_NxV, axis=-1) - vocab * lse_N) if label_smoothing > 0 else None
  xent_N = smoothed_xent(true_N - lse_N, sum_logp_N, vocab, label_smoothing)
  wt_N = wt_N.astype(jnp.float32)
  # The argmax is read off the max the softmax needs anyway (a tie with the target counts).
  sums = (jnp.sum(xent_N * wt_N), jnp.sum((true_N >= m_N) * wt_N), jnp.sum(wt_N))
  if not grads:
    return sums, None
  # d loss / d logits = (softmax - q) · weight, q = smoothed one-hot target.
  conf, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
  p_NxV = jnp.exp(logits_NxV - lse_N[:, None])
  onehot_NxV = jnp.arange(vocab)[None, :] == t_N[:, None]
  q_NxV = jnp.where(onehot_NxV, conf, low) if label_smoothing > 0 else onehot_NxV
  d_NxV = ((p_NxV - q_NxV) * wt_N[:, None]).astype(dtype)
  dy_NxD = jnp.dot(d_NxV, w_c, preferred_element_type=jnp.float32) if w_is_VxD else dot_nt(
      d_NxV, w_c)
  dw_DxV = dot_tn(y_c, d_NxV)
  db_V = None if b_V is None else jnp.sum(d_NxV.astype(jnp.float32), axis=0)
  return sums, (dy_NxD, dw_DxV, db_V)


def _head(y_BxTxD, w, b_V, t_BxT, wt_BxT, label_smoothing, dtype, w_is_VxD, chunks, grads):
  """`_head_piece` over all rows at once (chunks=1) or over `chunks` slices of the target
  length in turn (a scan), summing the sums and the weight gradients."""
  b, t, d = y_BxTxD.shape
  piece = lambda y, tt, wt: _head_piece(y.reshape(-1, d), w, b_V, tt.reshape(-1),
                                        wt.reshape(-1), label_smoothing, dtype, w_is_VxD, grads)
  if chunks == 1:
    sums, g = piece(y_BxTxD, t_BxT, wt_BxT)
    if g is None:
      return sums, None
    dy_NxD, dw_DxV, db_V = g
    dy_BxTxD = dy_NxD.reshape(b, t, d)
  else:
    split = lambda x: x.reshape(b, chunks, t // chunks, *x.shape[2:]).swapaxes(0, 1)

    def body(carry, xs):
      sums, g = piece(*xs)
      carry = jax.tree_util.tree_map(jnp.add, carry, (sums, None if g is None else g[1:]))
      return carry, None if g is None else g[0]

    vocab, zero = (w.shape[0] if w_is_VxD else w.shape[1]), jnp.zeros((), jnp.float32)
    init = ((zero,) * 3, (jnp.zeros((d, vocab), jnp.float32),
                          None if b_V is None else jnp.zeros((vocab,), jnp.float32))
            if grads else None)
    (sums, g_w), dy_CxNxD = jax.lax.scan(body, init, (split(y_BxTxD), split(t_BxT),
                                                      split(wt_BxT)))
    if not grads:
      return sums, None
    dw_DxV, db_V = g_w
    dy_BxTxD = dy_CxNxD.reshape(chunks, b, t // chunks, d).swapaxes(0, 1).reshape(b, t, d)
  return sums, (dy_BxTxD, row_major(dw_DxV).T if w_is_VxD else dw_DxV, db_V)


def head_chunks(batch: int, length: int, vocab: int) -> int:
  """Into how many slices of the target length the head + loss is cut: the [rows, V] float32
  logits of a slice should fit the last-level cache (<= 20 MB) while each slice keeps >= 512
  rows for its matmuls (`small`: 4 slices, 1.2-1.6x faster than one; `base` stays whole)."""
  rows = batch * length
  for c in range(1, length + 1):
    if length % c:
      continue
    if rows // c < 512:
      break
    if rows // c * vocab * 4 <= 20 * 2 ** 20:
      return c
  return 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _head_cross_entropy(y_BxTxD, w, b_V, targets_BxT, weights_BxT, label_smoothing, dtype,
                        w_is_VxD, chunks):
  return _head(y_BxTxD, w, b_V, targets_BxT, weights_BxT, label_smoothing, dtype, w_is_VxD,
               chunks, grads=False)[0]


def _head_fwd(y_BxTxD, w, b_V, targets_BxT, weights_BxT, label_smoothing, dtype, w_is_VxD,
              chunks):
  sums, (dy, dw, db) = _head(y_BxTxD, w, b_V, targets_BxT, weights_BxT, label_smoothing,
                             dtype, w_is_VxD, chunks, grads=True)
  return sums, (dy.astype(y_BxTxD.dtype), dw.astype(w.dtype),
                None if db is None else db.astype(b_V.dtype))


def _head_bwd(label_smoothing, dtype, w_is_VxD, chunks, res, g):
  scale = lambda x: None if x is None else (x * g[0]).astype(x.dtype)
  dy, dw, db = res
  return scale(dy), scale(dw), scale(db), None, None


_head_cross_entropy.defvjp(_head_fwd, _head_bwd)


@jax.named_scope("output_head_loss")
def head_loss(y_BxTxD, w, b_V, targets_BxT, weights_BxT, *, label_smoothing: float = 0.0,
              dtype: str = "float32", w_is_VxD: bool = True, chunks: int | None = None):
  """(loss_sum, correct_sum, weight_sum) of logits = y·Wᵀ + b (W [V, D], the tied embedding)
  or y·W + b (W [D, V]), in `chunks` slices (None: `head_chunks`). Only loss_sum has a
  gradient."""
  if chunks is None:
    chunks = head_chunks(*targets_BxT.shape, w.shape[0] if w_is_VxD else w.shape[1])
  return _head_cross_entropy(y_BxTxD, w, b_V, targets_BxT, weights_BxT, float(label_smoothing),
                             dtype, w_is_VxD, int(chunks))
