"""The fast layer computes what the reference path computes.

First each fast kernel against its reference (or NumPy), then the whole model: every
kernels table gives the same logits, train-step loss and gradients, and decoded tokens as
the reference, in float32 and bfloat16, post-LN and pre-LN, padded and packed rows. A
perturbed kernel is caught by the same comparison.

Tolerances (max |difference|; gradients relative to the reference's largest gradient):
float32: logits 2e-5, loss 1e-6 relative, gradients 1e-5, the same greedy and beam tokens;
bfloat16: logits 0.02, loss 1e-3 relative, gradients 0.03 (the cpu table's backward
matmuls round the incoming gradient to bf16, autodiff's keep it in f32: ~1% apart), and
no token check (a near-tie between two tokens may fall either way). Measured differences
are 10-100x below these on CPUs. A bf16 quantity outside its tolerance still passes where
it is no further from the float32 model than twice the bf16 reference is (FlashAttention's
criterion): cuDNN's fused attention rounds in another order than the reference, and the
bf16 reference is itself 0.03-0.04 from the f32 logits in this model (the GPU gave 0.027-
0.041 between the two bf16 paths).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import attention as attn
from seq2seq import decoding, kernels, search, train_lib
from seq2seq.config import Config, TrainConfig
from seq2seq.kernels import cpu, cpu_head, reference
from seq2seq.layout import stack_layers
from seq2seq.losses import accuracy, cross_entropy
from seq2seq.model import Transformer

FAST = ("cpu", "accelerator")


# --- matmuls ----------------------------------------------------------------------------------

def test_fused_dense_equals_each_kernel_alone_values_and_gradients():
  """cpu.dense (one matmul over concatenated kernels) == reference.dense, with and without
  biases; the outputs' gradients are joined by one concatenate, not zero-padded and summed."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  weights = [(jnp.asarray(rng.normal(size=(4, n)), jnp.float32),
              None if n == 5 else jnp.asarray(rng.normal(size=(n,)), jnp.float32))
             for n in (6, 5, 7)]
  for a, b in zip(cpu.dense(x, weights, "float32"), reference.dense(x, weights, "float32")):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

  def loss(dense, x, weights):
    return sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(dense(x, weights, "float32")))
  g_fast = jax.grad(lambda x, w: loss(cpu.dense, x, w), (0, 1))(x, weights)
  g_ref = jax.grad(lambda x, w: loss(reference.dense, x, w), (0, 1))(x, weights)
  jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5),
                         g_fast, g_ref)
  text = str(jax.make_jaxpr(jax.grad(lambda x, w: loss(cpu.dense, x, w), 1))(x, weights))
  assert "concatenate[" in text and " pad[" not in text, text


