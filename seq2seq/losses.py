"""Teacher forcing and the training objective."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seq2seq.attention import row_major
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
  xent_N = _smoothed_xent(true_N - lse_N, sum_logp_N, vocab, label_smoothing)
  wt_N = wt_N.astype(jnp.float32)
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
  """Into how many slices of the target length the train step's head + loss is cut.

  On CPU the [rows, V] float32 logits of a slice should fit the last-level cache (≤ 20 MB)
  while each slice keeps ≥ 512 rows for its matmuls: `small` (2,048 rows, V = 8,000) runs
  in 4 slices, 1.6x (bf16) and 1.2x (f32) faster than in one piece
  (`bench/bench_head_chunks.py`);
  `base` (1,024 rows, V = 32,000) cannot, and stays whole. Elsewhere: 1."""
  if jax.default_backend() != "cpu":
    return 1
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
def head_cross_entropy(y_BxTxD, w, b_V, targets_BxT, weights_BxT, label_smoothing: float = 0.0,
                       dtype: str = "float32", w_is_VxD: bool = True, chunks: int = 1):
  """Output projection + label-smoothed cross-entropy + accuracy, fused.

  Same values as `cross_entropy(logits, ...)` and `accuracy(...)` on
  logits = y·Wᵀ + b (W [V, D], the tied embedding) or y·W + b (W [D, V]), returned as
  (loss_sum, correct_sum, weight_sum). Its gradient, (softmax - q)·weight fed through the
  head's two matmuls, is computed in the forward pass, where the logits are at hand: no
  [B·T, V] array is kept for the backward pass, which only scales the stored gradients by
  the incoming one. The argmax is read off the max the softmax needs anyway (a tie with the
  target counts as correct). `chunks` > 1 runs it over that many slices of the target
  length in turn (`head_chunks`), the batch axis whole, so a data-parallel batch stays
  split across devices the same way.
  """
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


head_cross_entropy.defvjp(_head_fwd, _head_bwd)
