"""Decoding a batch of token ids with the Transformer: the model behind search.py's loops.

One entry point, `decode(config, params, src_BxS, strategy, bos_id=, eos_id=)`, serves the
translation API, the training evaluation and the notebooks. Per call it runs ONE jitted
function: encode the source once, project each decoder layer's cross-attention keys and
values once, then search.py's loop feeds one token per step through
`Transformer.decode_step` with a preallocated self-attention KV cache ([rows, heads, slots,
head_dim], written in place), in phases whose caches grow (`search.cache_phases`), until
every row has finished. Compiled once per (batch, source length, max_len, strategy, ...);
params are an argument, never a closed-over constant, so a new checkpoint reuses the code.

Length limit: `max_len` if given, else each row's own source length (non-pad tokens) + 50
as in the paper (so a batch decodes exactly as each of its sources alone); never more than
`config.max_len`, the positions the model knows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from seq2seq import kernels
from seq2seq.config import TransformerConfig
from seq2seq.layout import head_weights, unroll_layers
from seq2seq.model import Transformer, init_cache
from seq2seq.search import (Beam, DecodeResult, Greedy, Sample, Strategy, _check, _is_int,
                            beam_search, sample_search)

__all__ = ["decode", "DecodeResult", "Greedy", "Sample", "Beam", "EXTRA_LEN"]

EXTRA_LEN = 50  # default length limit: source length + 50 (paper, section 6.1)


def _variables(params):
  return params if "params" in params else {"params": params}


def _repeat_rows(tree, n: int):
  return tree if n == 1 else jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), tree)


def transformer_tokens_to_logits(model: Transformer, variables, src_BxS, *, max_len: int,
                                 repeat: int = 1, pad_id: int = 0,
                                 full_recompute: bool = False, rows: bool = False,
                                 cache_dtype=None):
  """(tokens_to_logits, initial state) for B * repeat rows (row b * repeat + r decodes
  source b). Encodes the source and projects the cross-attention keys/values once.

  Cached: feeds one token per step to `decode_step`; the state is the KV cache (with
  `rows`, its table of rows; in `cache_dtype`, default the compute dtype: `init_cache`).
  full_recompute: the benchmark's baseline; re-runs the teacher-forced decoder on the whole
  [rows, max_len] buffer every step (causal masking makes it equal) and keeps no state.
  """
  if model.config.scan_layers:   # decode steps read one module per layer
    model, variables = decoding_model(model.config), unroll_layers(variables)
  cfg = model.config
  encoded_BxSxD = model.apply(variables, src_BxS, method=Transformer.encode)
  if full_recompute:
    encoded, src = _repeat_rows((encoded_BxSxD, src_BxS), repeat)

    def full_tokens_to_logits(seq_NxL1, index, state):
      logits_NxLxV = model.apply(variables, encoded, src, seq_NxL1[:, :max_len],
                                 method=Transformer.decode)
      return lax.dynamic_index_in_dim(logits_NxLxV, index, axis=1, keepdims=False), state

    return full_tokens_to_logits, ()

  # One copy per source: the `repeat` rows of a source share it (kernels.sharing_keys).
  cross_kv = model.apply(variables, encoded_BxSxD, method=Transformer.precompute_cross_kv)
  src_valid = src_BxS != pad_id
  make_head = kernels.get(cfg.kernels).decode_head
  if make_head is None:
    head = lambda y_NxD: model.apply(variables, y_NxD, method=Transformer.output_head)
  else:
    head = make_head(*head_weights(cfg, variables["params"]), cfg.dtype)

  def cached_tokens_to_logits(seq_NxL1, index, cache):
    tokens_Nx1 = lax.dynamic_slice_in_dim(seq_NxL1, index, 1, axis=1)
    y_Nx1xD, cache = model.apply(variables, tokens_Nx1, index, cache, cross_kv, src_valid,
                                 True, method=Transformer.decode_step)
    return head(y_Nx1xD[:, 0]), cache

  return cached_tokens_to_logits, init_cache(cfg, src_BxS.shape[0] * repeat, max_len,
                                             cache_dtype, rows=rows)


def resize_cache(cache, length: int):
  """The KV cache cut or zero-padded to `length` slots (a phase of the decode loop)."""
  def resize(x):   # keys and values [N, H, L, Dh], rows [N, L]
    axis = 2 if x.ndim == 4 else 1
    n = x.shape[axis]
    if n >= length:
      return lax.slice_in_dim(x, 0, length, axis=axis)
    return jnp.pad(x, [(0, length - n) if a == axis else (0, 0) for a in range(x.ndim)])
  return jax.tree_util.tree_map(resize, cache)


def decode_params(cfg: TransformerConfig, params):
  """The parameters as this config's kernels decode from them: one module per layer
  (layout.unroll_layers), and on the cpu kernels weight matrices cast once to the compute
  dtype. Callers that decode many batches make them once and pass them in; `decode` makes
  them otherwise."""
  return kernels.get(cfg.kernels).decode_params(cfg, _unrolled(params))


def _unrolled(params):
  """layout.unroll_layers, as one program where it has anything to do."""
  p = params.get("params", params)
  stacked = any("layers" in p.get(side, {}) for side in ("encoder", "decoder"))
  return _unroll_jit(params) if stacked else params


_unroll_jit = jax.jit(unroll_layers)


def decoding_model(cfg: TransformerConfig) -> Transformer:
  """The model decode steps run: one module per layer, whatever layout it trained in."""
  return Transformer(cfg.replace(scan_layers=False))


def _decode_impl(params, src_BxS, rng, *, cfg: TransformerConfig, strategy, max_len: int,
                 per_row_limit: bool, bos_id: int, eos_id: int, pad_id: int, min_len: int,
                 full_recompute: bool, return_logits: bool) -> DecodeResult:
  model, ops = decoding_model(cfg), kernels.get(cfg.kernels)
  batch = src_BxS.shape[0]
  params = ops.decode_params(cfg, unroll_layers(params))
  if per_row_limit:
    src_len_B = jnp.sum(src_BxS != pad_id, axis=1).astype(jnp.int32)
    limits_B = jnp.minimum(src_len_B + EXTRA_LEN, max_len)
  else:
    limits_B = jnp.full((batch,), max_len, jnp.int32)
  repeat = strategy.size if isinstance(strategy, Beam) else 1
  # Beam search moves every beam's cache at each step, unless the kernels read it through a
  # table of rows. Where they do, a cache that stays in place is stored as they keep one
  # best (cache_dtype: bf16 as its bits on the cpu kernels); XLA's own attention reads the
  # compute dtype faster in this loop (docs/performance.md, "Tried and left out").
  rows = repeat > 1 and not full_recompute and ops.beam_rows(cfg)
  in_place = ops.beam_rows(cfg) and (rows or repeat == 1)
  fn, state = transformer_tokens_to_logits(
      model, params, src_BxS, max_len=max_len, repeat=repeat, pad_id=pad_id,
      full_recompute=full_recompute, rows=rows,
      cache_dtype=ops.cache_dtype(cfg) if in_place else None)
  common = dict(batch_size=batch, max_len=max_len, limits_B=limits_B, bos_id=bos_id,
                eos_id=eos_id, pad_id=pad_id, min_len=min_len,
                resize_state=None if full_recompute else resize_cache)
  if isinstance(strategy, Beam):
    return beam_search(fn, state, beam=strategy, top_k_logsumexp=ops.top_k_logsumexp, **common)
  return sample_search(fn, state, strategy=strategy, rng=rng, return_logits=return_logits,
                       top_k=ops.top_k, argmax=ops.argmax, **common)


@functools.cache
def _decode_jit(options: tuple = ()):
  return jax.jit(_decode_impl, compiler_options=dict(options) or None, static_argnames=(
      "cfg", "strategy", "max_len", "per_row_limit", "bos_id", "eos_id", "pad_id",
      "min_len", "full_recompute", "return_logits"))


def decode_jit_for(cfg: TransformerConfig):
  """The jitted decode function `decode` calls for this config."""
  options = kernels.get(cfg.kernels).decode_compiler_options(cfg)
  return _decode_jit(tuple(sorted(options.items())))


def as_key(rng):
  """A PRNG key from None (seed 0, so runs are repeatable), an int seed, raw key data or a
  key."""
  if rng is None:
    return jax.random.key(0)
  if _is_int(rng):
    return jax.random.key(int(rng))
  rng = jnp.asarray(rng)
  return rng if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)


def decode(model_or_config: Transformer | TransformerConfig, params, src_BxS,
           strategy: Strategy = Greedy(), *, bos_id: int, eos_id: int,
           max_len: int | None = None, rng=None, pad_id: int = 0, min_len: int = 0,
           full_recompute: bool = False, return_logits: bool = False) -> DecodeResult:
  """Decodes a batch of sources. Returns a DecodeResult of numpy arrays (see its docstring:
  tokens [B, n, L] with n = 1 or n_best, scores [B, n], lengths [B, n]).

  params: the model's variables ({"params": ...}) or the bare params tree.
  src_BxS: int source ids, EOS-terminated, right-padded with pad_id (which must be 0: the
    model's masks treat id 0 as padding).
  max_len: output buffer length L and every row's limit; None = per row source length + 50,
    buffer S + 50; both capped at config.max_len.
  rng: key, raw key data or int seed for sampling (None = seed 0, so runs are repeatable).
  min_len: EOS is forbidden until a hypothesis would have this many tokens (EOS included).
  full_recompute: uncached baseline (benchmark only): same loop, whole decoder every step.
  return_logits: also return the raw logits of every step (greedy/sampling only).
  """
  import numpy as np
  cfg = model_or_config.config if isinstance(model_or_config, Transformer) else model_or_config
  _check(isinstance(cfg, TransformerConfig),
         f"decode needs a Transformer or TransformerConfig, got {type(cfg).__name__}")
  _check(isinstance(strategy, (Greedy, Sample, Beam)),
         f"strategy must be Greedy(), Sample(...) or Beam(...), got {strategy!r}")
  src_BxS = jnp.asarray(src_BxS)
  _check(src_BxS.ndim == 2 and jnp.issubdtype(src_BxS.dtype, jnp.integer),
         f"source must be a [batch, length] integer array, got {src_BxS.dtype}{src_BxS.shape}")
  batch, src_len = src_BxS.shape
  _check(batch > 0 and src_len > 0, f"empty source batch of shape {src_BxS.shape}")
  _check(src_len <= cfg.max_len, f"source length {src_len} exceeds the model's "
         f"max_len {cfg.max_len}")
  for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
    _check(_is_int(v) and 0 <= v < cfg.vocab_size,
           f"{name} must be a token id in [0, {cfg.vocab_size}), got {v!r}")
  _check(pad_id == 0, f"pad_id must be 0, the id the model masks as padding, got {pad_id}")
  _check(len({bos_id, eos_id, pad_id}) == 3,
         f"bos_id, eos_id and pad_id must differ, got {bos_id}, {eos_id}, {pad_id}")
  if max_len is None:
    max_len, per_row_limit = min(src_len + EXTRA_LEN, cfg.max_len), True
  else:
    _check(_is_int(max_len) and 1 <= max_len <= cfg.max_len,
           f"max_len must be in [1, {cfg.max_len}] (the model's max_len), got {max_len!r}")
    per_row_limit = False
  _check(_is_int(min_len) and min_len >= 0, f"min_len must be an integer >= 0, got {min_len!r}")
  _check(not isinstance(strategy, Beam) or strategy.size <= cfg.vocab_size,
         f"beam size {getattr(strategy, 'size', 0)} is larger than the vocabulary "
         f"({cfg.vocab_size} tokens)")
  _check(not (return_logits and isinstance(strategy, Beam)),
         "return_logits is only available for greedy and sampling")
  out = decode_jit_for(cfg)(
      _variables(params), src_BxS.astype(jnp.int32), as_key(rng), cfg=cfg,
      strategy=strategy, max_len=int(max_len), per_row_limit=per_row_limit,
      bos_id=int(bos_id), eos_id=int(eos_id), pad_id=int(pad_id), min_len=int(min_len),
      full_recompute=bool(full_recompute), return_logits=bool(return_logits))
  return DecodeResult(*(None if x is None else np.asarray(x) for x in out))
