"""Masks and scaled dot-product attention: pure, jittable functions.

Shapes: B batch, Q query length, K key length, H heads, D head dim.
A mask is boolean, True = "may attend", broadcastable to [B, H, Q, K].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def _k(kv_layout: str) -> str:
  if kv_layout not in ("BKHD", "BHKD"):
    raise ValueError(f"kv_layout must be 'BKHD' or 'BHKD', got {kv_layout!r}")
  return "bkhd" if kv_layout == "BKHD" else "bhkd"


def attention_weights(q_BxQxHxD, k_BxKxHxD, mask=None, kv_layout: str = "BKHD") -> jax.Array:
  """softmax(q·kᵀ/√D) over keys, [B, H, Q, K] in float32; masked keys get weight 0 exactly
  and a query with no allowed key gets all-zero weights (never NaN).

  kv_layout="BHKD": keys (and values) are stored head-major, [B, H, K, D]: what the KV
  cache holds, so that a decode step reads it without transposing it."""
  depth = q_BxQxHxD.shape[-1]
  q_BxQxHxD = q_BxQxHxD * jnp.asarray(depth ** -0.5, q_BxQxHxD.dtype)
  s_BxHxQxK = jnp.einsum(f"bqhd,{_k(kv_layout)}->bhqk", q_BxQxHxD, k_BxKxHxD,
                         preferred_element_type=jnp.float32)
  if mask is not None:
    s_BxHxQxK = jnp.where(mask, s_BxHxQxK, jnp.finfo(jnp.float32).min)
  w_BxHxQxK = jax.nn.softmax(s_BxHxQxK, axis=-1)
  if mask is not None:
    w_BxHxQxK = jnp.where(mask, w_BxHxQxK, 0.0)
  return w_BxHxQxK


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
  w_BxHxQxK = attention_weights(query, key, mask, kv_layout)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, w_BxHxQxK.shape)
    w_BxHxQxK = jnp.where(keep, w_BxHxQxK / (1.0 - dropout_rate), 0.0)
  y_BxQxHxD = jnp.einsum(f"bhqk,{_k(kv_layout)}->bqhd", w_BxHxQxK.astype(value.dtype), value,
                         preferred_element_type=jnp.float32)
  return y_BxQxHxD.astype(query.dtype)
