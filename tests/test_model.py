"""The model is the paper's: positions, embedding, Add & Norm, masks, head, parameter counts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import layers
from seq2seq.config import ConfigError, TransformerConfig
from seq2seq.layout import count_params, stack_layers, unroll_layers
from seq2seq.model import Transformer, init_cache

# The reference path: the paper as written (tests/test_kernels.py: the others compute the same).
CFG = seq2seq.get_config("tiny", vocab_size=37).replace(dropout_rate=0.0, kernels="reference")
UNROLLED = CFG.replace(scan_layers=False)   # one module per layer, as decode steps read them


def _init(cfg, src, tgt):
  return jax.jit(Transformer(cfg).init)(jax.random.key(0), src, tgt)


def _batch(seed=0, b=3, s=7, t=6, vocab=37):
  rng = np.random.default_rng(seed)
  src = rng.integers(4, vocab, (b, s)).astype(np.int32)
  tgt = rng.integers(4, vocab, (b, t)).astype(np.int32)
  src[1, 5:] = 0  # padded source row
  return jnp.asarray(src), jnp.asarray(tgt)


def test_sinusoids_match_paper_formula():
  L, D = 50, 16
  pe = layers.sinusoidal_positions(L, D)
  for pos in range(L):
    for i in range(D // 2):
      angle = pos / 10000 ** (2 * i / D)
      assert pe[pos, 2 * i] == pytest.approx(np.sin(angle), abs=1e-6)
      assert pe[pos, 2 * i + 1] == pytest.approx(np.cos(angle), abs=1e-6)


def test_embedding_is_scaled_by_sqrt_d_and_tied_head_uses_it():
  src, tgt = _batch()
  params = _init(CFG, src, tgt)
  table = np.asarray(params["params"]["embed"]["embedding"])
  emb = jax.jit(lambda p, x: Transformer(CFG).apply(p, x, method=lambda m, x: m._tgt_embed()(x)))(params, tgt)
  np.testing.assert_allclose(emb, table[np.asarray(tgt)] * np.sqrt(CFG.d_model), rtol=1e-6)
  y = np.random.default_rng(0).normal(size=(2, 3, CFG.d_model)).astype(np.float32)
  logits = jax.jit(lambda p, y: Transformer(CFG).apply(p, y, method=Transformer.output_head))(params, y)
  np.testing.assert_allclose(logits, y @ table.T, rtol=1e-4, atol=1e-4)
  assert "logits_dense" not in params["params"]


def test_untied_and_unshared_variants():
  src, tgt = _batch()
  cfg = CFG.replace(share_embeddings=False, tie_output=False)
  p = _init(cfg, src, tgt)["params"]
  assert {"src_embed", "tgt_embed", "logits_dense"} <= set(p)
  assert "bias" in p["logits_dense"]
  out = jax.jit(Transformer(cfg).apply)({"params": p}, src, tgt)
  assert out.shape == (3, 6, 37)


def test_feed_forward_is_relu_mlp():
  cfg = CFG
  x = np.random.default_rng(0).normal(size=(2, 3, cfg.d_model)).astype(np.float32)
  ffn = layers.FeedForward(cfg)
  p = ffn.init(jax.random.key(0), x)["params"]
  w1, b1, w2, b2 = (np.asarray(a) for a in (p["wi"]["kernel"], p["wi"]["bias"],
                                            p["wo"]["kernel"], p["wo"]["bias"]))
  want = np.maximum(0, x @ w1 + b1) @ w2 + b2
  np.testing.assert_allclose(ffn.apply({"params": p}, x), want, rtol=1e-4, atol=1e-5)


def _np_mha(p, xq, xkv, mask):
  """Multi-head attention by hand in NumPy, from the per-projection kernels."""
  wq, bq = np.asarray(p["query"]["kernel"]), np.asarray(p["query"]["bias"])
  wk, wv, bv = (np.asarray(p["key"]["kernel"]), np.asarray(p["value"]["kernel"]),
                np.asarray(p["value"]["bias"]))
  wo, bo = np.asarray(p["out"]["kernel"]), np.asarray(p["out"]["bias"])
  q = np.einsum("bqd,dhk->bhqk", xq, wq) + bq.transpose(0, 1)[None, :, None, :]
  k = np.einsum("bkd,dhe->bhke", xkv, wk)
  v = np.einsum("bkd,dhe->bhke", xkv, wv) + bv[None, :, None, :]
  s = np.einsum("bhqe,bhke->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(mask, s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w = w / w.sum(-1, keepdims=True)
  y = np.einsum("bhqk,bhke->bqhe", w, v)
  return np.einsum("bqhe,hed->bqd", y, wo) + bo


def test_multi_head_attention_self_and_cross_match_numpy():
  """Self-attention (Q, K, V from one sequence) and cross-attention (Q from the
  queries, K and V from the memory) both equal the textbook per-projection computation."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, CFG.d_model)).astype(np.float32)
  mem = rng.normal(size=(2, 7, CFG.d_model)).astype(np.float32)
  mha = layers.MultiHeadAttention(CFG)
  p = mha.init(jax.random.key(0), x, x)["params"]
  p = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32), p)
  causal = np.tril(np.ones((5, 5), bool))[None, None]
  np.testing.assert_allclose(mha.apply({"params": p}, x, x, causal),
                             _np_mha(p, x, x, causal), rtol=1e-4, atol=1e-4)
  mask = np.ones((2, 1, 5, 7), bool)
  mask[1, :, :, 4:] = False
  np.testing.assert_allclose(mha.apply({"params": p}, x, mem, mask),
                             _np_mha(p, x, mem, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_add_and_norm(pre_ln):
  cfg = CFG.replace(pre_ln=pre_ln)
  x = np.random.default_rng(0).normal(size=(2, 3, cfg.d_model)).astype(np.float32)
  f = lambda h: 2.0 * h + 1.0
  mod = layers.AddNorm(cfg)
  p = mod.init(jax.random.key(0), x, f)
  ln = lambda h: (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)
  want = x + f(ln(x)) if pre_ln else ln(x + f(x))
  np.testing.assert_allclose(mod.apply(p, x, f), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pre_ln", [pytest.param(False, marks=pytest.mark.slow), True])
def test_decoder_is_causal(pre_ln):
  cfg = CFG.replace(pre_ln=pre_ln)
  src, tgt = _batch()
  params = _init(cfg, src, tgt)
  apply = jax.jit(Transformer(cfg).apply)
  base = np.asarray(apply(params, src, tgt))
  for t in range(tgt.shape[1] - 1):
    changed = tgt.at[:, t + 1:].set((tgt[:, t + 1:] - 4 + 5) % 33 + 4)
    out = np.asarray(apply(params, src, changed))
    np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
    assert not np.allclose(out[:, t + 1:], base[:, t + 1:])


@pytest.mark.parametrize("pre_ln", [False, True])
def test_encoder_sees_the_whole_source(pre_ln):
  """The encoder is not causal: the last source token changes the first position's output."""
  cfg = CFG.replace(pre_ln=pre_ln)
  src, tgt = _batch()
  params = _init(cfg, src, tgt)
  encode = jax.jit(lambda p, s: Transformer(cfg).apply(p, s, method=Transformer.encode))
  changed = src.at[0, -1].set((src[0, -1] - 4 + 5) % 33 + 4)
  a, b = np.asarray(encode(params, src)), np.asarray(encode(params, changed))
  assert np.abs(a[0, 0] - b[0, 0]).max() > 1e-3
  np.testing.assert_array_equal(a[1:], b[1:])   # other rows are their own examples


@pytest.mark.parametrize("pre_ln", [pytest.param(False, marks=pytest.mark.slow), True])
def test_each_stack_ends_layer_normalised(pre_ln):
  """Post-LN ends each stack with its last Add & Norm; pre-LN, whose residual stream is never
  normalised, needs a final LayerNorm on the encoder and on the decoder. At initialisation
  (LayerNorm scale 1, bias 0) both stacks' outputs have mean 0 and variance 1 per position."""
  cfg = CFG.replace(pre_ln=pre_ln)
  src, tgt = _batch()
  params = _init(cfg, src, tgt)
  model = Transformer(cfg)
  enc = np.asarray(model.apply(params, src, method=Transformer.encode))
  dec = np.asarray(model.apply(params, src, tgt, return_features=True))
  for y in (enc[src != 0], dec.reshape(-1, cfg.d_model)):
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)
  assert ("final_norm" in params["params"]["encoder"]) == pre_ln
  assert ("final_norm" in params["params"]["decoder"]) == pre_ln


@pytest.mark.parametrize("pre_ln", [False, True])
def test_residual_dropout_is_on_the_sublayer_output(pre_ln):
  """Add & Norm drops the sublayer's output, not the residual: training with dropout, a
  sublayer that outputs zeros gives LayerNorm(x) (post-LN) or x (pre-LN) exactly, and one
  that outputs c gives LayerNorm(x + d) or x + d, with each element of d = c/(1-p) or 0."""
  cfg = CFG.replace(pre_ln=pre_ln, dropout_rate=0.5)
  x = np.random.default_rng(0).normal(size=(2, 5, cfg.d_model)).astype(np.float32)
  mod = layers.AddNorm(cfg)
  p = mod.init(jax.random.key(0), x, lambda h: h)
  ln = lambda h: (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)
  add_norm = ((lambda x, d: x + d) if pre_ln else (lambda x, d: ln(x + d)))

  def run(f):
    y, seen = mod.apply(p, x, f, True, rngs={"dropout": jax.random.key(3)},
                        capture_intermediates=True, mutable=["intermediates"])
    return np.asarray(y), np.asarray(seen["intermediates"]["dropout"]["__call__"][0])

  np.testing.assert_allclose(run(jnp.zeros_like)[0], add_norm(x, 0.0), rtol=1e-5, atol=1e-5)
  y, d = run(lambda h: jnp.full_like(h, 0.7))
  np.testing.assert_allclose(d[d != 0], 1.4, rtol=1e-6)
  assert 0.35 < float((d == 0).mean()) < 0.65
  np.testing.assert_allclose(y, add_norm(x, d), rtol=1e-4, atol=1e-4)


def test_embedding_sums_are_dropped_out_in_training():
  """The paper's dropout on the sums of embeddings and positional encodings, in the encoder
  and the decoder: each element of (embedding·√d + PE) is zeroed or scaled by 1/(1-p)."""
  cfg = CFG.replace(dropout_rate=0.5)
  src, tgt = _batch()
  params = _init(cfg, src, tgt)
  table = np.asarray(params["params"]["embed"]["embedding"])
  _, seen = Transformer(cfg).apply(params, src, tgt, train=True,
                                   rngs={"dropout": jax.random.key(4)},
                                   capture_intermediates=True, mutable=["intermediates"])
  pe = layers.sinusoidal_positions(cfg.max_len, cfg.d_model)
  for stack, ids in (("encoder", src), ("decoder", tgt)):
    want = table[np.asarray(ids)] * np.sqrt(cfg.d_model) + pe[:ids.shape[1]]
    got = np.asarray(seen["intermediates"][stack]["dropout"]["__call__"][0])
    zero = got == 0
    np.testing.assert_allclose(np.where(zero, 0, got), np.where(zero, 0, 2 * want),
                               rtol=1e-5, atol=1e-5)
    assert 0.4 < zero.mean() < 0.6, stack


def test_source_padding_is_ignored():
  src, tgt = _batch()
  params = _init(CFG, src, tgt)
  apply = jax.jit(Transformer(CFG).apply)
  base = apply(params, src, tgt)
  # More padding on the right changes nothing.
  longer = jnp.pad(src, ((0, 0), (0, 4)))
  np.testing.assert_allclose(apply(params, longer, tgt), base, atol=1e-5)
  # With explicit segment ids, whatever tokens sit in padded slots change nothing at all.
  seg = (src != 0).astype(jnp.int32)
  ref = apply(params, src, tgt, src_segments=seg, tgt_segments=jnp.ones_like(tgt))
  junk = jnp.where(seg == 0, 9, src)
  out = apply(params, junk, tgt, src_segments=seg, tgt_segments=jnp.ones_like(tgt))
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_allclose(ref, base, atol=1e-5)


def test_packed_row_equals_examples_alone():
  """Two examples packed into one row give the logits each gives alone."""
  rng = np.random.default_rng(5)
  s1, s2 = rng.integers(4, 37, 4), rng.integers(4, 37, 3)
  t1, t2 = rng.integers(4, 37, 3), rng.integers(4, 37, 5)
  params = _init(CFG, jnp.ones((1, 4), jnp.int32), jnp.ones((1, 3), jnp.int32))
  model = Transformer(CFG)
  src = jnp.asarray(np.concatenate([s1, s2, [0]])[None], jnp.int32)
  tgt = jnp.asarray(np.concatenate([t1, t2, [0, 0]])[None], jnp.int32)
  src_seg = jnp.asarray([[1] * 4 + [2] * 3 + [0]])
  tgt_seg = jnp.asarray([[1] * 3 + [2] * 5 + [0, 0]])
  src_pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 0]])
  tgt_pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4, 0, 0]])
  apply = jax.jit(model.apply)
  packed = apply(params, src, tgt, src_seg, tgt_seg, src_pos, tgt_pos)
  a = apply(params, jnp.asarray(s1[None], jnp.int32), jnp.asarray(t1[None], jnp.int32))
  b = apply(params, jnp.asarray(s2[None], jnp.int32), jnp.asarray(t2[None], jnp.int32))
  np.testing.assert_allclose(packed[0, :3], a[0], atol=1e-5)
  np.testing.assert_allclose(packed[0, 3:8], b[0], atol=1e-5)


