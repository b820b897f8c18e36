"""The C++ decode attention (kernels/native.py, decode_attention.cc) against NumPy, inside
the cpu kernels' attention (values, gradients, the decode loop's tokens), and its build:
cached, and a missing or failing compiler leaves XLA's own attention in place."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seq2seq.kernels import cpu, native

ROOT = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason=f"C++ kernel not built: {native.unavailable_reason()}")


def _numpy_attention(q, k, v, mask):
  """softmax(q·kᵀ)·v in float64 over the allowed keys; zeros for a query with none."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bhqd,bhkd->bhqk", q, k)
  m = np.broadcast_to(np.asarray(mask)[:, None], s.shape)
  s = np.where(m, s, -np.inf)
  top = np.max(s, -1, keepdims=True)
  w = np.where(m, np.exp(s - np.where(np.isfinite(top), top, 0)), 0.0)
  w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhqk,bhkd->bhqd", w, v)


def _inputs(rng, b, h, q_len, k_len, d, mask_shape, dtype):
  q = jnp.asarray(rng.normal(size=(b, h, q_len, d)) / np.sqrt(d), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, h, k_len, d)), dtype)
  v = jnp.asarray(rng.normal(size=(b, h, k_len, d)), dtype)
  mask = rng.random(mask_shape) < 0.7
  mask.reshape(-1, k_len)[0] = False          # a query with no key to attend
  return q, k, v, jnp.asarray(mask)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b,h,q_len,k_len,d,mask_shape", [
    (1, 1, 1, 5, 8, (1, 1, 5)),          # one task: the calling thread alone
    (6, 4, 1, 37, 64, (6, 1, 37)),       # a decode step: one query per row, own keys
    (3, 2, 4, 19, 16, (3, 4, 19)),       # beams of one source: 4 queries per key row
    (5, 3, 2, 11, 32, (1, 2, 11)),       # one mask for every row
    (61, 4, 1, 9, 16, (61, 1, 9)),       # 244 tasks: taken several at a time, a short last
])
@pytest.mark.parametrize("with_rows", [False, True])
def test_decode_attention_equals_numpy(dtype, b, h, q_len, k_len, d, mask_shape, with_rows):
  """With rows, key j of row b is read from row rows[b, j] (beam search's table)."""
  rng = np.random.default_rng(b * 100 + k_len)
  q, k, v, mask = _inputs(rng, b, h, q_len, k_len, d, mask_shape, dtype)
  kf, vf = np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))
  if with_rows:
    rows = rng.integers(0, b, (b, k_len)).astype(np.int32)
    got = jax.jit(native.decode_attention)(q, k, v, mask, jnp.asarray(rows))
    at = (rows[:, None, :], np.arange(h)[None, :, None], np.arange(k_len)[None, None, :])
    kf, vf = kf[at], vf[at]                   # [b, h, k_len, d], each key from its row
  else:
    got = jax.jit(native.decode_attention)(q, k, v, mask)
  want = _numpy_attention(q, kf, vf, mask)
  assert got.dtype == jnp.float32 and got.shape == (b, h, q_len, d)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
  first = np.asarray(mask).reshape(-1, k_len)[0]
  assert not first.any() and np.all(np.asarray(got)[0, :, 0] == 0)


@needs_kernel
@pytest.mark.parametrize("rows,dtype,key_rows", [   # 4-5 s each: one in the fast tier
    pytest.param(8, jnp.bfloat16, False, marks=pytest.mark.slow),
    pytest.param(2, jnp.bfloat16, False, marks=pytest.mark.slow),  # four query rows per key row
    (8, jnp.bfloat16, True), pytest.param(8, jnp.float32, True, marks=pytest.mark.slow)])
