"""The pieces the paper names (section 3), each a small linen module or function.

Mixed precision: parameters live in `param_dtype`; matmul inputs are cast to `dtype` and
accumulate in float32, so the residual stream, LayerNorm and softmax stay float32.
Matmuls, attention and dropout masks are computed by the `model.kernels` table
(seq2seq/kernels/): the reference table is plain JAX, the others compute the same.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from seq2seq import kernels
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


class Dropout(nn.Module):
  """Inverted dropout: zero each element with probability `rate`, scale the rest by
  1/(1 - rate). Identity when not training."""
  rate: float
  kernels: str = "reference"

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    keep = kernels.get(self.kernels).dropout_keep(self.make_rng("dropout"), x.shape, self.rate)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - self.rate), x.dtype),
                     jnp.zeros((), x.dtype))


def _shape(n: int | Sequence[int]) -> tuple[int, ...]:
  return (n,) if isinstance(n, int) else tuple(n)


class Dense(nn.Module):
  """y = x·W + b: the last axes of x (shape `in_features`) contracted into `features`."""
  config: TransformerConfig
  in_features: int | Sequence[int]
  features: int | Sequence[int]
  use_bias: bool = True

  def setup(self):
    fan_in, fan_out = int(np.prod(self.in_features)), int(np.prod(self.features))
    init = lambda key, shape, dtype: nn.initializers.xavier_uniform()(
        key, (fan_in, fan_out), dtype).reshape(shape)
    dtype = self.config.param_dtype
    self.kernel = self.param("kernel", init, _shape(self.in_features) + _shape(self.features),
                             dtype)
    self.bias = (self.param("bias", nn.initializers.zeros, _shape(self.features), dtype)
                 if self.use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    return dense_group(x, [self])[0]


def dense_group(x: jax.Array, denses: Sequence[Dense]) -> list[jax.Array]:
  """Each Dense of `denses` applied to the same x: [x·W + b for each]."""
  cfg, n_in = denses[0].config, len(_shape(denses[0].in_features))
  fan_in = int(np.prod(x.shape[x.ndim - n_in:]))
  weights = [(d.kernel.reshape(fan_in, -1), None if d.bias is None else d.bias.reshape(-1))
             for d in denses]
  ys = kernels.get(cfg.kernels).dense(x.reshape(-1, fan_in), weights, cfg.dtype)
  return [y.reshape(x.shape[:x.ndim - n_in] + _shape(d.features)) for y, d in zip(ys, denses)]


class Embed(nn.Module):
  """Token embedding scaled by √d_model; `attend` is the tied output projection y·Eᵀ."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.embedding = self.param("embedding", nn.initializers.normal(stddev=cfg.d_model ** -0.5),
                                (cfg.vocab_size, cfg.d_model), cfg.param_dtype)

  def __call__(self, ids_BxL: jax.Array) -> jax.Array:
    return (jnp.take(self.embedding, ids_BxL, axis=0).astype(jnp.float32)
            * np.sqrt(self.config.d_model))

  def attend(self, y_BxLxD: jax.Array) -> jax.Array:
    dtype = self.config.dtype
    return jnp.einsum("...d,vd->...v", y_BxLxD.astype(dtype), self.embedding.astype(dtype),
                      preferred_element_type=jnp.float32)


def split_heads(y_BxLxHxDh: jax.Array, dtype) -> jax.Array:
  """A projection's output, one slice per head, as [B, H, L, Dh] in the compute dtype."""
  return y_BxLxHxDh.astype(dtype).transpose(0, 2, 1, 3)


def merge_heads(y_BxHxLxDh: jax.Array) -> jax.Array:
  """Concat(head_1, ..., head_h) as [B, L, H, Dh], which the output projection reads whole."""
  return y_BxHxLxDh.transpose(0, 2, 1, 3)