def test_mixed_precision_matmul_gradients_use_compute_dtype():
  """cpu.matmul: f32 == plain autodiff; bf16 == the same math on bf16-rounded inputs and
  bf16-rounded incoming gradient, accumulated in f32."""
  ks = jax.random.split(jax.random.key(0), 3)
  x, w, g = (jax.random.normal(k, s) for k, s in zip(ks, [(33, 20), (20, 17), (33, 17)]))
  y, vjp = jax.vjp(lambda x, w: cpu.matmul(x, w, "float32"), x, w)
  y_ref, vjp_ref = jax.vjp(lambda x, w: x @ w, x, w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(vjp(g), vjp_ref(g)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  r = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  yb, vjpb = jax.vjp(lambda x, w: cpu.matmul(x, w, "bfloat16"), x, w)
  dx, dw = vjpb(g)
  assert yb.dtype == dx.dtype == dw.dtype == jnp.float32
  np.testing.assert_allclose(yb, r(x) @ r(w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, r(g) @ r(w).T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, r(x).T @ r(g), rtol=1e-5, atol=1e-5)
  # ... and that differs from the f32 gradient, so the test can tell the modes apart.
  assert float(jnp.abs(dx - vjp(g)[0]).max()) > 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(64, 24, 40), (64, 40, 24)])
def test_jitted_matmul_gradients_match_numpy_for_either_transpose(dtype, m, k, n):
  """The weight gradient transposes whichever of x and g is smaller into a row-major copy
  (k < n: x, k > n: g); both ways, jitted (where the layout constraint acts), give xᵀ·g,
  and g·Wᵀ for the input gradient."""
  ks = jax.random.split(jax.random.key(1), 3)
  x, w, g = (jax.random.normal(kk, s) for kk, s in zip(ks, [(m, k), (k, n), (m, n)]))
  r = lambda a: np.asarray(a.astype(dtype).astype(jnp.float32), np.float64)
  dx, dw = jax.jit(lambda x, w, g: jax.vjp(lambda x, w: cpu.matmul(x, w, dtype), x, w)[1](g))(
      x, w, g)
  np.testing.assert_allclose(dx, r(g) @ r(w).T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, r(x).T @ r(g), rtol=1e-5, atol=1e-4)
  a, b = x.astype(dtype), g.astype(dtype)
  np.testing.assert_allclose(jax.jit(cpu.dot_tn)(a, b), r(x).T @ r(g), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(jax.jit(cpu.dot_tn)(b, a), r(g).T @ r(x), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(jax.jit(cpu.dot_nt)(b, w.astype(dtype)), r(g) @ r(w).T,
                             rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k,n,few", [(8, 512, 640, True), (33, 512, 640, False),
                                         (8, 256, 640, False)])
def test_few_row_bf16_matmul_uses_a_transposed_copy_and_matches_numpy(m, k, n, few):
  """A decode step's few bf16 rows times a matrix with sides >= 512 run as x·(Wᵀ)ᵀ from a
  transposed copy of W; other shapes run as x·W. Both forms, and their gradients, give the
  numbers NumPy gives for the bf16-rounded inputs."""
  ks = jax.random.split(jax.random.key(2), 3)
  x, w, g = (jax.random.normal(kk, s) for kk, s in zip(ks, [(m, k), (k, n), (m, n)]))
  jaxpr = str(jax.make_jaxpr(lambda x, w: cpu.matmul(x, w, "bfloat16"))(x, w))
  assert ("transpose" in jaxpr) == few and "dot_general" in jaxpr
  r = lambda a: np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  y, (dx, dw) = jax.jit(lambda x, w, g: (
      cpu.matmul(x, w, "bfloat16"),
      jax.vjp(lambda x, w: cpu.matmul(x, w, "bfloat16"), x, w)[1](g)))(x, w, g)
  np.testing.assert_allclose(y, r(x) @ r(w), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dx, r(g) @ r(w).T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, r(x).T @ r(g), rtol=1e-5, atol=1e-4)


# --- dropout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_fn", [reference.dropout_keep, cpu.dropout_keep])
def test_dropout_masks_have_the_rate_independence_and_keys(keep_fn):
  shape = (64, 128, 32)
  n = np.prod(shape)
  for rate in (0.1, 0.5):
    m = np.asarray(keep_fn(jax.random.key(0), shape, rate))
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(m.mean() - (1 - rate)) < 5 * sigma
    f = m.reshape(-1).astype(np.float64)
    # neighbours (along every axis) are independent: P(keep, keep) = p^2
    for a, b in [(f[:-1], f[1:]), (f[:-32], f[32:]), (f[:-4096], f[4096:])]:
      assert abs((a * b).mean() - (1 - rate) ** 2) < 6 * np.sqrt((1 - rate) ** 2 / n)
  m0 = np.asarray(keep_fn(jax.random.key(0), shape, 0.5), np.float64)
  m1 = np.asarray(keep_fn(jax.random.key(1), shape, 0.5), np.float64)
  assert abs(np.corrcoef(m0.ravel(), m1.ravel())[0, 1]) < 5 / np.sqrt(n)
  np.testing.assert_array_equal(m0, keep_fn(jax.random.key(0), shape, 0.5))


@pytest.mark.parametrize("table", ["reference", "cpu"])
def test_dropout_is_inverted_and_off_in_evaluation(table):
  from seq2seq.layers import Dropout
  shape = (64, 128, 32)
  x = jnp.ones(shape)
  y = Dropout(0.1, table).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
  np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1 / 0.9], rtol=1e-6)
  assert abs(float(y.mean()) - 1.0) < 5 * np.sqrt(0.1 / 0.9 / np.prod(shape))
  np.testing.assert_array_equal(Dropout(0.1, table).apply({}, x, deterministic=True), x)


# --- attention --------------------------------------------------------------------------------

def _attention_inputs(B=2, Q=5, K=5, H=3, D=4, seed=7):
  rng = np.random.default_rng(seed)
  q, k, v, g = (jnp.asarray(rng.normal(size=s), jnp.float32)
                for s in [(B, H, Q, D), (B, H, K, D), (B, H, K, D), (B, H, Q, D)])
  mask = np.broadcast_to(np.asarray(attn.causal_mask(K)), (B, 1, Q, K)).copy()
  mask[0, :, :, 3] = False          # a padded key
  mask[1, :, 2, :] = False          # a query with no allowed key
  return q, k, v, g, mask