def test_cpu_attention_of_a_decode_step_runs_the_kernel_and_equals_xla(rows, dtype, key_rows,
                                                                        monkeypatch):
  """cpu.attention with few queries calls the kernel (a custom call in the jaxpr) and gives
  what XLA's attention gives (DECODE_QUERIES = 0 turns the kernel off), values and
  gradients; with `key_rows`, XLA's attention reads the keys gathered by reference.key_rows."""
  from seq2seq import kernels
  rng = np.random.default_rng(rows)
  q = jnp.asarray(rng.normal(size=(8, 4, 1, 32)), dtype)
  k = jnp.asarray(rng.normal(size=(rows, 4, 23, 32)), dtype)
  v = jnp.asarray(rng.normal(size=(rows, 4, 23, 32)), dtype)
  mask = jnp.asarray(rng.random((rows, 1, 1, 23)) < 0.8)
  table = {"key_rows": jnp.asarray(rng.integers(0, rows, (rows, 23)), jnp.int32)} \
      if key_rows else {}
  attend = lambda q, k, v, mask: kernels.sharing_keys(cpu.attention)(q, k, v, mask, **table)
  loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v, mask).astype(jnp.float32)))

  def run():
    jax.clear_caches()
    jaxpr = str(jax.make_jaxpr(attend)(q, k, v, mask))
    y = jax.jit(attend)(q, k, v, mask)
    return "seq2seq_decode_attention" in jaxpr, y, jax.grad(loss, (0, 1, 2))(q, k, v)
  used, y, g = run()
  monkeypatch.setattr(cpu, "DECODE_QUERIES", 0)
  used_xla, y_xla, g_xla = run()
  assert used and not used_xla
  # bf16 outputs: the kernel keeps the weights in f32 where XLA's path rounds them to bf16
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
  np.testing.assert_allclose(np.float32(y), np.float32(y_xla), atol=tol, rtol=tol)
  for a, b in zip(g, g_xla):   # the kernel's gradient is XLA's attention's
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.slow   # two decode loops compiled per strategy (8-10 s)
@pytest.mark.parametrize("strategy", ["greedy", "beam4"])
def test_bf16_decoding_with_the_kernel_gives_xlas_tokens_and_log_probs(strategy, monkeypatch):
  """The decode loop of a bf16 model (random weights: no near-ties to speak of) with the
  kernel and without it: the same tokens, log-probabilities within bf16 noise."""
  import seq2seq
  from seq2seq import decoding, search
  from seq2seq.model import Transformer
  cfg = seq2seq.get_config("tiny", vocab_size=64).replace(dtype="bfloat16", dropout_rate=0.0,
                                                         kernels="cpu")
  rng = np.random.default_rng(0)
  src = np.asarray(rng.integers(3, 64, (4, 9)), np.int32)
  src[1, 6:] = 0
  params = Transformer(cfg).init(jax.random.key(0), src, src[:, :4])
  strat = search.Greedy() if strategy == "greedy" else search.Beam(4)

  def run():
    jax.clear_caches()
    return decoding.decode(cfg, params, src, strat, bos_id=1, eos_id=2, max_len=12)
  with_kernel = run()
  monkeypatch.setattr(cpu, "DECODE_QUERIES", 0)
  without = run()
  np.testing.assert_array_equal(with_kernel.tokens, without.tokens)
  np.testing.assert_array_equal(with_kernel.lengths, without.lengths)
  np.testing.assert_allclose(with_kernel.scores, without.scores, atol=0.05)


