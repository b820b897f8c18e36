"""Masks and scaled dot-product attention against an independent NumPy computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seq2seq import attention as attn


def numpy_attention(q, k, v, mask):
  """Naive per-(batch, head, query) loop: softmax over allowed keys only."""
  B, H, Q, D = q.shape
  K = k.shape[2]
  out = np.zeros((B, H, Q, D), np.float64)
  mask = np.broadcast_to(mask, (B, H, Q, K))
  for b in range(B):
    for h in range(H):
      for i in range(Q):
        allowed = [j for j in range(K) if mask[b, h, i, j]]
        if not allowed:
          continue
        s = np.array([q[b, h, i] @ k[b, h, j] / np.sqrt(D) for j in allowed])
        w = np.exp(s - s.max())
        w /= w.sum()
        out[b, h, i] = sum(wj * v[b, h, j] for wj, j in zip(w, allowed))
  return out


def test_attention_matches_numpy_loop():
  rng = np.random.default_rng(0)
  B, Q, K, H, D = 2, 5, 7, 3, 4
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, H, Q, D), (B, H, K, D), (B, H, K, D)])
  mask = rng.random((B, 1, Q, K)) > 0.3
  mask[0, 0, 2, :] = False  # a query with no allowed key
  got = np.asarray(attn.dot_product_attention(q, k, v, mask))
  want = numpy_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(got[0, :, 2], 0.0)


def test_unmasked_attention_matches_numpy():
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(1, 2, 4, 8)).astype(np.float32) for _ in range(3))
  got = np.asarray(attn.dot_product_attention(q, k, v))
  want = numpy_attention(q, k, v, np.ones((1, 1, 4, 4), bool))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_masked_keys_get_exactly_zero_weight():
  rng = np.random.default_rng(2)
  q, k = (rng.normal(size=(1, 1, 3, 4)).astype(np.float32) for _ in range(2))
  k[0, 0, 2] *= 1e4  # a huge score that must still be ignored when masked
  mask = np.array([True, True, False])[None, None, None, :]
  w = np.asarray(attn.attention_weights(q, k, mask))
  assert (w[..., 2] == 0.0).all()
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  # Changing a masked value leaves the output bit-identical.
  v = rng.normal(size=(1, 1, 3, 4)).astype(np.float32)
  v2 = v.copy()
  v2[0, 0, 2] = 1e6
  np.testing.assert_array_equal(attn.dot_product_attention(q, k, v, mask),
                                attn.dot_product_attention(q, k, v2, mask))


def test_causal_mask():
  m = np.asarray(attn.causal_mask(4))[0, 0]
  np.testing.assert_array_equal(m, np.tril(np.ones((4, 4), bool)))


def test_padding_and_segment_masks():
  valid = jnp.array([[1, 1, 0]], bool)
  m = np.asarray(attn.padding_mask(valid, valid))[0, 0]
  np.testing.assert_array_equal(m, [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
  seg = jnp.array([[1, 1, 2, 0]])
  s = np.asarray(attn.segment_mask(seg, seg))[0, 0]
  np.testing.assert_array_equal(s, [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
  both = np.asarray(attn.combine_masks(attn.causal_mask(4), attn.segment_mask(seg, seg)))[0, 0]
  np.testing.assert_array_equal(both, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
  assert attn.combine_masks(None, None) is None


def test_attention_jit_equals_eager_and_bf16_is_close():
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(2, 2, 6, 8)).astype(np.float32) for _ in range(3))
  mask = attn.causal_mask(6)
  eager = attn.dot_product_attention(q, k, v, mask)
  jitted = jax.jit(attn.dot_product_attention)(q, k, v, mask)
  np.testing.assert_allclose(eager, jitted, atol=1e-6)
  bf = attn.dot_product_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), mask)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), eager, atol=5e-2)


def test_attention_dropout_is_inverted_and_keyed():
  rng = np.random.default_rng(4)
  q, k, v = (rng.normal(size=(1, 1, 8, 4)).astype(np.float32) for _ in range(3))
  a = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  b = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  c = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