@pytest.mark.parametrize("dropout", [False, True])
def test_cpu_attention_values_and_gradients_equal_autodiff_of_the_reference(dropout):
  """cpu.attention's hand-written backward == autodiff of attention.dot_product_attention
  (jitted), with a padded key, a causal mask, a query row that may attend to nothing, and
  attention dropout (the same keep mask: same key, same draw)."""
  q, k, v, g, mask = _attention_inputs()
  kw = dict(dropout_rate=0.3, dropout_rng=jax.random.key(3)) if dropout else {}
  y, vjp = jax.vjp(jax.jit(lambda q, k, v: cpu.attention(q, k, v, mask, **kw)), q, k, v)
  y_ref, vjp_ref = jax.vjp(lambda q, k, v: attn.dot_product_attention(q, k, v, mask, **kw),
                           q, k, v)
  np.testing.assert_allclose(y, y_ref, atol=1e-5)
  for name, a, b in zip("qkv", jax.jit(vjp)(g), vjp_ref(g)):
    np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")
  assert float(jnp.abs(vjp_ref(g)[1]).max()) > 1e-2     # the gradients are not all ~0


def test_accelerator_attention_equals_the_reference_on_queries_that_attend():
  """jax.nn.dot_product_attention == the reference (values and gradients) wherever a query
  has an allowed key; without dropout it answers, with dropout the reference does."""
  q, k, v, g, mask = _attention_inputs()
  live = np.asarray(mask).any(-1, keepdims=True).transpose(0, 1, 2, 3)   # [B, 1, Q, 1]
  g = g * live
  y, vjp = jax.vjp(lambda q, k, v: kernels.accelerator.attention(q, k, v, mask), q, k, v)
  y_ref, vjp_ref = jax.vjp(lambda q, k, v: attn.dot_product_attention(q, k, v, mask), q, k, v)
  np.testing.assert_allclose(np.asarray(y) * live, np.asarray(y_ref) * live, atol=1e-5)
  for a, b in zip(vjp(g), vjp_ref(g)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  kw = dict(dropout_rate=0.3, dropout_rng=jax.random.key(3))
  np.testing.assert_array_equal(kernels.accelerator.attention(q, k, v, mask, **kw),
                                attn.dot_product_attention(q, k, v, mask, **kw))


def _bf16_attention_inputs(B=2, Q=8, K=16, H=2, D=16, seed=8):
  """Even lengths and a head size cuDNN takes: a causal-and-padding mask [B, 1, Q, K]."""
  rng = np.random.default_rng(seed)
  q, k, v, g = (jnp.asarray(rng.normal(size=s), jnp.bfloat16)
                for s in [(B, H, Q, D), (B, H, K, D), (B, H, K, D), (B, H, Q, D)])
  mask = np.broadcast_to(np.arange(K)[None, :] <= np.arange(Q)[:, None] + (K - Q),
                         (B, 1, Q, K)).copy()
  mask[1, :, :, K - 5:] = False     # row 1's last 5 keys are padding
  return q, k, v, g, mask


def test_accelerator_attention_in_bf16_equals_the_reference_computed_in_f32():
  """bf16 inputs (cuDNN's, where a GPU has it and its probe passes; XLA's elsewhere):
  values and gradients within bf16 rounding of the reference on the same bf16 numbers in
  float32; a GPU records why it chose what it chose."""
  q, k, v, g, mask = _bf16_attention_inputs()
  f32 = lambda x: x.astype(jnp.float32)
  y, vjp = jax.vjp(jax.jit(lambda q, k, v: kernels.accelerator.attention(q, k, v, mask)),
                   q, k, v)
  y_ref, vjp_ref = jax.vjp(lambda q, k, v: attn.dot_product_attention(q, k, v, mask),
                           f32(q), f32(k), f32(v))
  rel = lambda a, b: float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b))
  assert y.dtype == jnp.bfloat16 and rel(y, y_ref) < 1e-2
  for name, a, b in zip("qkv", jax.jit(vjp)(g), vjp_ref(f32(g))):
    assert rel(a, b) < 2e-2, name
  y_plain = jax.jit(lambda q, k, v: kernels.accelerator.attention(q, k, v, mask))(q, k, v)
  assert rel(y_plain, y_ref) < 1e-2
  if jax.default_backend() == "gpu":   # the choice was made, not skipped
    assert kernels.accelerator.verdicts(), "no cuDNN verdict recorded on a GPU"


def _fake_cudnn(monkeypatch, fake):
  """accelerator's cuDNN replaced by `fake(q, k, v, mask)` (XLA's on CPU), as if the
  inputs qualified: the chooser's probe and fallback run on any machine."""
  acc = kernels.accelerator
  real = acc._call
  monkeypatch.setattr(acc, "_VERDICTS", {})
  monkeypatch.setattr(acc, "_verdicts_file", lambda: None)   # none kept between tests
  monkeypatch.setattr(acc, "unqualified", lambda q, mask=None: None)
  monkeypatch.setattr(acc, "_call", lambda impl, q, k, v, mask: (
      fake(q, k, v, mask) if impl == "cudnn" else real(impl, q, k, v, mask)))
  monkeypatch.delenv(acc.ENV, raising=False)