@needs_kernel
@pytest.mark.parametrize("n,vocab,k", [(1, 5, 1), (13, 200, 8), (9, 8000, 8), (3, 64, 64)])
def test_top_k_logsumexp_equals_numpy(n, vocab, k):
  """The k best entries (best first; a tie goes to the lower index), their indices and the
  row's logsumexp, against a stable NumPy sort and float64 sums; banned (-inf) entries,
  ties at the border of the k best, a vocabulary not a multiple of the kernel's blocks."""
  rng = np.random.default_rng(vocab + k)
  x = (rng.normal(size=(n, vocab)) * 4).astype(np.float32)
  x[:, 0] = -np.inf
  x[-1, -min(vocab - 1, k + 3):] = 9.5     # more ties than places
  values, ids, lse = jax.jit(native.top_k_logsumexp, static_argnums=1)(jnp.asarray(x), k)
  order = np.argsort(-x, axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(ids, order)
  np.testing.assert_array_equal(values, np.take_along_axis(x, order, 1))
  x64 = x.astype(np.float64)
  top = x64.max(1)
  want = top + np.log(np.exp(x64 - top[:, None]).sum(1))
  np.testing.assert_allclose(lse, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow   # two beam searches compiled each way (~15 s each)
@pytest.mark.parametrize("table,dtype", [
    ("reference", "float32"), pytest.param("cpu", "bfloat16", marks=needs_kernel)])
def test_beam_search_reading_through_rows_equals_moving_the_cache(table, dtype, monkeypatch):
  """Beam search with the cache left in place (each hypothesis's keys read through the
  table of rows: the cpu kernels' C++ attention, the reference's gather) and with every
  beam's cache moved to its new beam at each step: the same hypotheses and scores, and
  the same as recomputing the whole decoder at every step."""
  import dataclasses

  import seq2seq
  from seq2seq import decoding, kernels, search
  from seq2seq.model import Transformer
  cfg = seq2seq.get_config("tiny", vocab_size=64).replace(dtype=dtype, dropout_rate=0.0,
                                                         kernels=table)
  rng = np.random.default_rng(1)
  src = np.asarray(rng.integers(3, 64, (3, 9)), np.int32)
  src[1, 5:] = 0
  params = Transformer(cfg).init(jax.random.key(0), src, src[:, :4])

  def run(rows: bool, **kw):
    monkeypatch.setitem(kernels._TABLES, table,
                        dataclasses.replace(kernels._TABLES[table], beam_rows=lambda cfg: rows))
    jax.clear_caches()
    traced = str(jax.make_jaxpr(lambda p: decoding._decode_impl(
        p, jnp.asarray(src), jax.random.key(0), cfg=cfg, strategy=search.Beam(4),
        max_len=14, per_row_limit=False, bos_id=1, eos_id=2, pad_id=0, min_len=0,
        full_recompute=False, return_logits=False))(params))
    return traced, decoding.decode(cfg, params, src, search.Beam(4), bos_id=1, eos_id=2,
                                   max_len=14, **kw)
  traced, through_rows = run(True)
  _, moved = run(False)
  _, recomputed = run(False, full_recompute=True)
  assert ("seq2seq_decode_attention_rows" in traced) == (table == "cpu")
  for other in (moved, recomputed):
    np.testing.assert_array_equal(through_rows.tokens, other.tokens)
    np.testing.assert_array_equal(through_rows.lengths, other.lengths)
    np.testing.assert_allclose(through_rows.scores, other.scores,
                               atol=1e-4 if dtype == "float32" else 0.05)


@pytest.mark.slow   # runs the C++ compiler twice
def test_the_build_is_cached_and_a_failing_compiler_is_one_line(tmp_path, monkeypatch):
  """The library is built once per source, compiler, -march, JAX and CPU, then found; a
  compiler that fails, or none, is a RuntimeError naming it (available() then says False)."""
  if native._compiler() is None:
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
      native.build(tmp_path)
    return
  monkeypatch.delenv("SEQ2SEQ_NATIVE_MARCH", raising=False)   # -march=native
  lib = native.build(tmp_path)
  mtime = lib.stat().st_mtime_ns
  assert native.build(tmp_path) == lib and lib.stat().st_mtime_ns == mtime
  assert [p.name for p in tmp_path.iterdir()] == [lib.name]     # no temporary left
  if platform.machine() == "x86_64":   # built for another CPU: another library
    monkeypatch.setenv("SEQ2SEQ_NATIVE_MARCH", "x86-64-v3")
    avx2 = native.build(tmp_path)
    assert avx2 != lib and native.build(tmp_path) == avx2
    monkeypatch.delenv("SEQ2SEQ_NATIVE_MARCH")
  bad = tmp_path / "bad-cxx"
  bad.write_text("#!/bin/sh\necho 'x.cc:1: error: not today' >&2\nexit 1\n")
  bad.chmod(0o755)
  monkeypatch.setenv("CXX", str(bad))
  with pytest.raises(RuntimeError, match="bad-cxx failed on decode_attention.cc, top_k.cc: "
                                        "x.cc:1: error: not today"):
    native.build(tmp_path / "other")
  assert list((tmp_path / "other").iterdir()) == []


@pytest.mark.slow   # decodes in a subprocess with the kernel turned off
@pytest.mark.parametrize("case", ["off", "a compiler that fails"])
def test_without_the_kernel_decoding_runs_on_xlas_attention(tmp_path, case):
  """SEQ2SEQ_NATIVE=off (or a compiler that fails): available() is False with the reason,
  the cache stays float32 for bf16 models, and a bf16 decode runs; where the kernel was not
  turned off, a warning says why, once."""
  code = """
import jax, numpy as np, seq2seq
from seq2seq import decoding, search
from seq2seq.kernels import cpu, native
from seq2seq.model import Transformer
cfg = seq2seq.get_config("tiny", vocab_size=64).replace(dtype="bfloat16", kernels="cpu")
src = np.full((2, 5), 7, np.int32)
params = Transformer(cfg).init(jax.random.key(0), src, src)
r = decoding.decode(cfg, params, src, search.Greedy(), bos_id=1, eos_id=2, max_len=6)
print(native.available(), native.unavailable_reason(), cpu.cache_dtype(cfg), r.tokens.shape)
"""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SEQ2SEQ_NATIVE_DIR": str(tmp_path)}
  if case == "off":
    env["SEQ2SEQ_NATIVE"], why = "off", ["SEQ2SEQ_NATIVE=off"]
  else:
    env.pop("SEQ2SEQ_NATIVE", None)
    env["CXX"], why = "/bin/false", "/bin/false failed on decode_attention.cc, top_k.cc: exit 1".split()
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.split() == ["False", *why, "float32", "(2,", "1,", "6)"]
  said = [l for l in p.stderr.splitlines() if "Warning: decoding's attention runs XLA's" in l]
  assert len(said) == (case != "off"), p.stderr[-2000:]
