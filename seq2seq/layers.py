"""The pieces the paper names, each a small linen module or function.

Mixed precision: parameters live in `param_dtype`; matmul inputs are cast to `dtype` and
accumulate in float32 (`preferred_element_type`), so the residual stream, LayerNorm and
softmax stay float32. With dtype=float32 this is plain f32 everywhere.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from seq2seq.attention import dot_product_attention
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


class Dense(nn.Module):
  """y = x·W (+ b) contracting the last `contract` axes of x into `features`."""
  features: int | Sequence[int]
  contract: int = 1
  use_bias: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    feats = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    in_shape = x.shape[-self.contract:]
    fan_in, fan_out = int(np.prod(in_shape)), int(np.prod(feats))
    init = lambda key, shape, dtype: nn.initializers.xavier_uniform()(
        key, (fan_in, fan_out), dtype).reshape(shape)
    kernel = self.param("kernel", init, in_shape + feats, self.param_dtype)
    y = jnp.tensordot(x.astype(self.dtype), kernel.astype(self.dtype), axes=self.contract,
                      preferred_element_type=jnp.float32)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, feats, self.param_dtype)
    return y


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
  """Project to heads, attend, concatenate heads, project back (self or cross)."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    heads = (cfg.num_heads, cfg.head_dim)
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    self.query = Dense(heads, **kw)
    # No key bias: q·(k + b) shifts every score of a query by the same q·b, which softmax
    # ignores, so that bias would only ever get a (numerically noisy) zero gradient.
    self.key = Dense(heads, use_bias=False, **kw)
    self.value = Dense(heads, **kw)
    self.out = Dense(cfg.d_model, contract=2, **kw)

  def project_kv(self, x_BxKxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values [B, K, H, Dh] in the compute dtype (what a cache stores)."""
    dt = self.config.dtype
    return self.key(x_BxKxD).astype(dt), self.value(x_BxKxD).astype(dt)

  def attend(self, x_BxQxD, k_BxKxHxDh, v_BxKxHxDh, mask=None, train: bool = False):
    cfg = self.config
    q_BxQxHxDh = self.query(x_BxQxD).astype(cfg.dtype)
    rate = cfg.attention_dropout_rate if train else 0.0
    rng = self.make_rng("dropout") if rate > 0.0 else None
    y_BxQxHxDh = dot_product_attention(q_BxQxHxDh, k_BxKxHxDh, v_BxKxHxDh, mask,
                                       dropout_rate=rate, dropout_rng=rng)
    return self.out(y_BxQxHxDh)

  def __call__(self, x_BxQxD, x_BxKxD, mask=None, train: bool = False):
    return self.attend(x_BxQxD, *self.project_kv(x_BxKxD), mask, train)


class FeedForward(nn.Module):
  """FFN(x) = max(0, x·W1 + b1)·W2 + b2."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, train: bool = False) -> jax.Array:
    cfg = self.config
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    h_BxLxF = nn.relu(Dense(cfg.d_ff, name="wi", **kw)(x_BxLxD))
    h_BxLxF = nn.Dropout(cfg.dropout_rate)(h_BxLxF, deterministic=not train)
    return Dense(cfg.d_model, name="wo", **kw)(h_BxLxF)


class AddNorm(nn.Module):
  """Residual connection around a sublayer, with dropout and LayerNorm.

  post-LN (paper): LayerNorm(x + Dropout(Sublayer(x)))
  pre-LN:          x + Dropout(Sublayer(LayerNorm(x)))
  """
  config: TransformerConfig

  def setup(self):
    self.norm = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32,
                             param_dtype=self.config.param_dtype)
    self.dropout = nn.Dropout(self.config.dropout_rate)

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
  source). With `cache` ({"k", "v"}: [B, max_len, H, Dh]) the new self-attention keys and
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

  def cross_kv(self, encoded_BxSxD):
    return self.cross_attn.project_kv(encoded_BxSxD)

  def __call__(self, y_BxTxD, cross_kv, self_mask, cross_mask, train: bool = False,
               cache: dict | None = None, index: jax.Array | int = 0):
    new_cache = cache

    def masked_self_attention(h_BxTxD):
      nonlocal new_cache
      k, v = self.self_attn.project_kv(h_BxTxD)
      if cache is not None:
        k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, index, 0, 0))
        v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, index, 0, 0))
        new_cache = {"k": k, "v": v}
      return self.self_attn.attend(h_BxTxD, k, v, self_mask, train)

    y_BxTxD = self.self_attn_norm(y_BxTxD, masked_self_attention, train)
    y_BxTxD = self.cross_attn_norm(
        y_BxTxD, lambda h: self.cross_attn.attend(h, *cross_kv, cross_mask, train), train)
    y_BxTxD = self.ffn_norm(y_BxTxD, lambda h: self.ffn(h, train), train)
    return y_BxTxD, new_cache