class MultiHeadAttention(nn.Module):
  """MultiHead(Q, K, V) = Concat(head_1, ..., head_h)·W^O, head_i = Attention(Q·W_i^Q,
  K·W_i^K, V·W_i^V): self-attention (Q, K, V from one sequence) or cross-attention (Q from
  the decoder, K and V from the encoder output). Keys and values are [B, H, K, Dh]: what
  the KV cache stores."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    heads = (cfg.num_heads, cfg.head_dim)
    self.query = Dense(cfg, cfg.d_model, heads)
    # No key bias: q·(k + b) shifts every score of a query by the same q·b, which softmax
    # ignores, so that bias would only ever get a (numerically noisy) zero gradient.
    self.key = Dense(cfg, cfg.d_model, heads, use_bias=False)
    self.value = Dense(cfg, cfg.d_model, heads)
    self.out = Dense(cfg, heads, cfg.d_model)

  def project_q(self, x_BxQxD):
    return split_heads(self.query(x_BxQxD), self.config.dtype)

  def project_kv(self, x_BxKxD):
    """(keys, values), each [B, H, K, Dh]."""
    return tuple(split_heads(y, self.config.dtype)
                 for y in dense_group(x_BxKxD, [self.key, self.value]))

  def project_qkv(self, x_BxLxD):
    """Self-attention: queries, keys and values, each [B, H, L, Dh]."""
    return tuple(split_heads(y, self.config.dtype)
                 for y in dense_group(x_BxLxD, [self.query, self.key, self.value]))

  def attend(self, q_BxHxQxDh, k_BxHxKxDh, v_BxHxKxDh, mask=None, train: bool = False,
             key_rows=None):
    cfg = self.config
    rate = cfg.attention_dropout_rate if train else 0.0
    rng = self.make_rng("dropout") if rate > 0.0 else None
    y_BxHxQxDh = kernels.get(cfg.kernels).attention(
        q_BxHxQxDh, k_BxHxKxDh, v_BxHxKxDh, mask, dropout_rate=rate, dropout_rng=rng,
        key_rows=key_rows)
    return self.out(merge_heads(y_BxHxQxDh))

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
    h_BxLxF = nn.relu(Dense(cfg, cfg.d_model, cfg.d_ff, name="wi")(x_BxLxD))
    h_BxLxF = Dropout(cfg.ffn_dropout_rate, cfg.kernels)(h_BxLxF, deterministic=not train)
    return Dense(cfg, cfg.d_ff, cfg.d_model, name="wo")(h_BxLxF)


class AddNorm(nn.Module):
  """Residual connection around a sublayer, with dropout and LayerNorm.

  post-LN (paper): LayerNorm(x + Dropout(Sublayer(x)))
  pre-LN:          x + Dropout(Sublayer(LayerNorm(x)))
  """
  config: TransformerConfig

  def setup(self):
    self.norm = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32,
                             param_dtype=self.config.param_dtype)
    self.dropout = Dropout(self.config.dropout_rate, self.config.kernels)

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

  `memory` is the encoder output [B, S, D], or its keys and values for this layer's
  cross-attention (projected once per source: model.Decoder.cross_kv). With `cache`
  ({"k", "v"}: [B, H, max_len, Dh]) the new self-attention keys and values are written at
  `index` and attention reads the whole cache (decoding). A cache
  with "rows" ([B, max_len] int32, beam search) is not moved when hypotheses change beams:
  row b's slot j is read from the cache row rows[b, j], where its ancestor wrote it, and
  this step's slots are the rows' own.
  """
  config: TransformerConfig

  def setup(self):
    self.self_attn = MultiHeadAttention(self.config)
    self.self_attn_norm = AddNorm(self.config)
    self.cross_attn = MultiHeadAttention(self.config)
    self.cross_attn_norm = AddNorm(self.config)
    self.ffn = FeedForward(self.config)
    self.ffn_norm = AddNorm(self.config)

  def __call__(self, y_BxTxD, memory, self_mask, cross_mask, train: bool = False,
               cache: dict | None = None, index: jax.Array | int = 0):
    new_cache = cache

    def masked_self_attention(h_BxTxD):
      nonlocal new_cache
      q, k, v = self.self_attn.project_qkv(h_BxTxD)
      rows = None
      if cache is not None:
        store = kernels.get(self.config.kernels).cache_store   # as the cache keeps them
        k, v = (jax.lax.dynamic_update_slice(cache[n], store(x, cache[n].dtype),
                                             (0, 0, index, 0)) for n, x in (("k", k), ("v", v)))
        new_cache = {"k": k, "v": v}
        if "rows" in cache:   # this step's slots: in the rows' own
          own_BxT = jnp.broadcast_to(jnp.arange(k.shape[0], dtype=jnp.int32)[:, None],
                                     h_BxTxD.shape[:2])
          rows = jax.lax.dynamic_update_slice(cache["rows"], own_BxT, (0, index))
          new_cache["rows"] = rows
      return self.self_attn.attend(q, k, v, self_mask, train, rows)

    def cross_attention(h_BxTxD):
      k, v = memory if isinstance(memory, tuple) else self.cross_attn.project_kv(memory)
      return self.cross_attn.attend(self.cross_attn.project_q(h_BxTxD), k, v, cross_mask, train)

    y_BxTxD = self.self_attn_norm(y_BxTxD, masked_self_attention, train)
    y_BxTxD = self.cross_attn_norm(y_BxTxD, cross_attention, train)
    y_BxTxD = self.ffn_norm(y_BxTxD, lambda h: self.ffn(h, train), train)
    return y_BxTxD, new_cache