def _xla(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


@jax.custom_vjp
def _forward_only(q, k, v, mask):
  return _xla(q, k, v, mask) * 1.01     # in tolerance, and told apart from XLA's


_forward_only.defvjp(lambda q, k, v, mask: (_forward_only(q, k, v, mask), None),
                     lambda res, g: (_ for _ in ()).throw(NotImplementedError("no bprop")))


@pytest.mark.parametrize("fake, forward, train", [
    (_xla, "cudnn", "cudnn"),
    (_forward_only, "cudnn", "xla"),
    pytest.param(lambda q, k, v, mask: _xla(q, k, v, mask) * 1.1, "xla", "xla",   # wrong
                 marks=pytest.mark.slow),                                           # numbers
    (lambda q, k, v, mask: _xla(q, k, v, mask) * jnp.nan, "xla", "xla"),     # NaN
    (lambda q, k, v, mask: (_ for _ in ()).throw(ValueError("refused")), "xla", "xla"),
])
def test_cudnn_is_chosen_only_where_its_probe_ran_and_matched(monkeypatch, fake, forward,
                                                              train):
  """The plain forward takes cuDNN when its probe matched XLA; a differentiated call takes
  it only when the backward's probe matched too; a refusal, NaN or wrong numbers fall back
  to XLA, whose values and gradients the caller then gets."""
  _fake_cudnn(monkeypatch, fake)
  q, k, v, g, mask = _bf16_attention_inputs()
  f = lambda q, k, v: kernels.accelerator.attention(q, k, v, mask)
  y = jax.jit(f)(q, k, v)
  jax.jit(lambda q, k, v, g: jax.vjp(f, q, k, v)[1](g))(q, k, v, g)   # (its backward's probe)
  (verdict,) = kernels.accelerator.verdicts()
  assert (verdict["forward"]["ok"], bool(verdict["train"]["ok"])) == (forward == "cudnn",
                                                                      train == "cudnn"), verdict
  to_BLHD = lambda x: x.swapaxes(1, 2)

  def alone(impl):   # the implementation alone, jitted alike
    return lambda q, k, v: to_BLHD(kernels.accelerator._call(impl, to_BLHD(q), to_BLHD(k),
                                                              to_BLHD(v), mask))

  with_grads = lambda f: jax.jit(lambda q, k, v, g: (
      jax.vjp(f, q, k, v)[0], *jax.vjp(f, q, k, v)[1](g)))
  same = lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                    np.asarray(b, np.float32))
  same(y, jax.jit(alone(forward))(q, k, v))
  y_diff, *grads = with_grads(f)(q, k, v, g)
  for a, b in zip([y_diff, *grads], with_grads(alone(train))(q, k, v, g)):
    same(a, b)
  if forward != train:   # the two really differ, so the test tells which one answered
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(y_diff, np.float32))


def test_attention_implementation_is_chosen_by_the_environment(monkeypatch):
  acc = kernels.accelerator
  q, k, _, _, mask = _bf16_attention_inputs()
  q, k = q.swapaxes(1, 2), k.swapaxes(1, 2)
  monkeypatch.setattr(acc, "_VERDICTS", {})
  monkeypatch.setenv(acc.ENV, "xla")
  assert acc.choose(q, k, mask) == ("xla", "xla")
  monkeypatch.setenv(acc.ENV, "cudnn")
  assert acc.choose(q, k, mask) == ("cudnn", "cudnn")
  monkeypatch.setenv(acc.ENV, "flash")
  with pytest.raises(seq2seq.UserError, match="SEQ2SEQ_ATTENTION must be auto, xla or cudnn"):
    acc.choose(q, k, mask)
  monkeypatch.delenv(acc.ENV)
  if jax.default_backend() != "gpu":
    assert acc.choose(q, k, mask) == ("xla", "xla") and not acc.verdicts()
    assert acc.unqualified(q, mask).startswith("backend ")
  monkeypatch.setattr(acc, "_device_attributes", lambda: ("gpu", "cuda 12080", "9.0"))  # H100
  assert "dtype float32" in acc.unqualified(q.astype(jnp.float32), mask)
  assert "head size 12" in acc.unqualified(q[..., :12], mask)
  assert acc.unqualified(q, mask) is None


