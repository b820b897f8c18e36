"""Masks and scaled dot-product attention against an independent NumPy computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seq2seq import attention as attn


def numpy_attention(q, k, v, mask):
  """Naive per-(batch, head, query) loop: softmax over allowed keys only."""
  B, Q, H, D = q.shape
  K = k.shape[1]
  out = np.zeros((B, Q, H, D), np.float64)
  mask = np.broadcast_to(mask, (B, H, Q, K))
  for b in range(B):
    for h in range(H):
      for i in range(Q):
        allowed = [j for j in range(K) if mask[b, h, i, j]]
        if not allowed:
          continue
        s = np.array([q[b, i, h] @ k[b, j, h] / np.sqrt(D) for j in allowed])
        w = np.exp(s - s.max())
        w /= w.sum()
        out[b, i, h] = sum(wj * v[b, j, h] for wj, j in zip(w, allowed))
  return out


def test_attention_matches_numpy_loop():
  rng = np.random.default_rng(0)
  B, Q, K, H, D = 2, 5, 7, 3, 4
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(B, Q, H, D), (B, K, H, D), (B, K, H, D)])
  mask = rng.random((B, 1, Q, K)) > 0.3
  mask[0, 0, 2, :] = False  # a query with no allowed key
  got = np.asarray(attn.dot_product_attention(q, k, v, mask))
  want = numpy_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(got[0, 2], 0.0)


def test_unmasked_attention_matches_numpy():
  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(1, 4, 2, 8)).astype(np.float32) for _ in range(3))
  got = np.asarray(attn.dot_product_attention(q, k, v))
  want = numpy_attention(q, k, v, np.ones((1, 1, 4, 4), bool))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_masked_keys_get_exactly_zero_weight():
  rng = np.random.default_rng(2)
  q, k = (rng.normal(size=(1, 3, 1, 4)).astype(np.float32) for _ in range(2))
  k[0, 2] *= 1e4  # a huge score that must still be ignored when masked
  mask = np.array([True, True, False])[None, None, None, :]
  w = np.asarray(attn.attention_weights(q, k, mask))
  assert (w[..., 2] == 0.0).all()
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  # Changing a masked value leaves the output bit-identical.
  v = rng.normal(size=(1, 3, 1, 4)).astype(np.float32)
  v2 = v.copy()
  v2[0, 2] = 1e6
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
  q, k, v = (rng.normal(size=(2, 6, 2, 8)).astype(np.float32) for _ in range(3))
  mask = attn.causal_mask(6)
  eager = attn.dot_product_attention(q, k, v, mask)
  jitted = jax.jit(attn.dot_product_attention)(q, k, v, mask)
  np.testing.assert_allclose(eager, jitted, atol=1e-6)
  bf = attn.dot_product_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), mask)
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf, np.float32), eager, atol=5e-2)


def test_attention_dropout_is_inverted_and_keyed():
  rng = np.random.default_rng(4)
  q, k, v = (rng.normal(size=(1, 8, 1, 4)).astype(np.float32) for _ in range(3))
  a = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  b = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  c = attn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_head_major_kv_layout_is_the_same_attention():
  rng = np.random.default_rng(5)
  q = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
  k, v = (rng.normal(size=(2, 6, 2, 4)).astype(np.float32) for _ in range(2))
  mask = rng.random((2, 1, 3, 6)) > 0.3
  hm = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  np.testing.assert_allclose(attn.dot_product_attention(q, hm(k), hm(v), mask, kv_layout="BHKD"),
                             attn.dot_product_attention(q, k, v, mask), atol=1e-6)
  with pytest.raises(ValueError, match="kv_layout"):
    attn.attention_weights(q, k, mask, kv_layout="BKDH")


@pytest.mark.parametrize("mask_rows", ["per_query_row", "per_key_row"])
def test_query_rows_sharing_keys_match_the_numpy_loop_on_repeated_keys(mask_rows):
  """Beam search's cross-attention: r query rows per key/value row (rows b·r .. b·r + r - 1
  read row b) must equal attention against keys/values repeated r times."""
  rng = np.random.default_rng(6)
  B, r, Q, K, H, D = 2, 3, 2, 5, 2, 4
  q = rng.normal(size=(B * r, Q, H, D)).astype(np.float32)
  k, v = (rng.normal(size=(B, K, H, D)).astype(np.float32) for _ in range(2))
  if mask_rows == "per_query_row":
    mask = rng.random((B * r, 1, Q, K)) > 0.3
    full_mask = mask
  else:
    mask = rng.random((B, 1, 1, K)) > 0.3
    full_mask = np.repeat(mask, r, axis=0)
  hm = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  got = np.asarray(attn.dot_product_attention(q, hm(k), hm(v), mask, kv_layout="BHKD"))
  want = numpy_attention(q, np.repeat(k, r, 0), np.repeat(v, r, 0), full_mask)
  np.testing.assert_allclose(got, want, atol=1e-5)
  with pytest.raises(ValueError, match="multiple"):
    attn.dot_product_attention(q[:5], k, v)


def reference_attention(q, k, v, mask, keep=None, rate=0.0):
  """Plain einsums, jax.nn.softmax and autodiff: what the hand-written backward must match."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  w = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1), 0.0)
  if keep is not None:
    w = jnp.where(keep, w / (1 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("kv_layout", ["BKHD", "BHKD"])
def test_attention_gradients_match_autodiff_of_the_plain_formula(kv_layout, dropout):
  """Gradients w.r.t. q, k and v (jitted) == autodiff of the einsum formula, with a padded
  key, a causal mask, a query row that may attend to nothing, and attention dropout (the
  same keep mask: same key, same [B, H, Q, K] draw)."""
  rng = np.random.default_rng(7)
  B, Q, K, H, D = 2, 5, 5, 3, 4
  q, k, v, g = (jnp.asarray(rng.normal(size=s), jnp.float32)
                for s in [(B, Q, H, D), (B, K, H, D), (B, K, H, D), (B, Q, H, D)])
  mask = np.broadcast_to(np.asarray(attn.causal_mask(K)), (B, 1, Q, K)).copy()
  mask[0, :, :, 3] = False          # a padded key
  mask[1, :, 2, :] = False          # a query with no allowed key
  rate, key = (0.3, jax.random.key(3)) if dropout else (0.0, None)
  keep = jax.random.bernoulli(key, 1 - rate, (B, H, Q, K)) if dropout else None
  hm = (lambda x: jnp.transpose(x, (0, 2, 1, 3))) if kv_layout == "BHKD" else (lambda x: x)

  def ours(q, k, v):
    return attn.dot_product_attention(q, hm(k), hm(v), mask, dropout_rate=rate,
                                      dropout_rng=key, kv_layout=kv_layout)

  y, vjp = jax.vjp(jax.jit(ours), q, k, v)
  y_ref, vjp_ref = jax.vjp(lambda q, k, v: reference_attention(q, k, v, mask, keep, rate),
                           q, k, v)
  np.testing.assert_allclose(y, y_ref, atol=1e-5)
  for name, a, b in zip("qkv", jax.jit(vjp)(g), vjp_ref(g)):
    np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")
  assert float(jnp.abs(vjp_ref(g)[1]).max()) > 1e-2     # the gradients are not all ~0
