"""The pieces the paper names, each a small linen module or function.

Mixed precision: parameters live in `param_dtype`; matmul inputs are cast to `dtype` and
accumulate in float32 (`preferred_element_type`), so the residual stream, LayerNorm and
softmax stay float32. `matmul` gives the backward pass the same treatment (the incoming
gradient is cast to `dtype` too), so with dtype=bfloat16 all three matmuls of a layer run
on bf16 inputs. With dtype=float32 this is plain f32 everywhere.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from seq2seq.attention import dot_product_attention, row_major
from seq2seq.config import TransformerConfig


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """[max_len, d_model]: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
  pos = np.arange(max_len, dtype=np.float64)[:, None]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
  angle = pos / np.power(10000.0, two_i / d_model)
  pe = np.zeros((max_len, d_model), dtype=np.float64)
  pe[:, 0::2] = np.sin(angle)
  pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
  return pe.astype(np.float32)


def add_positions(x_BxLxD: jax.Array, max_len: int, positions_BxL: jax.Array | None = None,
                  offset: jax.Array | int = 0) -> jax.Array:
  """x + PE[position]; positions default to offset, offset+1, ... (packed rows pass their own)."""
  _, length, d = x_BxLxD.shape
  if positions_BxL is None:
    positions_BxL = (offset + jnp.arange(length))[None, :]
  return x_BxLxD + jnp.asarray(sinusoidal_positions(max_len, d))[positions_BxL]


def dot_nt(a_MxN: jax.Array, b_KxN: jax.Array) -> jax.Array:
  """a·bᵀ [M, K], float32 accumulation: the input gradient g·Wᵀ of y = x·W, contracting
  the last axes directly (no transposed copy of b)."""
  return jax.lax.dot_general(a_MxN, b_KxN, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def dot_tn(a_MxK: jax.Array, b_MxN: jax.Array) -> jax.Array:
  """aᵀ·b [K, N], float32 accumulation: the weight gradient xᵀ·g of y = x·W, contracting
  the rows. The smaller operand is transposed into a row-major copy first (see
  `attention.row_major`); with b the smaller one this is (bᵀ·a)ᵀ."""
  if a_MxK.size <= b_MxN.size:
    return jnp.dot(row_major(a_MxK.T), b_MxN, preferred_element_type=jnp.float32)
  return row_major(jnp.dot(row_major(b_MxN.T), a_MxK, preferred_element_type=jnp.float32)).T


def _dot(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """x·W, float32 accumulation. A few rows of bf16 (a decode step) times a large W are
  computed as x·(Wᵀ)ᵀ from a row-major [N, K] copy: XLA:CPU's bf16 kernels stream weights
  from memory faster in that form (`python bench/bench_matmul_layouts.py --few_rows`). In
  the decode loop the copy is loop-invariant, so XLA makes it once per call. Matrices with
  a side under 512 (the `small` preset's) stay in the L3 cache from step to step, and run
  at least as fast as they are."""
  if (x_MxK.shape[0] <= 32 and x_MxK.dtype.itemsize == 2 and min(w_KxN.shape) >= 512
      and jax.default_backend() == "cpu"):
    return dot_nt(x_MxK, row_major(w_KxN.T))
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_MxK: jax.Array, w_KxN: jax.Array, dtype: str = "float32") -> jax.Array:
  """x·W with `dtype` inputs and float32 accumulation and output, forward and backward."""
  return _dot(x_MxK.astype(dtype), w_KxN.astype(dtype))


def _matmul_fwd(x_MxK, w_KxN, dtype):
  x_c, w_c = x_MxK.astype(dtype), w_KxN.astype(dtype)
  y = _dot(x_c, w_c)
  # Empty arrays carry the input dtypes (dtypes themselves can't be residuals).
  return y, (x_c, w_c, jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))


def _matmul_bwd(dtype, res, g_MxN):
  x_c, w_c, x_like, w_like = res
  g_c = g_MxN.astype(dtype)
  return dot_nt(g_c, w_c).astype(x_like.dtype), dot_tn(x_c, g_c).astype(w_like.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dropout_keep_mask(rng: jax.Array, shape: Sequence[int], rate: float) -> jax.Array:
  """Boolean mask, True with probability 1 - rate, from a counter-based hash.

  One threefry draw seeds the call; each element's bits are murmur3's fmix32 of
  (its flat index · a + b). That is a few integer ops per element instead of threefry's
  ~100, the mask is the same however the array is sharded, and it is plenty random for
  dropout (tests check rate, independence between neighbours and between keys).
  """
  a, b = jax.random.bits(rng, (2,), jnp.uint32)
  n = int(np.prod(shape))
  h = jax.lax.iota(jnp.uint32, n).reshape(shape) * (a | jnp.uint32(1)) + b
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return h >= jnp.uint32(min(int(round(rate * 2.0 ** 32)), 2 ** 32 - 1))


class Dropout(nn.Module):
  """Inverted dropout: zero each element with probability `rate`, scale the rest by
  1/(1 - rate). Identity when not training."""
  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    keep = dropout_keep_mask(self.make_rng("dropout"), x.shape, self.rate)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - self.rate), x.dtype),
                     jnp.zeros((), x.dtype))


