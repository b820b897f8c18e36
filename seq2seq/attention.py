"""Masks and scaled dot-product attention: pure, jittable functions.

Shapes: B batch, Q query length, K key length, H heads, D head dim.
A mask is boolean, True = "may attend", broadcastable to [B, H, Q, K].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint


def causal_mask(length: int) -> jax.Array:
  """[1, 1, L, L]: position q may attend to keys k <= q (no peeking at the future)."""
  i = jnp.arange(length)
  return (i[None, :] <= i[:, None])[None, None]


def padding_mask(q_valid_BxQ: jax.Array, k_valid_BxK: jax.Array) -> jax.Array:
  """[B, 1, Q, K]: both the query and the key are real tokens (not padding)."""
  return (q_valid_BxQ[:, None, :, None] & k_valid_BxK[:, None, None, :]).astype(bool)


def segment_mask(q_seg_BxQ: jax.Array, k_seg_BxK: jax.Array) -> jax.Array:
  """[B, 1, Q, K]: query and key belong to the same packed example (segment id > 0)."""
  same = q_seg_BxQ[:, None, :, None] == k_seg_BxK[:, None, None, :]
  real = (q_seg_BxQ[:, None, :, None] > 0) & (k_seg_BxK[:, None, None, :] > 0)
  return same & real


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
  """Logical AND of the masks that are not None (None if all are)."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = out & m
  return out


def row_major(a: jax.Array) -> jax.Array:
  """`a` stored row-major. XLA keeps a transpose as a strided view when it can, and its CPU
  backend runs a dot that reads a strided operand (or contracts the rows of its left one)
  in float32 through Eigen instead of its fast YNNPACK kernels: 2x slower in bf16
  (bench/bench_matmul_layouts.py). So the transposes that feed dots are made real copies
  here. Other backends choose their own layouts."""
  if jax.default_backend() != "cpu" or not isinstance(a, jax.core.Tracer):
    return a          # (eager arrays are already row-major)
  return with_layout_constraint(a, Layout(tuple(range(a.ndim))))


def _swap_1_2(x):
  """[B, L, H, D] <-> [B, H, L, D] as a row-major array (a free reshape when L or H is 1,
  as for the query of a decode step)."""
  b, n1, n2, d = x.shape
  return x.reshape(b, n2, n1, d) if 1 in (n1, n2) else row_major(x.swapaxes(1, 2))


def _head_major(x_BxLxHxD, kv_layout: str = "BKHD"):
  if kv_layout not in ("BKHD", "BHKD"):
    raise ValueError(f"kv_layout must be 'BKHD' or 'BHKD', got {kv_layout!r}")
  return _swap_1_2(x_BxLxHxD) if kv_layout == "BKHD" else row_major(x_BxLxHxD)


