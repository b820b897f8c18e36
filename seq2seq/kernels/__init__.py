"""The switch between the reference path and the fast layer: `model.kernels`.

The model calls a few operations through a `Kernels` table and does not know which
implementation answers. Every table computes the same function (tests/test_kernels.py):

  reference    plain JAX, the paper as written (attention.py, kernels/reference.py, and the
               train step's logits -> losses.cross_entropy)
  cpu          XLA:CPU speed work (kernels/cpu.py, kernels/cpu_head.py): matmuls with a bf16
               backward and row-major layouts, one matmul for Q, K and V, the fused output
               head + loss, hash dropout masks, chunked top-k, decode-loop options, and in
               C++ (kernels/native.py, built on first use where a C++ compiler is) a
               decode step's attention and beam search's top-k and logsumexp
  accelerator  the reference path with jax.nn.dot_product_attention (cuDNN flash attention
               on GPUs that have it) and the cpu table's hash dropout masks (a few integer
               ops per element, where threefry's bits compile to many kernels)
  auto         cpu on a CPU backend, accelerator on GPU and TPU

Parameters and checkpoints are the same whichever answers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from seq2seq.attention import dot_product_attention
from seq2seq.kernels import accelerator, cpu, cpu_head, reference

CHOICES = ("auto", "reference", "cpu", "accelerator")


@dataclasses.dataclass(frozen=True)
class Kernels:
  name: str
  # dense(x_MxK, [(w_KxN, b_N | None), ...], dtype) -> [y_MxN float32, ...]
  dense: Callable
  # attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, *, dropout_rate, dropout_rng,
  #           key_rows=None) -> BxHxQxD; key_rows [B, K]: key j of row b is row
  #           key_rows[b, j]'s (reference.key_rows)
  attention: Callable
  # dropout_keep(rng, shape, rate) -> bool array, True with probability 1 - rate
  dropout_keep: Callable
  # head_loss(y_BxTxD, w, b, targets, weights, *, label_smoothing, dtype, w_is_VxD)
  #   -> (loss_sum, correct_sum, weight_sum); None: the model's logits, then losses.py
  head_loss: Callable | None = None
  top_k: Callable = lax.top_k                     # (x_NxV, k) -> (values, indices)
  # (x_NxV, k) -> (values, indices, logsumexp of each row): beam search's use of the logits
  top_k_logsumexp: Callable = reference.top_k_logsumexp
  argmax: Callable = reference.argmax             # x_NxV -> int32 [N]
  # decode_params(cfg, params) -> params, made once per decode call
  decode_params: Callable = lambda cfg, params: params
  # decode_head(w, b, w_is_VxD, dtype) -> (y_NxD -> logits_NxV); None: the model's head
  decode_head: Callable | None = None
  decode_compiler_options: Callable = lambda cfg: {}   # cfg -> XLA options of the loop
  # cache_dtype(cfg) -> the dtype a cache that stays in place keeps keys and values in (the
  # decode slots'; the fixed loop's where beam_rows): their values are the compute dtype's,
  # whatever the storage; cache_store(x, dtype) -> x as that storage
  # (attention reads what it stores)
  cache_dtype: Callable = lambda cfg: cfg.dtype
  cache_store: Callable = reference.cache_store
  # beam_rows(cfg) -> whether beam search leaves the KV cache in place and reads each
  # hypothesis's keys through a table of rows (model.init_cache(rows=True)) instead of
  # moving every beam's cache to its new beam at each step
  beam_rows: Callable = lambda cfg: False
  # scan_unroll(n) -> how many of a stack's n layers (model.scan_layers) each iteration of
  # its compiled loop runs: 1 compiles the layer once; n lays every layer out in the program
  scan_unroll: Callable = lambda n: 1


def reading_rows(attention: Callable) -> Callable:
  """`attention` that also takes `key_rows` (reference.key_rows: gathered, then attended)."""
  def attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, *, key_rows=None, **kw):
    if key_rows is not None:
      k_BxHxKxD = reference.key_rows(k_BxHxKxD, key_rows)
      v_BxHxKxD = reference.key_rows(v_BxHxKxD, key_rows)
    return attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, **kw)
  return attend


def sharing_keys(attention: Callable) -> Callable:
  """`attention` that also takes r·B query rows for B key/value rows, rows b·r .. b·r + r - 1
  all reading row b (the beams of one source share one copy of its encoder keys and values):
  the r rows' queries are attended as one row of r·Q queries."""
  def attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, **kw):
    n, b = q_BxHxQxD.shape[0], k_BxHxKxD.shape[0]
    if n == b:
      return attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, **kw)
    if n % b:
      raise ValueError(f"query rows ({n}) must be a multiple of key/value rows ({b})")
    r, (_, h, q_len, d) = n // b, q_BxHxQxD.shape
    q = q_BxHxQxD.reshape(b, r, h, q_len, d).swapaxes(1, 2).reshape(b, h, r * q_len, d)
    if mask is not None and mask.shape[0] == n:   # [r·B, M, Q|1, K] -> [B, M, r·Q, K]
      m = jnp.broadcast_to(mask, (n, mask.shape[1], q_len, mask.shape[3]))
      mask = m.reshape(b, r, *m.shape[1:]).swapaxes(1, 2).reshape(b, m.shape[1], r * q_len, -1)
    y = attention(q, k_BxHxKxD, v_BxHxKxD, mask, **kw)
    return y.reshape(b, h, r, q_len, d).swapaxes(1, 2).reshape(n, h, q_len, d)
  return attend


REFERENCE = Kernels("reference", dense=reference.dense,
                    attention=sharing_keys(reading_rows(dot_product_attention)),
                    dropout_keep=reference.dropout_keep)
CPU = Kernels("cpu", dense=cpu.dense, attention=sharing_keys(cpu.attention),
              dropout_keep=cpu.dropout_keep, head_loss=cpu_head.head_loss, top_k=cpu.top_k,
              argmax=cpu.argmax, top_k_logsumexp=cpu.top_k_logsumexp,
              decode_params=cpu.decode_params, decode_head=cpu.decode_head,
              decode_compiler_options=cpu.decode_compiler_options, cache_dtype=cpu.cache_dtype,
              cache_store=cpu.cache_store, beam_rows=cpu.beam_rows,
              scan_unroll=cpu.scan_unroll)
ACCELERATOR = dataclasses.replace(REFERENCE, name="accelerator",
                                  attention=sharing_keys(reading_rows(accelerator.attention)),
                                  dropout_keep=cpu.dropout_keep)
_TABLES = {k.name: k for k in (REFERENCE, CPU, ACCELERATOR)}


def get(name: str) -> Kernels:
  """The table `name` answers with ("auto": by the default backend)."""
  if name == "auto":
    name = "cpu" if jax.default_backend() == "cpu" else "accelerator"
  if name not in _TABLES:
    raise ValueError(f"kernels must be one of {', '.join(CHOICES)}, got {name!r}")
  return _TABLES[name]
