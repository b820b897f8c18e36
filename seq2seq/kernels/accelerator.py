"""Attention on GPU/TPU: `jax.nn.dot_product_attention`, which picks cuDNN's fused flash
attention where the GPU and shapes allow it and XLA's own implementation elsewhere."""
from __future__ import annotations

import jax

from seq2seq.attention import dot_product_attention


def attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, *, dropout_rate: float = 0.0,
              dropout_rng=None):
  """`attention.dot_product_attention` through jax.nn (no dropout there: with attention
  dropout in training, the reference answers). A query with no allowed key gets the mean
  of the values here, not zeros: only padding queries are such, and nothing reads them."""
  if dropout_rate > 0.0 and dropout_rng is not None:
    return dot_product_attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask,
                                 dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  to_BxLxHxD = lambda x: x.swapaxes(1, 2)
  y_BxQxHxD = jax.nn.dot_product_attention(
      to_BxLxHxD(q_BxHxQxD), to_BxLxHxD(k_BxHxKxD).astype(q_BxHxQxD.dtype),
      to_BxLxHxD(v_BxHxKxD).astype(q_BxHxQxD.dtype), mask=mask)
  return y_BxQxHxD.swapaxes(1, 2)