@pytest.mark.slow   # the whole model op by op (~7 s)
def test_jit_equals_eager_and_gradients_are_finite():
  src, tgt = _batch()
  cfg = CFG.replace(dropout_rate=0.1)
  params = _init(cfg, src, tgt)
  model = Transformer(cfg)
  np.testing.assert_allclose(jax.jit(model.apply)(params, src, tgt), model.apply(params, src, tgt),
                             atol=1e-5)

  def loss(p):
    logits = model.apply(p, src, seq2seq.shift_right(tgt, 1), train=True,
                         rngs={"dropout": jax.random.key(1)})
    s, n = seq2seq.cross_entropy(logits, tgt, 0.1)
    return s / n
  grads = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree_util.tree_leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0


def test_dropout_only_in_training():
  src, tgt = _batch()
  cfg = CFG.replace(dropout_rate=0.3)
  params = _init(cfg, src, tgt)
  apply = jax.jit(Transformer(cfg).apply, static_argnames="train")
  a = apply(params, src, tgt, train=True, rngs={"dropout": jax.random.key(0)})
  b = apply(params, src, tgt, train=True, rngs={"dropout": jax.random.key(1)})
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(apply(params, src, tgt), apply(params, src, tgt))


def test_ffn_hidden_dropout_is_off_by_default_as_in_the_paper():
  from seq2seq.layers import FeedForward
  x = jax.random.normal(jax.random.key(0), (2, 5, CFG.d_model))
  paper = CFG.replace(dropout_rate=0.3)
  assert paper.ffn_dropout_rate == 0.0 and paper.attention_dropout_rate == 0.0
  params = FeedForward(paper).init(jax.random.key(1), x)

  def run(cfg, train):
    y, seen = FeedForward(cfg).apply(params, x, train, rngs={"dropout": jax.random.key(2)},
                                     capture_intermediates=True, mutable=["intermediates"])
    return np.asarray(y), seen["intermediates"]

  # Residual dropout (dropout_rate) does not reach inside the FFN...
  np.testing.assert_array_equal(run(paper, True)[0], run(paper, False)[0])
  # ...unless asked for: then each ReLU unit is zeroed or scaled by 1/(1 - p) before W2.
  wi, wo = (jax.tree_util.tree_map(np.asarray, params["params"][n]) for n in ("wi", "wo"))
  h = np.maximum(np.asarray(x) @ wi["kernel"] + wi["bias"], 0)
  y, seen = run(paper.replace(ffn_dropout_rate=0.5), True)
  dropped = np.asarray(seen["Dropout_0"]["__call__"][0])
  zero = dropped == 0
  np.testing.assert_allclose(np.where(zero, 0, dropped), np.where(zero, 0, 2 * h), rtol=1e-5, atol=1e-6)
  assert 0.4 < zero[h > 0].mean() < 0.6
  np.testing.assert_allclose(y, dropped @ wo["kernel"] + wo["bias"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_cached_decode_step_equals_full_decoder(pre_ln):
  cfg = CFG.replace(pre_ln=pre_ln, scan_layers=False)   # decode steps' layout
  src, tgt = _batch()
  params = _init(cfg, src, tgt)
  model = Transformer(cfg)
  full = model.apply(params, src, tgt)
  enc = model.apply(params, src, method=Transformer.encode)
  kv = model.apply(params, enc, method=Transformer.precompute_cross_kv)
  cache = init_cache(cfg, src.shape[0], 10)
  step = jax.jit(lambda p, tok, t, c: model.apply(p, tok, t, c, kv, src != 0,
                                                  method=Transformer.decode_step))
  for t in range(tgt.shape[1]):
    logits, cache = step(params, tgt[:, t:t + 1], t, cache)
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_decode_step_at_per_row_positions_equals_full_decoder():
  """Rows at their own positions, as in the decode slots: row b first decodes `offset[b]`
  junk tokens (a sentence before), then starts again at position 0 with its target. Every
  row writes the ring cache's column s % 10 at step s. From then on each row's logits are
  the full decoder's, though the cache still holds the junk, and the ring wraps."""
  src, tgt = _batch()
  params = _init(UNROLLED, src, tgt)
  model = Transformer(UNROLLED)
  full = np.asarray(model.apply(params, src, tgt))
  enc = model.apply(params, src, method=Transformer.encode)
  kv = model.apply(params, enc, method=Transformer.precompute_cross_kv)
  offset = np.array([0, 3, 6])
  junk = np.random.default_rng(1).integers(4, 37, (3, 6)).astype(np.int32)
  cache = init_cache(UNROLLED, src.shape[0], 10)
  step = jax.jit(lambda p, tok, t, c, col: model.apply(p, tok, t, c, kv, src != 0, False, col,
                                                       method=Transformer.decode_step))
  checked = 0
  for s in range(tgt.shape[1] + offset.max()):
    pos = np.where(s < offset, s, s - offset)
    tok = np.where(s < offset, junk[:, min(s, 5)], np.asarray(tgt)[np.arange(3), np.minimum(
        pos, tgt.shape[1] - 1)])
    logits, cache = step(params, jnp.asarray(tok[:, None]), jnp.asarray(pos, jnp.int32), cache,
                         jnp.int32(s % 10))
    for b in np.flatnonzero((s >= offset) & (pos < tgt.shape[1])):
      np.testing.assert_allclose(logits[b, 0], full[b, pos[b]], atol=1e-5)
      checked += 1
  assert checked == tgt.size


def test_bf16_compute_keeps_f32_params_and_is_close():
  src, tgt = _batch()
  params = _init(CFG, src, tgt)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  f32 = Transformer(CFG).apply(params, src, tgt)
  bf16 = Transformer(CFG.replace(dtype="bfloat16")).apply(params, src, tgt)
  assert bf16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.15


def test_parameter_counts_match_the_paper():
  def n(name):
    cfg = seq2seq.get_config(name, vocab_size=37000)
    shapes = jax.eval_shape(lambda: Transformer(cfg).init(
        jax.random.key(0), jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32)))
    return count_params(shapes["params"])
  assert 60e6 <= n("base") <= 66e6
  assert 205e6 <= n("big") <= 215e6
  assert n("tiny") < n("small") < n("base")

  def by_hand(name):   # every weight and bias the paper's layers have, counted one by one
    c = seq2seq.get_config(name, vocab_size=37000)
    d, f = c.d_model, c.d_ff
    attn = 4 * d * d + 3 * d          # Q, K, V, O kernels; Q, V, O biases (no key bias)
    ffn, norm = d * f + f + f * d + d, 2 * d
    enc = attn + ffn + 2 * norm
    dec = 2 * attn + ffn + 3 * norm
    return 37000 * d + c.num_encoder_layers * enc + c.num_decoder_layers * dec
  for name in ("tiny", "small", "base", "big"):
    assert n(name) == by_hand(name), name


@pytest.mark.parametrize("bad, msg", [
    (dict(d_model=30, num_heads=4), "divisible"),
    (dict(num_heads=0), "num_heads"),
    (dict(d_ff=-1), "d_ff"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(attention_dropout_rate=-0.1), "attention_dropout_rate"),
    (dict(dtype="int8"), "dtype"),
])
def test_invalid_config_raises_one_line_value_error(bad, msg):
  with pytest.raises(ValueError, match=msg) as e:
    TransformerConfig(**bad)
  assert "\n" not in str(e.value)


def test_unknown_preset():
  with pytest.raises(ConfigError, match="unknown preset"):
    seq2seq.get_config("huge")
  assert dataclasses.is_dataclass(seq2seq.get_config("base"))


@pytest.mark.parametrize("pre_ln", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_scanned_layers_compute_what_one_module_per_layer_computes(pre_ln):
  """scan_layers (each stack traced once, its parameters stacked) and one module per layer
  (layout.unroll_layers of the same parameters): the same logits and gradients; the two
  layouts convert both ways, and each stacked layer was initialised on its own."""
  cfg = CFG.replace(pre_ln=pre_ln)
  src, tgt = _batch()
  stacked = _init(cfg, src, tgt)["params"]
  unrolled = unroll_layers(stacked)
  assert "layers" in stacked["encoder"] and "layers_1" in unrolled["decoder"]
  for a, b in zip(*map(jax.tree_util.tree_leaves, (stack_layers(unrolled), stacked))):
    np.testing.assert_array_equal(a, b)
  wi = np.asarray(stacked["encoder"]["layers"]["ffn"]["wi"]["kernel"])
  assert wi.shape[0] == cfg.num_encoder_layers and not np.allclose(wi[0], wi[1])
  assert count_params(stacked) == count_params(unrolled)

  def loss(c, p):
    logits = Transformer(c).apply({"params": p}, src, tgt)
    return (logits * jnp.sin(jnp.arange(logits.size).reshape(logits.shape))).sum(), logits
  (_, y_s), g_s = jax.jit(jax.value_and_grad(lambda p: loss(cfg, p), has_aux=True))(stacked)
  (_, y_u), g_u = jax.jit(jax.value_and_grad(
      lambda p: loss(UNROLLED.replace(pre_ln=pre_ln), p), has_aux=True))(unrolled)
  np.testing.assert_allclose(y_s, y_u, atol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_s),
                          jax.tree_util.tree_leaves(stack_layers(g_u))):
    np.testing.assert_allclose(a, b, atol=1e-4, err_msg=jax.tree_util.keystr(path))


def _train_step_ops(layers: int, scan: bool) -> int:
  """StableHLO ops of the lowered train step of a model with `layers` + `layers` layers."""
  from seq2seq.config import Config, TrainConfig
  from seq2seq.steps import Trainer
  mc = CFG.replace(num_encoder_layers=layers, num_decoder_layers=layers, scan_layers=scan,
                   kernels="accelerator", dropout_rate=0.1)
  trainer = Trainer(Config(model=mc, train=TrainConfig(batch_size=2, seq_len=8)))
  z = jnp.zeros((2, 8), jnp.int32)
  batch = {k: z for k in ("src", "tgt", "src_segments", "tgt_segments", "src_positions",
                          "tgt_positions")}
  text = trainer.step.lower(trainer.abstract_state, batch).as_text()
  return sum(1 for line in text.splitlines() if " = stablehlo." in line or " = chlo." in line)


def test_a_train_step_traces_each_layer_once():
  """With scan_layers the train step's program (the compiler's work) hardly grows with the
  number of layers (1 -> 3: under 5%); with one module per layer it grows by every
  layer's ops."""
  scanned = [_train_step_ops(n, True) for n in (1, 3)]
  unrolled = [_train_step_ops(n, False) for n in (1, 3)]
  assert scanned[1] < 1.05 * scanned[0], scanned
  assert unrolled[1] > 2 * unrolled[0] and scanned[1] < unrolled[1] / 2, (scanned, unrolled)