@pytest.mark.parametrize("table", ["reference", "cpu", "accelerator"])
@pytest.mark.parametrize("mask_rows", ["per_query_row", "per_key_row"])
def test_query_rows_sharing_keys_equal_attention_over_repeated_keys(table, mask_rows):
  """Beam search's cross-attention: r query rows per key/value row (rows b·r .. b·r + r - 1
  read row b) == attention against keys/values repeated r times."""
  rng = np.random.default_rng(6)
  B, r, Q, K, H, D = 2, 3, 2, 5, 2, 4
  q = jnp.asarray(rng.normal(size=(B * r, H, Q, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, H, K, D)), jnp.float32) for _ in range(2))
  if mask_rows == "per_query_row":
    mask = rng.random((B * r, 1, Q, K)) > 0.3
    mask[..., 0] = True
    full_mask = mask
  else:
    mask = rng.random((B, 1, 1, K)) > 0.3
    mask[..., 0] = True
    full_mask = np.repeat(mask, r, axis=0)
  attend = kernels.get(table).attention
  got = attend(q, k, v, mask)
  want = attn.dot_product_attention(q, jnp.repeat(k, r, 0), jnp.repeat(v, r, 0), full_mask)
  np.testing.assert_allclose(got, want, atol=1e-5)
  with pytest.raises(ValueError, match="multiple"):
    attend(q[:5], k, v)


# --- the output head, search helpers, decode options ------------------------------------------

@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("tied", [True, False])
def test_fused_head_loss_equals_logits_then_cross_entropy(eps, tied, chunks):
  """The fused head+loss+accuracy (gradient computed in its forward pass, in one piece or
  over 3 slices of the target length) == logits, then cross_entropy/accuracy, autodiff:
  values and all gradients, jitted, with an incoming gradient other than 1."""
  ks = jax.random.split(jax.random.key(0), 4)
  B, T, D, V = 5, 9, 16, 61
  y = jax.random.normal(ks[0], (B, T, D))
  w = jax.random.normal(ks[1], (V, D) if tied else (D, V))
  b = None if tied else jax.random.normal(ks[2], (V,))
  t = jax.random.randint(ks[3], (B, T), 0, V)          # some 0s: padding
  t = t.at[0, :7].set(jnp.argmax(y[0, :7] @ (w.T if tied else w) + (0 if b is None else b), -1))

  def readable(y, w, b):
    logits = y @ (w.T if tied else w) + (0 if b is None else b)
    s, n = cross_entropy(logits, t, eps)
    return 0.37 * s, (accuracy(logits, t)[0], n)

  def fused(y, w, b):
    s, c, n = cpu_head.head_loss(y, w, b, t, (t != 0).astype(jnp.float32), label_smoothing=eps,
                                 w_is_VxD=tied, chunks=chunks)
    return 0.37 * s, (c, n)

  argnums = (0, 1) if tied else (0, 1, 2)
  (s1, (c1, n1)), g1 = jax.value_and_grad(readable, argnums, has_aux=True)(y, w, b)
  (s2, (c2, n2)), g2 = jax.jit(jax.value_and_grad(fused, argnums, has_aux=True))(y, w, b)
  np.testing.assert_allclose(s2, s1, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(fused)(y, w, b)[0], s1, rtol=1e-6)  # no-gradient path
  assert float(c2) == float(c1) >= 6 and float(n2) == float(n1) == float((t != 0).sum())
  for a, b_ in zip(g2, g1):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=2e-6)
    assert float(jnp.abs(b_).sum()) > 0


def test_head_chunks_keep_slices_cache_sized_and_large():
  """small's head runs in 4 slices of 512 rows whose logits fit 20 MB; base's cannot keep
  512 rows under 20 MB, so it stays whole; a length with no fitting divisor stays whole."""
  assert cpu_head.head_chunks(32, 64, 8000) == 4
  assert cpu_head.head_chunks(16, 64, 32000) == 1
  assert cpu_head.head_chunks(32, 16, 8000) == 1     # 512 rows, 16 MB: one piece already fits
  assert cpu_head.head_chunks(64, 31, 8000) == 1     # 31 is prime: 1 or 31 slices (64 rows)


