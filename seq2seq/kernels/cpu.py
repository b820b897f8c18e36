"""The XLA:CPU fast layer: what exists for speed on CPUs, each piece equal to its reference
(kernels/reference.py, attention.dot_product_attention; tests/test_kernels.py).

Two facts of XLA:CPU behind most of it (docs/performance.md, "What makes it fast"):
  * a dot that reads a strided (transposed) operand, or contracts the rows of its left one,
    runs in float32 through Eigen instead of the fast YNNPACK kernels: 2x slower in bf16.
    So transposes that feed dots are made real row-major copies (`row_major`), and the
    backward matmuls are written out to contract the right axes.
  * autodiff of a bf16 matmul feeds the backward dots a float32 gradient; casting it to bf16
    first puts all three matmuls of a layer on the bf16 units.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from seq2seq import native_build
from seq2seq.kernels import native, reference


def row_major(a: jax.Array) -> jax.Array:
  """`a` stored row-major: a transpose becomes a real copy instead of a strided view."""
  if jax.default_backend() != "cpu" or not isinstance(a, jax.core.Tracer):
    return a          # (eager arrays are already row-major)
  return with_layout_constraint(a, Layout(tuple(range(a.ndim))))


# --- matmuls --------------------------------------------------------------------------------

def dot_nt(a_MxN: jax.Array, b_KxN: jax.Array) -> jax.Array:
  """a·bᵀ [M, K], float32 accumulation, contracting the last axes (no transposed copy)."""
  return lax.dot_general(a_MxN, b_KxN, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def dot_tn(a_MxK: jax.Array, b_MxN: jax.Array) -> jax.Array:
  """aᵀ·b [K, N], float32 accumulation: the weight gradient xᵀ·g. The smaller operand is
  transposed into a row-major copy first; with b the smaller one this is (bᵀ·a)ᵀ."""
  if a_MxK.size <= b_MxN.size:
    return jnp.dot(row_major(a_MxK.T), b_MxN, preferred_element_type=jnp.float32)
  return row_major(jnp.dot(row_major(b_MxN.T), a_MxK, preferred_element_type=jnp.float32)).T


def _dot(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """x·W, float32 accumulation. A few rows of bf16 (a decode step) times a large W run as
  x·(Wᵀ)ᵀ from a row-major [N, K] copy, which XLA:CPU's bf16 kernels stream faster; in the
  decode loop the copy is loop-invariant, made once per call. Matrices with a side under
  512 stay in cache from step to step and run as they are."""
  if x_MxK.shape[0] <= 32 and x_MxK.dtype.itemsize == 2 and min(w_KxN.shape) >= 512:
    return dot_nt(x_MxK, row_major(w_KxN.T))
  return jnp.dot(x_MxK, w_KxN, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_MxK: jax.Array, w_KxN: jax.Array, dtype: str = "float32") -> jax.Array:
  """x·W with `dtype` inputs and float32 accumulation and output, forward and backward. x is
  made row-major after its cast, so that a transposed x is copied in the compute dtype and
  whatever computes x (a bias and ReLU) fuses with the cast."""
  return _dot(row_major(x_MxK.astype(dtype)), w_KxN.astype(dtype))


def _matmul_fwd(x_MxK, w_KxN, dtype):
  x_c, w_c = row_major(x_MxK.astype(dtype)), w_KxN.astype(dtype)
  # Empty arrays carry the input dtypes (dtypes themselves can't be residuals).
  return _dot(x_c, w_c), (x_c, w_c, jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_KxN.dtype))


def _matmul_bwd(dtype, res, g_MxN):
  x_c, w_c, x_like, w_like = res
  g_c = row_major(g_MxN.astype(dtype))
  return dot_nt(g_c, w_c).astype(x_like.dtype), dot_tn(x_c, g_c).astype(w_like.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x_MxK, weights, dtype):
  """`reference.dense` as ONE matmul over the concatenated kernels (one large matmul runs
  closer to peak than several small ones); the parameters stay per layer."""
  w_KxN = jnp.concatenate([w for w, _ in weights], axis=1)
  y_MxN = matmul(x_MxK, w_KxN, dtype)
  if any(b is not None for _, b in weights):
    y_MxN = y_MxN + jnp.concatenate([jnp.zeros((w.shape[1],), jnp.float32) if b is None
                                     else b.astype(jnp.float32) for w, b in weights])
  # lax.split, not slices: its gradient is one concatenate, where slices' is a zero-padded
  # full-width copy per kernel, summed.
  return lax.split(y_MxN, [w.shape[1] for w, _ in weights], axis=1)


# --- attention ------------------------------------------------------------------------------

def _bdot(a, b, contract: tuple[int, int]):
  """Per (batch, head) matmul of [B, H, ., .] arrays, float32 accumulation."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((0, 1), (0, 1))),
                         preferred_element_type=jnp.float32)