def _bdot(a, b, contract: tuple[int, int]):
  """Per (batch, head) matmul of [B, H, ., .] arrays contracting axis contract[0] of a with
  axis contract[1] of b, float32 accumulation."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0, 1), (0, 1))),
                             preferred_element_type=jnp.float32)


def _scaled_q(q_BxQxHxD):
  """Queries head-major [B, H, Q, D], scaled by 1/√D."""
  return _swap_1_2(q_BxQxHxD * jnp.asarray(q_BxQxHxD.shape[-1] ** -0.5, q_BxQxHxD.dtype))


def _softmax(s_BxHxQxK, mask):
  if mask is not None:
    s_BxHxQxK = jnp.where(mask, s_BxHxQxK, jnp.finfo(jnp.float32).min)
  w_BxHxQxK = jax.nn.softmax(s_BxHxQxK, axis=-1)
  return w_BxHxQxK if mask is None else jnp.where(mask, w_BxHxQxK, 0.0)


def attention_weights(q_BxQxHxD, k_BxKxHxD, mask=None, kv_layout: str = "BKHD") -> jax.Array:
  """softmax(q·kᵀ/√D) over keys, [B, H, Q, K] in float32; masked keys get weight 0 exactly
  and a query with no allowed key gets all-zero weights (never NaN).

  kv_layout="BHKD": keys (and values) are stored head-major, [B, H, K, D]: what the KV
  cache holds, so that a decode step reads it without transposing it."""
  return _softmax(_bdot(_scaled_q(q_BxQxHxD), _head_major(k_BxKxHxD, kv_layout), (3, 3)), mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, keep_BxHxQxK, rate: float):
  """softmax(q·kᵀ)·v on head-major q (already scaled), k, v -> [B, H, Q, D] float32, with
  inverted dropout on the weights where `keep` is given. Its backward pass is written out
  (below) so that each of its four matmuls reads row-major operands (see `row_major`)."""
  return _attend_fwd(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, keep_BxHxQxK, rate)[0]


def _dropped(w_BxHxQxK, keep_BxHxQxK, rate):
  if keep_BxHxQxK is None:
    return w_BxHxQxK
  return jnp.where(keep_BxHxQxK, w_BxHxQxK / (1.0 - rate), 0.0)


def _attend_fwd(q, k, v, mask, keep, rate):
  w_BxHxQxK = _softmax(_bdot(q, k, (3, 3)), mask)
  y_BxHxQxD = _bdot(_dropped(w_BxHxQxK, keep, rate).astype(v.dtype), v, (3, 2))
  return y_BxHxQxD, (q, k, v, mask, keep, w_BxHxQxK)


def _attend_bwd(rate, res, dy_BxHxQxD):
  q, k, v, mask, keep, w_BxHxQxK = res
  dy = row_major(dy_BxHxQxD.astype(v.dtype))
  wd_BxHxKxQ = row_major(_dropped(w_BxHxQxK, keep, rate).astype(v.dtype).swapaxes(2, 3))
  dv_BxHxKxD = _bdot(wd_BxHxKxQ, dy, (3, 2))
  dw_BxHxQxK = _dropped(_bdot(dy, v, (3, 3)), keep, rate)
  # softmax': ds = w ⊙ (dw - Σ_k dw·w); masked keys have w = 0, so they get no gradient.
  ds_BxHxQxK = w_BxHxQxK * (dw_BxHxQxK - jnp.sum(dw_BxHxQxK * w_BxHxQxK, -1, keepdims=True))
  ds = ds_BxHxQxK.astype(q.dtype)
  dq_BxHxQxD = _bdot(ds, k, (3, 2))
  dk_BxHxKxD = _bdot(row_major(ds.swapaxes(2, 3)), q, (3, 2))
  return (dq_BxHxQxD.astype(q.dtype), dk_BxHxKxD.astype(k.dtype), dv_BxHxKxD.astype(v.dtype),
          None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def dot_product_attention(query, key, value, mask=None, *, dropout_rate: float = 0.0,
                          dropout_rng: jax.Array | None = None,
                          kv_layout: str = "BKHD") -> jax.Array:
  """Scaled dot-product attention, softmax(QKᵀ/√d)V, per head.

  query [B, Q, H, D], key/value [B, K, H, D] (or [B, H, K, D] with kv_layout="BHKD")
  -> [B, Q, H, D] in query's dtype. Scores and softmax are float32 whatever the input dtype.

  Shared keys: query may have r·B rows, rows b·r .. b·r + r - 1 all reading key/value row b
  (the beams of one source in beam search, which then keep one copy of the encoder's keys
  and values instead of r). The r rows' queries are attended as one row of r·Q queries.
  """
  n, b = query.shape[0], key.shape[0]
  if n != b:
    if n % b:
      raise ValueError(f"query rows ({n}) must be a multiple of key/value rows ({b})")
    r, q_len = n // b, query.shape[1]
    if mask is not None and mask.shape[0] == n:   # [r·B, M, Q|1, K] -> [B, M, r·Q, K]
      m = jnp.broadcast_to(mask, (n, mask.shape[1], q_len, mask.shape[3]))
      mask = m.reshape(b, r, *m.shape[1:]).swapaxes(1, 2).reshape(b, m.shape[1], r * q_len, -1)
    y = dot_product_attention(query.reshape(b, r * q_len, *query.shape[2:]), key, value, mask,
                              dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                              kv_layout=kv_layout)
    return y.reshape(query.shape)
  k_BxHxKxD, v_BxHxKxD = _head_major(key, kv_layout), _head_major(value, kv_layout)
  keep = None
  if dropout_rate > 0.0 and dropout_rng is not None:
    (_, q_len, heads, _), k_len = query.shape, k_BxHxKxD.shape[2]
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, (b, heads, q_len, k_len))
  y_BxHxQxD = _attend(_scaled_q(query), k_BxHxKxD, v_BxHxKxD, mask, keep, float(dropout_rate))
  return _swap_1_2(y_BxHxQxD.astype(query.dtype))
