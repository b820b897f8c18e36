"""The Transformer: encoder, decoder, output head. Token id 0 is padding.

Packed rows (several examples per row) pass `*_segments` (0 = padding, 1, 2, ... = example)
and `*_positions` (restart at 0 for each example); unpacked rows may omit both.
A stack's layers are one module per layer, or (scan_layers) traced once: layout.py.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from seq2seq import attention as attn
from seq2seq.config import TransformerConfig
from seq2seq.layers import (DecoderLayer, Dense, Dropout, Embed, EncoderLayer, add_positions,
                            dense_group, split_heads)
from seq2seq.layout import EncoderLayerStep, layer_stack


def _valid(tokens_BxL, segments_BxL):
  return (tokens_BxL != 0) if segments_BxL is None else (segments_BxL > 0)


def encoder_mask(src_BxS, src_segments=None):
  """[B, 1, S, S]: real source tokens attend to real source tokens of the same example."""
  valid = _valid(src_BxS, src_segments)
  seg = None if src_segments is None else attn.segment_mask(src_segments, src_segments)
  return attn.combine_masks(attn.padding_mask(valid, valid), seg)


def decoder_self_mask(tgt_in_BxT, tgt_segments=None):
  """[B, 1, T, T]: causal, real keys only, same example."""
  valid = _valid(tgt_in_BxT, tgt_segments)
  seg = None if tgt_segments is None else attn.segment_mask(tgt_segments, tgt_segments)
  return attn.combine_masks(attn.causal_mask(tgt_in_BxT.shape[1]),
                            attn.padding_mask(valid, valid), seg)


def cross_mask(tgt_in_BxT, src_BxS, tgt_segments=None, src_segments=None):
  """[B, 1, T, S]: target queries attend to the real source tokens of their own example."""
  tv, sv = _valid(tgt_in_BxT, tgt_segments), _valid(src_BxS, src_segments)
  seg = None if tgt_segments is None else attn.segment_mask(tgt_segments, src_segments)
  return attn.combine_masks(attn.padding_mask(tv, sv), seg)


class Encoder(nn.Module):
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.dropout = Dropout(cfg.dropout_rate, cfg.kernels)
    if cfg.scan_layers:
      self.layers = layer_stack(EncoderLayerStep, cfg, cfg.num_encoder_layers, 2)
    else:
      self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers)]
    if cfg.pre_ln:
      self.final_norm = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32, param_dtype=cfg.param_dtype)

  def __call__(self, x_BxSxD, mask, positions=None, train: bool = False):
    x_BxSxD = add_positions(x_BxSxD, self.config.max_len, positions)
    x_BxSxD = self.dropout(x_BxSxD, deterministic=not train)
    if self.config.scan_layers:
      x_BxSxD, _ = self.layers(x_BxSxD, mask, train)
    else:
      for layer in self.layers:
        x_BxSxD = layer(x_BxSxD, mask, train)
    return self.final_norm(x_BxSxD) if self.config.pre_ln else x_BxSxD


class Decoder(nn.Module):
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.dropout = Dropout(cfg.dropout_rate, cfg.kernels)
    if cfg.scan_layers:
      self.layers = layer_stack(DecoderLayer, cfg, cfg.num_decoder_layers, 4)
    else:
      self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]
    if cfg.pre_ln:
      self.final_norm = nn.LayerNorm(epsilon=1e-6, dtype=jnp.float32, param_dtype=cfg.param_dtype)

  def cross_kv(self, encoded_BxSxD):
    """Every layer's cross-attention (keys, values), [B, H, S, Dh] each: the encoder output
    projected for all layers in one matmul (one module per layer only)."""
    attns = [layer.cross_attn for layer in self.layers]
    kv = [split_heads(y, self.config.dtype) for y in
          dense_group(encoded_BxSxD, [d for a in attns for d in (a.key, a.value)])]
    return tuple(zip(kv[0::2], kv[1::2]))

  def __call__(self, y_BxTxD, memory, self_mask, cross_mask, positions=None,
               train: bool = False, cache=None, index=0):
    """`memory`: the encoder output [B, S, D], or (one module per layer) each layer's
    cross-attention keys and values (`cross_kv`)."""
    y_BxTxD = add_positions(y_BxTxD, self.config.max_len, positions, offset=index)
    y_BxTxD = self.dropout(y_BxTxD, deterministic=not train)
    new_cache = None
    if self.config.scan_layers:
      if cache is not None:
        raise ValueError("decode steps read one module per layer: layout.unroll_layers")
      y_BxTxD, _ = self.layers(y_BxTxD, memory, self_mask, cross_mask, train)
    else:
      new_cache = []
      for i, layer in enumerate(self.layers):
        y_BxTxD, c = layer(y_BxTxD, memory[i], self_mask, cross_mask, train,
                           None if cache is None else cache[i], index)
        new_cache.append(c)
    y_BxTxD = self.final_norm(y_BxTxD) if self.config.pre_ln else y_BxTxD
    return y_BxTxD, (None if cache is None else tuple(new_cache))


class Transformer(nn.Module):
  """Encoder-decoder Transformer. `apply(params, src, tgt_in)` -> logits [B, T, V]."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      self.embed = Embed(cfg)
    else:
      self.src_embed = Embed(cfg)
      self.tgt_embed = Embed(cfg)
    self.encoder = Encoder(cfg)
    self.decoder = Decoder(cfg)
    if not cfg.tie_output:
      self.logits_dense = Dense(cfg, cfg.d_model, cfg.vocab_size)

  def _src_embed(self):
    return self.embed if self.config.share_embeddings else self.src_embed

  def _tgt_embed(self):
    return self.embed if self.config.share_embeddings else self.tgt_embed

  def output_head(self, y_BxTxD):
    """Logits over the vocabulary (softmax is applied by the loss or the decoder)."""
    if self.config.tie_output:
      return self._tgt_embed().attend(y_BxTxD)
    return self.logits_dense(y_BxTxD)

  def encode(self, src_BxS, src_segments=None, src_positions=None, train: bool = False):
    """Encoder output [B, S, D] (float32)."""
    x_BxSxD = self._src_embed()(src_BxS)
    return self.encoder(x_BxSxD, encoder_mask(src_BxS, src_segments), src_positions, train)

  def decode(self, encoded_BxSxD, src_BxS, tgt_in_BxT, src_segments=None, tgt_segments=None,
             tgt_positions=None, train: bool = False, return_features: bool = False):
    """Teacher-forced decoder: logits [B, T, V] for every target position at once (or,
    with return_features, the decoder output [B, T, D] the head would project)."""
    y_BxTxD = self._tgt_embed()(tgt_in_BxT)
    memory = encoded_BxSxD if self.config.scan_layers else self.decoder.cross_kv(encoded_BxSxD)
    y_BxTxD, _ = self.decoder(
        y_BxTxD, memory,
        decoder_self_mask(tgt_in_BxT, tgt_segments),
        cross_mask(tgt_in_BxT, src_BxS, tgt_segments, src_segments), tgt_positions, train)
    return y_BxTxD if return_features else self.output_head(y_BxTxD)

  def __call__(self, src_BxS, tgt_in_BxT, src_segments=None, tgt_segments=None,
               src_positions=None, tgt_positions=None, train: bool = False,
               return_features: bool = False):
    encoded_BxSxD = self.encode(src_BxS, src_segments, src_positions, train)
    return self.decode(encoded_BxSxD, src_BxS, tgt_in_BxT, src_segments, tgt_segments,
                       tgt_positions, train, return_features)

  # --- incremental decoding (see seq2seq.decoding) --------------------------------------

  def precompute_cross_kv(self, encoded_BxSxD):
    """Each decoder layer's cross-attention keys/values, projected once per source."""
    return self.decoder.cross_kv(encoded_BxSxD)

  def decode_step(self, tokens_BxT, index, cache, cross_kv, src_valid_BxS,
                  return_features: bool = False, column=None):
    """Feeds `tokens` at positions index..index+T-1, reading/writing the KV `cache`.

    Returns (logits [B, T, V], new cache), or with return_features the decoder output
    [B, T, D] instead of the logits. Queries attend to cache slots <= their position.
    `cross_kv` and `src_valid` may have B / r rows, each shared by r consecutive rows of
    `tokens` (beams of one source).

    With `column` (a scalar; T = 1) the cache is a ring shared by rows that started at
    different steps: row b is at its own position index[b], its keys and values so far lie
    in the index[b] slots before `column` (mod the cache length), and this step's go to
    `column` for every row.
    """
    t = tokens_BxT.shape[1]
    max_len = cache[0]["k"].shape[2]
    if column is None:
      q_pos = index + jnp.arange(t)
      self_mask = (jnp.arange(max_len)[None, :] <= q_pos[:, None])[None, None]  # [1,1,T,L]
      positions, write_at = None, index
    else:
      back_L = (column - jnp.arange(max_len)) % max_len     # how many steps ago, per slot
      self_mask = (back_L <= index[:, None])[:, None, None, :]                   # [B,1,1,L]
      positions, write_at = index[:, None], column
    x_mask = src_valid_BxS[:, None, None, :]                                    # [B,1,1,S]
    y_BxTxD = self._tgt_embed()(tokens_BxT)
    y_BxTxD, cache = self.decoder(y_BxTxD, cross_kv, self_mask, x_mask, positions, False,
                                  cache, write_at)
    return (y_BxTxD if return_features else self.output_head(y_BxTxD)), cache


def init_cache(config: TransformerConfig, batch: int, max_len: int, dtype=None,
               rows: bool = False):
  """Empty self-attention KV cache: per decoder layer {"k", "v"} of [B, H, max_len, Dh], in
  `dtype` (default: the compute dtype), and with `rows` the table of the rows that hold
  each row's slots, [B, max_len] int32 (beam search: DecoderLayer, search.reorder_beams)."""
  shape = (batch, config.num_heads, max_len, config.head_dim)
  dtype = config.dtype if dtype is None else dtype
  table = {"rows": jnp.zeros((batch, max_len), jnp.int32)} if rows else {}
  return tuple({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), **table}
               for _ in range(config.num_decoder_layers))