def _softmax(s_BxHxQxK, mask):
  if mask is not None:
    s_BxHxQxK = jnp.where(mask, s_BxHxQxK, jnp.finfo(jnp.float32).min)
  w_BxHxQxK = jax.nn.softmax(s_BxHxQxK, axis=-1)
  return w_BxHxQxK if mask is None else jnp.where(mask, w_BxHxQxK, 0.0)


def _dropped(w_BxHxQxK, keep_BxHxQxK, rate):
  if keep_BxHxQxK is None:
    return w_BxHxQxK
  return jnp.where(keep_BxHxQxK, w_BxHxQxK / (1.0 - rate), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, keep_BxHxQxK, rate: float):
  """softmax(q·kᵀ)·v of scaled row-major q, k, v -> [B, H, Q, D] float32; its backward pass
  is written out so that each of its four matmuls reads row-major operands."""
  return _attend_fwd(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask, keep_BxHxQxK, rate)[0]


def _attend_fwd(q, k, v, mask, keep, rate):
  w_BxHxQxK = _softmax(_bdot(q, k, (3, 3)), mask)
  y_BxHxQxD = _bdot(_dropped(w_BxHxQxK, keep, rate).astype(v.dtype), v, (3, 2))
  return y_BxHxQxD, (q, k, v, mask, keep, w_BxHxQxK)


def _attend_bwd(rate, res, dy_BxHxQxD):
  q, k, v, mask, keep, w_BxHxQxK = res
  dy = row_major(dy_BxHxQxD.astype(v.dtype))
  wd_BxHxKxQ = row_major(_dropped(w_BxHxQxK, keep, rate).astype(v.dtype).swapaxes(2, 3))
  dv_BxHxKxD = _bdot(wd_BxHxKxQ, dy, (3, 2))
  dw_BxHxQxK = _dropped(_bdot(dy, v, (3, 3)), keep, rate)
  # softmax': ds = w ⊙ (dw - Σ_k dw·w); masked keys have w = 0, so they get no gradient.
  ds_BxHxQxK = w_BxHxQxK * (dw_BxHxQxK - jnp.sum(dw_BxHxQxK * w_BxHxQxK, -1, keepdims=True))
  ds = ds_BxHxQxK.astype(q.dtype)
  dq_BxHxQxD = _bdot(ds, k, (3, 2))
  dk_BxHxKxD = _bdot(row_major(ds.swapaxes(2, 3)), q, (3, 2))
  return (dq_BxHxQxD.astype(q.dtype), dk_BxHxKxD.astype(k.dtype), dv_BxHxKxD.astype(v.dtype),
          None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


DECODE_QUERIES = 16   # queries per row up to which attention is a decode step's


def _native() -> bool:
  """Whether the C++ decode attention runs here (a CPU backend, the kernel built); on a CPU
  without it, says once why."""
  if jax.default_backend() != "cpu":
    return False
  if not native.available():
    native_build.say_why_without("decoding's attention runs XLA's code, slower than the C++ "
                                 "kernel", native.unavailable_reason())
  return native.available()


@jax.custom_vjp
def _decode_attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask_BxQxK, rows_BxK):
  """`_attend` of a decode step by the C++ kernel (native.decode_attention), which reads
  keys and values once in their dtype (XLA converts bf16 ones to a float32 copy at every
  step), each key from row rows[b, j] if `rows_BxK` is not None (reference.key_rows).
  Differentiated (a train step of short rows), it is `_attend`, forward and backward."""
  return native.decode_attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask_BxQxK, rows_BxK)