@pytest.mark.parametrize("vocab, k", [(8000, 8), (1000, 2), (3001, 4), (40, 3)])
def test_fast_top_k_and_argmax_match_lax(vocab, k):
  rng = np.random.default_rng(vocab)
  x = rng.normal(size=(5, vocab)).astype(np.float32)
  x[1, : vocab // 2] = -np.inf                        # masked tokens, as after filtering
  x[2, 7] = x[2, vocab - 3] = x[2].max() + 1.0        # a tie for the maximum
  vals, idx = jax.jit(cpu.top_k, static_argnums=1)(x, k)
  want_vals, want_idx = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(vals, want_vals)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(jax.jit(cpu.argmax)(x), np.argmax(x, -1))
  np.testing.assert_array_equal(reference.argmax(x), np.argmax(x, -1))
  lse = np.log(np.sum(np.exp(x.astype(np.float64)), -1))
  for fn in (cpu.top_k_logsumexp, reference.top_k_logsumexp):   # cpu: C++ where built
    vals, idx, got = jax.jit(fn, static_argnums=1)(x, k)
    np.testing.assert_array_equal(vals, want_vals)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(got, lse, rtol=1e-6)


def test_cpu_has_avx512_reads_the_flags_line(monkeypatch):
  assert cpu.cpu_has_avx512("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
  assert not cpu.cpu_has_avx512("flags\t\t: fpu sse2 avx2 avx512_bf16\n")     # no avx512f
  assert not cpu.cpu_has_avx512("model name\t: avx512f\nflags\t\t: fpu avx2\n")
  assert not cpu.cpu_has_avx512("")
  monkeypatch.setattr(cpu, "F32_DOTS", "eigen")
  with pytest.raises(ValueError, match="F32_DOTS must be auto, xla or ynnpack"):
    cpu.decode_compiler_options(seq2seq.get_config("tiny"))


def test_kernels_are_chosen_by_name_and_auto_by_backend():
  assert kernels.get("reference") is kernels.REFERENCE
  assert kernels.get("auto").name == ("cpu" if jax.default_backend() == "cpu" else "accelerator")
  with pytest.raises(ValueError, match="kernels must be one of"):
    kernels.get("fast")
  with pytest.raises(seq2seq.ConfigError, match="kernels must be auto, reference, cpu or "):
    seq2seq.get_config("tiny").replace(kernels="cudnn")


# --- the whole model: every table computes the same function --------------------------------

V = 37


def _batch(packed: bool, seed: int = 0, even: bool = False):
  """Padded rows (a short source and target), or packed rows (two examples per row with
  their own segments and positions). `even`: the source gets one more padding column, so
  every length is even (cuDNN's attention backward with a mask wants even lengths)."""
  rng = np.random.default_rng(seed)
  src = rng.integers(4, V, (3, 9)).astype(np.int32)
  tgt = rng.integers(4, V, (3, 8)).astype(np.int32)
  pad_src = (lambda x: np.pad(x, ((0, 0), (0, 1)))) if even else (lambda x: x)
  if not packed:
    src[1, 5:], tgt[1, 4:], tgt[2, 6:] = 0, 0, 0
    return {"src": pad_src(src), "tgt": tgt}
  src = pad_src(src)
  src_seg = pad_src(np.array([[1] * 4 + [2] * 5] * 3, np.int32))
  tgt_seg = np.array([[1] * 3 + [2] * 4 + [0]] * 3, np.int32)
  tgt[:, 7] = 0
  pos = lambda seg: np.concatenate([np.arange((seg[0] == s).sum()) for s in (1, 2)] +
                                   [np.zeros((seg[0] == 0).sum(), int)]).astype(np.int32)
  return {"src": src, "tgt": tgt, "src_segments": src_seg, "tgt_segments": tgt_seg,
          "src_positions": np.tile(pos(src_seg), (3, 1)),
          "tgt_positions": np.tile(pos(tgt_seg), (3, 1))}


def _model_config(table, dtype, pre_ln, dropout=0.0):
  return seq2seq.get_config("tiny", vocab_size=V).replace(
      kernels=table, dtype=dtype, pre_ln=pre_ln, dropout_rate=dropout, ffn_dropout_rate=dropout,
      attention_dropout_rate=dropout)


def _params(pre_ln: bool, seed=0):
  """Initialised one module per layer, then stacked as the tables' models keep them (the
  same random model whatever the layout)."""
  cfg = _model_config("reference", "float32", pre_ln).replace(scan_layers=False)
  p = jax.jit(Transformer(cfg).init)(jax.random.key(seed), jnp.ones((1, 8), jnp.int32),
                                     jnp.ones((1, 8), jnp.int32))["params"]
  # Non-zero biases and LayerNorm parameters, so a kernel that drops one is seen.
  rng = np.random.default_rng(seed)
  return stack_layers(jax.tree_util.tree_map(
      lambda x: x + 0.1 * rng.normal(size=x.shape).astype(np.float32), p))


def _everything(table, dtype, pre_ln, packed, params, dropout=0.0, even=False,
                decode=True):
  """Logits (teacher-forced), the train step's loss sums and gradients, greedy and beam
  tokens of one kernels table (with decode=False, none: decoding has no dropout)."""
  params = params[pre_ln]
  mc = _model_config(table, dtype, pre_ln, dropout)
  cfg = Config(model=mc, train=TrainConfig(label_smoothing=0.1))
  batch = {k: jnp.asarray(v) for k, v in _batch(packed, even=even).items()}
  tgt_in = train_lib.shift_right(batch["tgt"], 1, batch.get("tgt_segments"))
  logits = jax.jit(lambda p, b, t: Transformer(mc).apply(
      {"params": p}, b["src"], t, b.get("src_segments"), b.get("tgt_segments"),
      b.get("src_positions"), b.get("tgt_positions")))(params, batch, tgt_in)
  rng = jax.random.key(5) if dropout else None
  (loss, m), grads = jax.jit(jax.value_and_grad(
      lambda p: train_lib.loss_and_metrics(cfg, p, batch, 1, train=dropout > 0, rng=rng),
      has_aux=True))(params)
  valid = np.asarray(batch.get("tgt_segments", batch["tgt"]) != 0)
  out = dict(logits=np.asarray(logits)[valid], loss=float(loss), correct=float(m["correct"]),
             tokens=float(m["tokens"]), grads=grads)
  if decode:
    src = _batch(False)["src"]
    greedy = decoding.decode(mc, params, src, search.Greedy(), bos_id=1, eos_id=2, max_len=10)
    beam = decoding.decode(mc, params, src, search.Beam(size=3), bos_id=1, eos_id=2,
                           max_len=10)
    out.update(greedy=greedy.tokens, beam=beam.tokens, beam_scores=beam.scores)
  return out


def _max_diff(a, b) -> float:
  return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _bf16_close(name, got, want, f32_value, atol):
  """|got - want| <= atol, or got no further from the float32 model's value (f32_value(),
  asked for only here) than twice want is."""
  d = _max_diff(got, want)
  if d <= atol:
    return
  assert f32_value is not None, f"{name}: {d:.4g} apart (tolerance {atol:.3g})"
  t = f32_value()
  g, w = _max_diff(got, t), _max_diff(want, t)
  assert g <= 2 * w, (f"{name}: {d:.4g} apart (tolerance {atol:.3g}), and {g:.4g} from "
                      f"the float32 model against the bf16 reference's {w:.4g}")


def assert_same_function(got: dict, want: dict, dtype: str, truth=None):
  """The tolerances of this module's docstring. bf16: `truth()` gives the float32
  reference's results, asked for only where a tolerance is missed."""
  f32 = dtype == "float32"
  leaves = lambda d: jax.tree_util.tree_leaves(d["grads"])
  scale = max(float(jnp.abs(g).max()) for g in leaves(want))
  of_truth = (lambda get: (lambda: get(truth()))) if truth else (lambda get: None)
  if f32:
    np.testing.assert_allclose(got["logits"], want["logits"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
  else:
    _bf16_close("logits", got["logits"], want["logits"], of_truth(lambda d: d["logits"]), 0.02)
    _bf16_close("loss", got["loss"], want["loss"], of_truth(lambda d: d["loss"]),
                1e-3 * abs(want["loss"]))
  assert got["tokens"] == want["tokens"]
  assert abs(got["correct"] - want["correct"]) <= (0 if f32 else 1)
  for i, ((path, a), b) in enumerate(zip(jax.tree_util.tree_leaves_with_path(got["grads"]),
                                         leaves(want))):
    if f32:
      np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0,
                                 err_msg=jax.tree_util.keystr(path))
    else:
      _bf16_close(jax.tree_util.keystr(path), a, b,
                  of_truth(lambda d, i=i: leaves(d)[i]), 0.03 * scale)
  if f32 and "greedy" in got:   # bf16 roundings may flip a near-tie between two tokens
    np.testing.assert_array_equal(got["greedy"], want["greedy"])
    np.testing.assert_array_equal(got["beam"], want["beam"])
    np.testing.assert_allclose(got["beam_scores"], want["beam_scores"], atol=1e-4)


@pytest.fixture(scope="module")
def params():
  return {pre_ln: _params(pre_ln) for pre_ln in (False, True)}


_REFERENCE_CACHE = {}


def _reference(dtype, pre_ln, packed, params, even=False, decode=True):
  key = (dtype, pre_ln, packed, even, decode)
  if key not in _REFERENCE_CACHE:
    _REFERENCE_CACHE[key] = _everything("reference", dtype, pre_ln, packed, params, even=even,
                                        decode=decode)
  return _REFERENCE_CACHE[key]


def _float32_model(pre_ln, packed, params, even=False):
  """The reference's logits, loss and gradients in float32 (the bf16 criterion's truth)."""
  return _reference("float32", pre_ln, packed, params, even=even, decode=False)


@pytest.mark.parametrize("table", ["cpu", pytest.param("accelerator", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype,pre_ln,packed", [
    ("float32", False, False),
    pytest.param("float32", True, True, marks=pytest.mark.slow),
    pytest.param("bfloat16", False, True, marks=pytest.mark.slow),
    pytest.param("bfloat16", True, False, marks=pytest.mark.slow)])
def test_every_kernels_table_computes_the_reference_model(table, dtype, pre_ln, packed, params):
  want = _reference(dtype, pre_ln, packed, params)
  assert_same_function(_everything(table, dtype, pre_ln, packed, params), want, dtype,
                       truth=lambda: _float32_model(pre_ln, packed, params))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_accelerator_bf16_model_with_even_lengths_computes_the_reference_model(params, packed):
  """The shapes cuDNN's attention can take in training too (bf16, head size 16, even
  lengths; on a GPU where its probe passes): the accelerator table's logits, train-step
  loss and gradients equal the reference's within the bf16 tolerances."""
  want = _reference("bfloat16", False, packed, params, even=True, decode=False)
  got = _everything("accelerator", "bfloat16", False, packed, params, even=True, decode=False)
  assert_same_function(got, want, "bfloat16",
                       truth=lambda: _float32_model(False, packed, params, even=True))


@pytest.mark.slow
def test_with_the_same_dropout_masks_the_training_step_is_the_same(params, monkeypatch):
  """Dropout on (embeddings, residuals, FFN hidden units, attention weights): the cpu
  table draws its masks another way (a hash), so given the reference's mask function it
  must give the reference's training loss and gradients."""
  monkeypatch.setitem(kernels._TABLES, "cpu", dataclasses.replace(
      kernels.CPU, dropout_keep=reference.dropout_keep))
  want = _everything("reference", "float32", False, True, params, dropout=0.2, decode=False)
  got = _everything("cpu", "float32", False, True, params, dropout=0.2, decode=False)
  assert_same_function(got, want, "float32")
  no_dropout = _everything("reference", "float32", False, True, params, decode=False)
  assert abs(want["loss"] - no_dropout["loss"]) > 1e-3      # dropout really was on


@pytest.mark.parametrize("perturb", [   # each compiles two train steps: one in the fast tier
    "attention", pytest.param("dense", marks=pytest.mark.slow),
    pytest.param("head_loss", marks=pytest.mark.slow)])
def test_a_perturbed_kernel_is_caught(params, monkeypatch, perturb):
  """The comparison above can fail: a kernel off by a little (attention scores scaled by
  1.02, a matmul's output by 1.001, the fused loss by 1.0001) is told apart."""
  wrong = {
      "attention": lambda q, k, v, mask=None, **kw: cpu.attention(q * 1.02, k, v, mask, **kw),
      "dense": lambda x, weights, dtype: [y * 1.001 for y in cpu.dense(x, weights, dtype)],
      "head_loss": lambda *a, **kw: tuple(s * f for s, f in zip(cpu_head.head_loss(*a, **kw),
                                                                 (1.0001, 1, 1))),
  }[perturb]
  fn = kernels.sharing_keys(wrong) if perturb == "attention" else wrong
  monkeypatch.setitem(kernels._TABLES, "cpu", dataclasses.replace(kernels.CPU, **{perturb: fn}))
  want = _reference("float32", False, False, params)
  with pytest.raises(AssertionError):
    assert_same_function(_everything("cpu", "float32", False, False, params, decode=False),
                         want, "float32")


@pytest.mark.slow
def test_the_bf16_comparison_takes_other_roundings_but_not_a_wrong_kernel(params, monkeypatch):
  """The bf16 criterion's second chance: the float32 model itself (0.03-0.04 from the bf16
  reference's logits) passes for a bf16 table, as a kernel that rounds in another order
  would; attention scores scaled by 1.02 in bf16 are still caught."""
  want = _reference("bfloat16", False, True, params)
  truth = lambda: _float32_model(False, True, params)
  with pytest.raises(AssertionError, match="apart"):
    assert_same_function(truth(), want, "bfloat16")             # no second chance
  assert_same_function(truth(), want, "bfloat16", truth=truth)
  wrong = lambda q, k, v, mask=None, **kw: cpu.attention(q * 1.02, k, v, mask, **kw)
  monkeypatch.setitem(kernels._TABLES, "cpu", dataclasses.replace(
      kernels.CPU, attention=kernels.sharing_keys(wrong)))
  with pytest.raises(AssertionError, match="from the float32 model"):
    assert_same_function(_everything("cpu", "bfloat16", False, True, params, decode=False),
                         want, "bfloat16", truth=truth)


def test_parameters_are_the_same_whichever_table():
  """Checkpoints move between tables: the same init gives the same tree and values."""
  dummy = jnp.ones((1, 8), jnp.int32)
  trees = [jax.jit(Transformer(_model_config(t, "float32", False)).init)(jax.random.key(0),
                                                                          dummy, dummy)
           for t in ("reference",) + FAST]
  for other in trees[1:]:
    assert jax.tree_util.tree_structure(other) == jax.tree_util.tree_structure(trees[0])
    jax.tree_util.tree_map(np.testing.assert_array_equal, other, trees[0])