def _shape(n: int | Sequence[int]) -> tuple[int, ...]:
  return (n,) if isinstance(n, int) else tuple(n)


class Dense(nn.Module):
  """y = x·W (+ b): the last axes of x (shape `in_features`) contracted into `features`."""
  in_features: int | Sequence[int]
  features: int | Sequence[int]
  use_bias: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"

  def setup(self):
    fan_in, fan_out = int(np.prod(self.in_features)), int(np.prod(self.features))
    init = lambda key, shape, dtype: nn.initializers.xavier_uniform()(
        key, (fan_in, fan_out), dtype).reshape(shape)
    self.kernel = self.param("kernel", init, _shape(self.in_features) + _shape(self.features),
                             self.param_dtype)
    self.bias = (self.param("bias", nn.initializers.zeros, _shape(self.features),
                            self.param_dtype) if self.use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    return dense_group(x, [self])[0]


def dense_group(x: jax.Array, denses: Sequence[Dense]) -> list[jax.Array]:
  """Dense layers that read the same x, applied as ONE matmul over their concatenated
  kernels (one big matmul runs closer to peak than several small ones); returns each
  layer's own output. Parameters stay per layer, so checkpoints don't change."""
  n_in = len(_shape(denses[0].in_features))
  fan_in = int(np.prod(x.shape[x.ndim - n_in:]))
  w = jnp.concatenate([d.kernel.reshape(fan_in, -1) for d in denses], axis=1)
  y = matmul(x.reshape(-1, fan_in), w, denses[0].dtype)
  if any(d.use_bias for d in denses):
    y = y + jnp.concatenate([d.bias.reshape(-1) if d.use_bias else
                             jnp.zeros((int(np.prod(d.features)),), d.param_dtype)
                             for d in denses])
  # lax.split, not slices: its gradient is one concatenate, where slices' is a zero-padded
  # full-width copy per layer, summed.
  parts = jax.lax.split(y, [int(np.prod(d.features)) for d in denses], axis=1)
  return [p.reshape(x.shape[:x.ndim - n_in] + _shape(d.features)) for p, d in zip(parts, denses)]


class Embed(nn.Module):
  """Token embedding scaled by √d_model; `attend` is the tied output projection x·Eᵀ."""
  vocab_size: int
  d_model: int
  dtype: str = "float32"
  param_dtype: str = "float32"

  def setup(self):
    self.embedding = self.param(
        "embedding", nn.initializers.normal(stddev=self.d_model ** -0.5),
        (self.vocab_size, self.d_model), self.param_dtype)

  def __call__(self, ids_BxL: jax.Array) -> jax.Array:
    return jnp.take(self.embedding, ids_BxL, axis=0).astype(jnp.float32) * np.sqrt(self.d_model)

  def attend(self, y_BxLxD: jax.Array) -> jax.Array:
    return jnp.einsum("bld,vd->blv", y_BxLxD.astype(self.dtype),
                      self.embedding.astype(self.dtype), preferred_element_type=jnp.float32)


class MultiHeadAttention(nn.Module):
  """Project to heads, attend, concatenate heads, project back (self or cross).

  Keys and values come out head-major, [B, H, K, Dh], in the compute dtype: what a KV
  cache stores, so that a decode step reads them without a transpose.
  """
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    heads = (cfg.num_heads, cfg.head_dim)
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.query = Dense(cfg.d_model, heads, **kw)
    # No key bias: q·(k + b) shifts every score of a query by the same q·b, which softmax
    # ignores, so that bias would only ever get a (numerically noisy) zero gradient.
    self.key = Dense(cfg.d_model, heads, use_bias=False, **kw)
    self.value = Dense(cfg.d_model, heads, **kw)
    self.out = Dense(heads, cfg.d_model, **kw)

  def _heads_major(self, y_BxLxHxDh):
    return y_BxLxHxDh.astype(self.config.dtype).transpose(0, 2, 1, 3)

  def project_q(self, x_BxQxD):
    return self.query(x_BxQxD).astype(self.config.dtype)          # [B, Q, H, Dh]

  def project_kv(self, x_BxKxD):
    """(keys, values), each [B, H, K, Dh], from one matmul."""
    return tuple(map(self._heads_major, dense_group(x_BxKxD, [self.key, self.value])))

  def project_qkv(self, x_BxLxD):
    """Self-attention: queries [B, L, H, Dh], keys and values [B, H, L, Dh], one matmul."""
    q, k, v = dense_group(x_BxLxD, [self.query, self.key, self.value])
    return q.astype(self.config.dtype), self._heads_major(k), self._heads_major(v)

  def attend(self, q_BxQxHxDh, k_BxHxKxDh, v_BxHxKxDh, mask=None, train: bool = False):
    cfg = self.config
    rate = cfg.attention_dropout_rate if train else 0.0
    rng = self.make_rng("dropout") if rate > 0.0 else None
    y_BxQxHxDh = dot_product_attention(q_BxQxHxDh, k_BxHxKxDh, v_BxHxKxDh, mask,
                                       dropout_rate=rate, dropout_rng=rng, kv_layout="BHKD")
    return self.out(y_BxQxHxDh)

  def __call__(self, x_BxQxD, x_BxKxD, mask=None, train: bool = False):
    if x_BxQxD is x_BxKxD:
      return self.attend(*self.project_qkv(x_BxQxD), mask, train)
    return self.attend(self.project_q(x_BxQxD), *self.project_kv(x_BxKxD), mask, train)


class FeedForward(nn.Module):
  """FFN(x) = max(0, x·W1 + b1)·W2 + b2."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, train: bool = False) -> jax.Array:
    cfg = self.config
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    h_BxLxF = nn.relu(Dense(cfg.d_model, cfg.d_ff, name="wi", **kw)(x_BxLxD))
    h_BxLxF = Dropout(cfg.ffn_dropout_rate)(h_BxLxF, deterministic=not train)
    return Dense(cfg.d_ff, cfg.d_model, name="wo", **kw)(h_BxLxF)


class AddNorm(nn.Module):
  """Residual connection around a sublayer, with dropout and LayerNorm.

  post-LN (paper): LayerNorm(x + Dropout(Sublayer(x)))
  pre-LN:          x + Dropout(Sublayer(LayerNorm(x)))
  """
  config: TransformerConfig

  def setup(self):
    self.norm = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32,
                             param_dtype=self.config.param_dtype)
    self.dropout = Dropout(self.config.dropout_rate)

  def __call__(self, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array],
               train: bool = False) -> jax.Array:
    if self.config.pre_ln:
      return x + self.dropout(sublayer(self.norm(x)), deterministic=not train)
    return self.norm(x + self.dropout(sublayer(x), deterministic=not train))


class EncoderLayer(nn.Module):
  """Self-attention → Add & Norm → FFN → Add & Norm."""
  config: TransformerConfig

  def setup(self):
    self.self_attn = MultiHeadAttention(self.config)
    self.self_attn_norm = AddNorm(self.config)
    self.ffn = FeedForward(self.config)
    self.ffn_norm = AddNorm(self.config)

  def __call__(self, x_BxSxD, mask, train: bool = False):
    x_BxSxD = self.self_attn_norm(x_BxSxD, lambda h: self.self_attn(h, h, mask, train), train)
    return self.ffn_norm(x_BxSxD, lambda h: self.ffn(h, train), train)


class DecoderLayer(nn.Module):
  """Masked self-attention → Add & Norm → cross-attention → Add & Norm → FFN → Add & Norm.

  `cross_kv` are the encoder output's keys/values for this layer (projected once per
  source). With `cache` ({"k", "v"}: [B, H, max_len, Dh]) the new self-attention keys and
  values are written at `index` and attention reads the whole cache (decoding).
  """
  config: TransformerConfig

  def setup(self):
    self.self_attn = MultiHeadAttention(self.config)
    self.self_attn_norm = AddNorm(self.config)
    self.cross_attn = MultiHeadAttention(self.config)
    self.cross_attn_norm = AddNorm(self.config)
    self.ffn = FeedForward(self.config)
    self.ffn_norm = AddNorm(self.config)

  def __call__(self, y_BxTxD, cross_kv, self_mask, cross_mask, train: bool = False,
               cache: dict | None = None, index: jax.Array | int = 0):
    new_cache = cache

    def masked_self_attention(h_BxTxD):
      nonlocal new_cache
      q, k, v = self.self_attn.project_qkv(h_BxTxD)
      if cache is not None:
        k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, 0, index, 0))
        v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, 0, index, 0))
        new_cache = {"k": k, "v": v}
      return self.self_attn.attend(q, k, v, self_mask, train)

    def cross_attention(h_BxTxD):
      return self.cross_attn.attend(self.cross_attn.project_q(h_BxTxD), *cross_kv, cross_mask,
                                    train)

    y_BxTxD = self.self_attn_norm(y_BxTxD, masked_self_attention, train)
    y_BxTxD = self.cross_attn_norm(y_BxTxD, cross_attention, train)
    y_BxTxD = self.ffn_norm(y_BxTxD, lambda h: self.ffn(h, train), train)
    return y_BxTxD, new_cache