def _decode_attend_fwd(q, k, v, mask, rows):
  k, v = _cached(k), _cached(v)
  if rows is not None:
    k, v = reference.key_rows(k, rows), reference.key_rows(v, rows)
  y, res = _attend_fwd(q, k, v, mask[:, None], None, 0.0)
  return y, (res, rows)


def _decode_attend_bwd(res, dy):
  res, rows = res
  dq, dk, dv = _attend_bwd(0.0, res, dy)[:3]
  if rows is not None:   # a key read by several rows gets the sum of their gradients
    at = (rows[:, None, :], jnp.arange(dk.shape[1])[None, :, None],
          jnp.arange(dk.shape[2])[None, None, :])
    dk, dv = (jnp.zeros_like(g).at[at].add(g) for g in (dk, dv))
  return dq, dk, dv, None, None


_decode_attend.defvjp(_decode_attend_fwd, _decode_attend_bwd)


def _decode_mask(mask, q_BxHxQxD, k_BxHxKxD):
  """`mask` as the kernel takes it, [1|B, 1|Q, K], or None if it has another form."""
  (b, _, q_len, _), k_len = q_BxHxQxD.shape, k_BxHxKxD.shape[2]
  if mask is None:
    return jnp.ones((1, 1, k_len), bool)
  if (mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, b)
      and mask.shape[2] in (1, q_len) and mask.shape[3] == k_len):
    return mask[:, 0]
  return None


def attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, *, dropout_rate: float = 0.0,
              dropout_rng=None, key_rows=None):
  """`attention.dot_product_attention` with q scaled before the scores (a [Q, D] multiply,
  not [Q, K]) and row-major operands forward and backward. A decode step (bf16 or float32
  keys, read in place or through `key_rows`: reference.key_rows) goes to the C++ kernel
  where it could be built: it reads the keys once and skips those a query may not see."""
  keep = None
  if dropout_rate > 0.0 and dropout_rng is not None:
    shape = q_BxHxQxD.shape[:3] + k_BxHxKxD.shape[2:3]
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
  dtype = q_BxHxQxD.dtype
  scale = jnp.asarray(q_BxHxQxD.shape[-1] ** -0.5, dtype)
  keys_dtype = jnp.bfloat16 if k_BxHxKxD.dtype == BF16_BITS else k_BxHxKxD.dtype
  q_BxHxQxD = (q_BxHxQxD * scale).astype(keys_dtype)   # float32 keys: see cache_dtype
  if q_BxHxQxD.shape[2] <= DECODE_QUERIES and keep is None and _native() and (
      keys_dtype in (jnp.bfloat16, jnp.float32)):
    mask_BxQxK = _decode_mask(mask, q_BxHxQxD, k_BxHxKxD)
    if mask_BxQxK is not None:   # (the kernel reads BF16_BITS as bf16: no copy)
      return _decode_attend(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask_BxQxK,
                            key_rows).astype(dtype)
  k_BxHxKxD, v_BxHxKxD = _cached(k_BxHxKxD), _cached(v_BxHxKxD)
  if key_rows is not None:
    k_BxHxKxD = reference.key_rows(k_BxHxKxD, key_rows)
    v_BxHxKxD = reference.key_rows(v_BxHxKxD, key_rows)
  if 1 not in q_BxHxQxD.shape[1:3]:   # one query (a decode step) or one head: any layout is
    q_BxHxQxD = row_major(q_BxHxQxD)  # row-major already, and a constraint would copy it
  y_BxHxQxD = _attend(q_BxHxQxD, row_major(k_BxHxKxD), row_major(v_BxHxKxD), mask, keep,
                      float(dropout_rate))
  return y_BxHxQxD.astype(dtype)


