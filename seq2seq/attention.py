"""Masks and scaled dot-product attention (section 3.2.1): pure, jittable functions.

Shapes: B batch, H heads, Q query length, K key length, D head dim.
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


def attention_weights(q_BxHxQxD, k_BxHxKxD, mask=None) -> jax.Array:
  """softmax(QKᵀ/√d) over the keys, [B, H, Q, K] in float32. Masked keys get weight 0
  exactly; a query with no allowed key gets all-zero weights (never NaN)."""
  scores_BxHxQxK = jnp.einsum("bhqd,bhkd->bhqk", q_BxHxQxD, k_BxHxKxD,
                              preferred_element_type=jnp.float32) / jnp.sqrt(q_BxHxQxD.shape[-1])
  if mask is None:
    return jax.nn.softmax(scores_BxHxQxK, axis=-1)
  scores_BxHxQxK = jnp.where(mask, scores_BxHxQxK, jnp.finfo(jnp.float32).min)
  return jnp.where(mask, jax.nn.softmax(scores_BxHxQxK, axis=-1), 0.0)


def dot_product_attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, *,
                          dropout_rate: float = 0.0, dropout_rng=None) -> jax.Array:
  """Attention(Q, K, V) = softmax(QKᵀ/√d)·V for every head at once -> [B, H, Q, D] in q's
  dtype; scores and softmax in float32 whatever the input dtype. With a dropout rng,
  inverted dropout on the weights (not in the paper: model.attention_dropout_rate)."""
  w_BxHxQxK = attention_weights(q_BxHxQxD, k_BxHxKxD, mask)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, w_BxHxQxK.shape)
    w_BxHxQxK = jnp.where(keep, w_BxHxQxK / (1.0 - dropout_rate), 0.0)
  y_BxHxQxD = jnp.einsum("bhqk,bhkd->bhqd", w_BxHxQxK.astype(v_BxHxKxD.dtype), v_BxHxKxD,
                         preferred_element_type=jnp.float32)
  return y_BxHxQxD.astype(q_BxHxQxD.dtype)
