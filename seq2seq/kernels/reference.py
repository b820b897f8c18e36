"""The plain-JAX answer to each kernel: the paper as written, and what the fast kernels must
equal (tests/test_kernels.py). Attention's reference is `attention.dot_product_attention`."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dense(x_MxK, weights, dtype):
  """x·W + b for each (W [K, N], b [N] or None) of `weights`: inputs in the compute `dtype`,
  float32 accumulation and output."""
  x_MxK = x_MxK.astype(dtype)
  outs = []
  for w_KxN, b_N in weights:
    y_MxN = jnp.dot(x_MxK, w_KxN.astype(dtype), preferred_element_type=jnp.float32)
    outs.append(y_MxN if b_N is None else y_MxN + b_N.astype(jnp.float32))
  return outs


def dropout_keep(rng, shape, rate: float):
  """True with probability 1 - rate: the elements dropout keeps."""
  return jax.random.bernoulli(rng, 1.0 - rate, shape)


def argmax(x_NxV):
  return jnp.argmax(x_NxV, axis=-1).astype(jnp.int32)


def top_k_logsumexp(x_NxV, k: int):
  """(the k largest entries of each row, best first, and their indices; each row's
  logsumexp [N]): what beam search needs of a step's logits."""
  values_Nxk, ids_Nxk = jax.lax.top_k(x_NxV, k)
  return values_Nxk, ids_Nxk, jax.nn.logsumexp(x_NxV, axis=-1)


def cache_store(x, dtype):
  """Keys or values as a KV cache of `dtype` stores them."""
  return x.astype(dtype)


def key_rows(x_BxHxKxD, rows_BxK):
  """Keys (or values) of each row as it reads them when key j of row b lies in row
  rows[b, j] of the cache: beam search's hypotheses read their ancestors' slots in place."""
  return x_BxHxKxD[rows_BxK[:, None, :], jnp.arange(x_BxHxKxD.shape[1])[None, :, None],
                   jnp.arange(x_BxHxKxD.shape[2])[None, None, :]]