def scan_unroll(n: int) -> int:
  """Every layer of a stack laid out in the train step (layout.layer_stack): XLA:CPU runs a
  loop over the layers ~20% slower (`small` bf16, 64 x 64 rows: 1.29 against 1.11 s a
  step) and compiles the loop no faster."""
  return n


# --- dropout ----------------------------------------------------------------------------------

def dropout_keep(rng: jax.Array, shape, rate: float) -> jax.Array:
  """True with probability 1 - rate, from a counter-based hash: one threefry draw seeds the
  call; each element's bits are murmur3's fmix32 of (its flat index · a + b). A few integer
  ops per element instead of threefry's ~100, the same mask however the array is sharded,
  and random enough for dropout (tests check rate, independence between neighbours and
  between keys)."""
  a, b = jax.random.bits(rng, (2,), jnp.uint32)
  n = int(np.prod(shape))
  h = lax.iota(jnp.uint32, n).reshape(shape) * (a | jnp.uint32(1)) + b
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return h >= jnp.uint32(min(int(round(rate * 2.0 ** 32)), 2 ** 32 - 1))


# --- search -----------------------------------------------------------------------------------

def argmax(x_NxV):
  """jnp.argmax over the last axis (first maximum) as a max and a min: about twice as fast
  on XLA:CPU, whose argmax reduction is not vectorised."""
  best = jnp.max(x_NxV, axis=-1, keepdims=True)
  vocab = x_NxV.shape[-1]
  return jnp.min(jnp.where(x_NxV == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def top_k(x_NxV, k: int, chunk: int = 64):
  """lax.top_k over the last axis. A long axis is cut into chunks of `chunk`: the k best
  entries lie in the k chunks with the best maxima, so a max pass and a top-k over
  k * chunk candidates give the same values (ties aside, the same indices) as one top-k
  over the whole vocabulary, which XLA:CPU runs 3-5x slower."""
  n, vocab = x_NxV.shape
  if vocab <= 4 * k * chunk:
    return lax.top_k(x_NxV, k)
  pad = -vocab % chunk
  x_NxCxW = jnp.pad(x_NxV, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(n, -1, chunk)
  _, best_chunks_Nxk = lax.top_k(jnp.max(x_NxCxW, axis=-1), k)
  cand_NxkW = jnp.take_along_axis(x_NxCxW, best_chunks_Nxk[:, :, None], axis=1,
                                  mode="clip").reshape(n, k * chunk)
  values, j = lax.top_k(cand_NxkW, k)
  return values, jnp.take_along_axis(best_chunks_Nxk, j // chunk, axis=1) * chunk + j % chunk


def top_k_logsumexp(x_NxV, k: int):
  """reference.top_k_logsumexp: in C++ where built (native.top_k_logsumexp: each row read
  once, ~2x), else `top_k` and XLA's logsumexp."""
  if _native():
    return native.top_k_logsumexp(x_NxV, k)
  values_Nxk, ids_Nxk = top_k(x_NxV, k)
  return values_Nxk, ids_Nxk, jax.nn.logsumexp(x_NxV, axis=-1)


# --- decoding ---------------------------------------------------------------------------------

def decode_params(cfg, params):
  """The weight matrices in the compute dtype: decoding a few rows at a time is bound by
  reading the weights, so a bf16 model decodes from bf16 copies, made once per decode call
  (or once for many, by `translate`). Embedding tables keep their dtype: they are only
  looked up (XLA:CPU would widen a whole bf16 table to f32 for each call's lookups); the
  head makes its own copy (`decode_head`). Params already cast come back as they are."""
  def done(path, x):
    return x.ndim < 2 or getattr(path[-1], "key", None) == "embedding" or x.dtype == cfg.dtype
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return params if all(done(path, x) for path, x in leaves) else _cast_matrices(cfg, params)


@functools.partial(jax.jit, static_argnums=0)
def _cast_matrices(cfg, params):
  def cast(path, x):
    name = getattr(path[-1], "key", None)
    return x if x.ndim < 2 or name == "embedding" else x.astype(cfg.dtype)
  return jax.tree_util.tree_map_with_path(cast, params)


def decode_head(w, b_V, w_is_VxD: bool, dtype):
  """The output head of a decode step as a function y [N, D] -> logits [N, V], its weights
  laid out once per decode call as a row-major [D, V] matrix in the compute dtype, so that
  every step is a plain [N, D]·[D, V] dot: XLA:CPU's own dot emitter runs the tied
  [V, D]ᵀ form ~3x slower."""
  w_DxV = row_major((w.T if w_is_VxD else w).astype(dtype))

  @jax.named_scope("output_head")
  def head(y_NxD):
    logits_NxV = jnp.dot(y_NxD.astype(dtype), w_DxV, preferred_element_type=jnp.float32)
    return logits_NxV if b_V is None else logits_NxV + b_V.astype(jnp.float32)
  return head


BF16_BITS = jnp.uint16   # a bf16 cache stored as its bits (cache_dtype)


def cache_store(x, dtype):
  """`reference.cache_store`, and bf16 values as BF16_BITS."""
  if dtype == BF16_BITS:
    return lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
  return x.astype(dtype)


def _cached(x):
  """Keys or values as attention reads them: a BF16_BITS cache as the bf16 it holds."""
  return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def cache_dtype(cfg):
  """How the decode slots keep keys and values (their self-attention ring and the cross-
  attention keys), which change from step to step, and the fixed loop a self-attention
  cache that stays in place where the C++ attention reads it (beam_rows):
  * bf16 compute, where the C++ decode attention reads them: bf16 as its bits (BF16_BITS,
    cache_store). XLA:CPU writes and scatters into a bf16 array through a float32 copy of
    all of it (a ring's column: ~75 us per layer and step); an integer array
    is updated in place;
  * otherwise float32 (bf16 values, exactly, without the kernel): XLA:CPU runs a bf16
    attention dot on a float32 copy of its operands, made at every step for keys that
    change."""
  if cfg.dtype != "bfloat16":
    return jnp.dtype(jnp.float32)
  return jnp.dtype(BF16_BITS if _native() else jnp.float32)


def beam_rows(cfg) -> bool:
  """Beam search reads each hypothesis's keys where its ancestors wrote them (the C++ decode
  attention through a table of rows) rather than moving every beam's cache each step."""
  return _native()


# XLA:CPU options for the float32 decode loop. An empty list of YNNPACK fusion kinds hands the
# loop's few-row dots to XLA's own dot emitter: faster on CPUs without AVX-512 (greedy 1.16-
# 1.46x, beam 4 1.00-1.14x on an AVX2 Zen 3), slower on AVX-512 ones (0.91-0.94x); training
# and bfloat16 keep the defaults. Figures: docs/performance.md; `bench_decode.py --f32_dots`
# compares the two on a new machine.
XLA_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}
F32_DOTS = "auto"   # or "xla" (XLA_DOTS) or "ynnpack" (XLA's defaults): for benchmarks


def cpu_has_avx512(cpuinfo: str | None = None) -> bool:
  """Whether the CPU lists avx512f among its flags (Linux's /proc/cpuinfo; False where that
  cannot be read)."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    except OSError:
      return False
  return any(line.startswith("flags") and "avx512f" in line.split()
             for line in cpuinfo.splitlines())


@functools.cache
def _this_cpu_has_avx512() -> bool:
  return cpu_has_avx512()


def decode_compiler_options(cfg) -> dict:
  """The XLA:CPU options of the decode loop of `cfg`: XLA_DOTS or {} (XLA's defaults)."""
  if F32_DOTS not in ("auto", "xla", "ynnpack"):
    raise ValueError(f"F32_DOTS must be auto, xla or ynnpack, got {F32_DOTS!r}")
  if cfg.dtype != "float32" or jax.default_backend() != "cpu":
    return {}
  if F32_DOTS == "auto":
    return {} if _this_cpu_has_avx512() else XLA_DOTS
  return XLA_DOTS if F32_DOTS == "xla" else {}
