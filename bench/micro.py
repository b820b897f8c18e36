"""Micro-benchmarks: single kernels of the fast layer (seq2seq/kernels/) at the presets'
shapes, each form checked against the plain one before it is timed.

    python bench/micro.py layouts               # ~1 min: a linear layer's backward matmuls
    python bench/micro.py layouts --few_rows    # ~1 min: a decode step's x·W, two layouts
    python bench/micro.py skinny                # ~1 min: the decoder's FFN with 8-64 rows
    python bench/micro.py head_chunks           # ~1 min: the fused head + loss, in slices
    python bench/micro.py int8 --presets base   # ~1 min: a decode step's matmuls, int8 vs bf16

layouts      y = x·W has two gradients, dx = g·Wᵀ and dW = xᵀ·g. Written plainly, each reads
             a transposed operand, and XLA:CPU runs such a dot in float32 through Eigen
             instead of its YNNPACK kernels (in bf16 that forfeits the bf16 units). Times, per
             weight shape of the preset (M = batch x length rows):
               fwd       jnp.dot(x, W)
               dx_plain  jnp.dot(g, W.T)     dx_ours  kernels.cpu.dot_nt(g, W)
               dW_plain  jnp.dot(x.T, g)     dW_ours  kernels.cpu.dot_tn(x, g)
             beside the 2048^3 matmul peak of the same run.
  --few_rows the forward x·W of a decode step instead: N rows (batch x beams of
             bench_decode.py's workload) times each weight, as `kernels.cpu._dot` may run it:
               x.W       jnp.dot(x, W) from the [K, N] kernel as stored
               x.(Wt)t   dot_nt(x, Wt) from a row-major [N, K] copy (what _dot does for
                         a few bf16 rows times a matrix whose sides are all >= 512)
             "cold": a chain over distinct copies of W (~100 MB, more than an L3), so the
             weights come from memory as in the decode loop; "hot": one W repeated. In GB/s
             of weights read, beside a jitted sum's read rate.
skinny       the decode step's FFN matmuls alone: x <- x + relu(x W1) W2 over every decoder
             layer's own weights, N = 8-64 rows, three ways: `xla_dots` (XLA's own dot
             emitter, kernels.cpu.XLA_DOTS: the f32 decode loop's options without AVX-512),
             `ynnpack` (XLA's defaults: the loop's with AVX-512) and `numpy` (OpenBLAS, f32).
             Then the ceiling those rates put on each bench_decode.py workload: tokens/s if
             every matmul of its step (bench_decode.step_cost) ran at the chain's rate for
             its row count, nothing else counted.
int8         whether int8 weights would pay in the decode step: every matmul of the step
             (per decoder layer Q|K|V, three d x d, the FFN's two; the head once), N rows
             (bench_decode.py's greedy and beam-4 rows), bf16 x·W with float32 accumulation
             against int8 weights (one scale per output column) times int8 activations
             (one scale per row, quantized in the step), int32 accumulation, rescaled to
             float32: XLA's int8 dot, as a fast-layer int8 path would run it. Both read
             distinct weight copies (cold, as in the decode loop); the step's total per form.
head_chunks  the gradient of kernels.cpu_head.head_loss (tied [V, D] head, label smoothing
             0.1, 1/8 padding) for the train workloads, cut into 1, 2, 4, 8 slices of the
             target length: the evidence for `cpu_head.head_chunks`' rule.

Functions are timed interleaved (blocks of calls in turns, median over blocks), so that a
slow spell of a shared machine hits all alike. JSON to bench/results/micro_<what>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

# OpenBLAS's threads spin for up to 2^28 cycles after each call, stealing the cores from
# XLA's next call (up to 2x slower); 2^4 makes them sleep at once. Read when NumPy loads
# OpenBLAS, so it must come first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import seq2seq  # noqa: E402
from seq2seq.kernels import cpu, cpu_head  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_decode  # noqa: E402
import bench_train  # noqa: E402

F32 = jnp.float32


def preset_config(preset: str, vocab: int | None = None):
  """The preset at its train workload's vocabulary (bench_train.WORKLOADS), or `vocab`."""
  w = bench_train.WORKLOADS.get(preset, {})
  return seq2seq.get_config(preset, vocab_size=vocab or w.get("vocab_size", 8000))


def interleaved_medians(fns: dict, repeats: int, block: int = 10) -> dict:
  """Seconds per call of each function: `repeats` blocks of `block` back-to-back calls, the
  functions' blocks in turns, each after an untimed call; the median over blocks."""
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      fn()
      t = time.perf_counter()
      for _ in range(block):
        fn()
      times[name].append((time.perf_counter() - t) / block)
  return {name: statistics.median(ts) for name, ts in times.items()}


def _allclose(got, want, rtol: float, what: str):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.abs(want).max()), 1e-6),
                             err_msg=what)


# --- layouts ------------------------------------------------------------------------------------

def weight_shapes(cfg) -> list[tuple[int, int]]:
  """(K, N) of every weight of a train step: the fused Q|K|V projection, the output
  projection, the FFN's two, the cross-attention K|V of all decoder layers, the tied head."""
  d, f = cfg.d_model, cfg.d_ff
  return [(d, 3 * d), (d, d), (d, f), (f, d), (d, 2 * d * cfg.num_decoder_layers),
          (d, cfg.vocab_size)]


LAYOUT_FORMS = {
    "fwd": lambda x, w, g: jnp.dot(x, w, preferred_element_type=F32),
    "dx_plain": lambda x, w, g: jnp.dot(g, w.T, preferred_element_type=F32),
    "dx_ours": lambda x, w, g: cpu.dot_nt(g, w),
    "dw_plain": lambda x, w, g: jnp.dot(x.T, g, preferred_element_type=F32),
    "dw_ours": lambda x, w, g: cpu.dot_tn(x, g),
}


def layouts_measure(m: int, k: int, n: int, dtype: str, repeats: int,
                    forms: dict = LAYOUT_FORMS) -> dict:
  """GFLOP/s of each form of the three matmuls; ours checked against the plain ones."""
  ks = jax.random.split(jax.random.key(0), 3)
  x, w, g = (jax.random.normal(kk, s, F32).astype(dtype)
             for kk, s in zip(ks, [(m, k), (k, n), (m, n)]))
  fns = {name: jax.jit(f) for name, f in forms.items()}
  outs = {name: f(x, w, g) for name, f in fns.items()}
  for plain, ours in (("dx_plain", "dx_ours"), ("dw_plain", "dw_ours")):
    _allclose(outs[ours], outs[plain], 2e-3, f"{ours} against {plain}, [{m}, {k}, {n}] {dtype}")
  secs = interleaved_medians({name: (lambda f=f: jax.block_until_ready(f(x, w, g)))
                              for name, f in fns.items()}, repeats, block=3)
  flops = 2.0 * m * k * n
  return dict(m=m, k=k, n=n, dtype=dtype, flops=flops,
              **{name: dict(s=s, flops_per_s=flops / s) for name, s in secs.items()})


def layouts(args) -> dict:
  dtypes = args.dtypes.split(",")
  peaks = {dt: bench_train.matmul_peak(dt) for dt in dtypes}
  results = []
  for dt in dtypes:
    for preset in args.presets.split(","):
      for k, n in weight_shapes(preset_config(preset, args.vocab)):
        results.append(dict(preset=preset, **layouts_measure(args.m, k, n, dt, args.repeats)))
      print(f"  {dt} {preset} done", file=sys.stderr, flush=True)
  names = tuple(LAYOUT_FORMS)
  print(f"GFLOP/s of a linear layer's three matmuls, M = {args.m} rows; 2048^3 peak: " +
        ", ".join(f"{dt} {p['flops_per_s'] / 1e9:.0f}" for dt, p in peaks.items()))
  print(f"{'dtype':9s} {'preset':6s} {'K':>5s} {'N':>6s} " +
        " ".join(f"{n:>9s}" for n in names) + f" {'dx x':>6s} {'dW x':>6s}")
  for r in results:
    print(f"{r['dtype']:9s} {r['preset']:6s} {r['k']:5d} {r['n']:6d} " +
          " ".join(f"{r[n]['flops_per_s'] / 1e9:9.0f}" for n in names) +
          f" {r['dx_plain']['s'] / r['dx_ours']['s']:5.2f}x"
          f" {r['dw_plain']['s'] / r['dw_ours']['s']:5.2f}x")
  return dict(m=args.m, matmul_peaks=peaks, results=results)


def decode_rows(preset: str) -> list[int]:
  """The rows of bench_decode.py's greedy and beam-4 steps for `preset` (else 8 and 32)."""
  batch = bench_decode.WORKLOADS.get(preset, {}).get("batch", 8)
  return [batch, 4 * batch]


def few_rows_measure(rows: int, k: int, n: int, dtype: str, repeats: int,
                     cold_bytes: float = 100e6) -> dict:
  """Seconds per x·W of each layout, cold and hot, and the weights' GB/s."""
  size = np.dtype(jnp.dtype(dtype)).itemsize * k * n
  copies = max(2, int(cold_bytes // size))
  rng = np.random.default_rng(0)
  w0 = rng.standard_normal((k, n), np.float32) * 0.05
  ws = [jnp.asarray(w0 * (1 + 0.01 * i), dtype) for i in range(copies)]
  wts = [jnp.asarray((w0 * (1 + 0.01 * i)).T.copy(), dtype) for i in range(copies)]
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype)
  forms = {"x.W": lambda x, w: jnp.dot(x, w, preferred_element_type=F32), "x.(Wt)t": cpu.dot_nt}

  def chain(form):
    def f(x, ws):     # each dot waits for the previous one, as in a decode step
      y = None
      for w in ws:
        y = forms[form](x, w)
        x = x + (1e-6 * y.sum(axis=1, keepdims=True)).astype(x.dtype)
      return y
    return jax.jit(f)

  fns, outs = {}, {}
  for form, weights in (("x.W", ws), ("x.(Wt)t", wts)):
    for temp, wl in (("cold", weights), ("hot", [weights[0]] * copies)):
      f = chain(form)
      outs[form, temp] = f(x, wl)
      fns[f"{form} {temp}"] = (lambda f=f, wl=wl: jax.block_until_ready(f(x, wl)))
  for temp in ("cold", "hot"):
    _allclose(outs["x.(Wt)t", temp], outs["x.W", temp], 2e-2, f"x.(Wt)t {temp}")
  secs = interleaved_medians(fns, repeats, block=1)
  return dict(rows=rows, k=k, n=n, dtype=dtype, copies=copies, weight_bytes=size,
              **{name: dict(s=t / copies, bytes_per_s=size * copies / t)
                 for name, t in secs.items()})


def few_rows(args) -> dict:
  bw = bench_decode.read_bandwidth()
  results = []
  for dt in args.dtypes.split(","):
    for preset in args.presets.split(","):
      rows = [int(r) for r in args.rows.split(",")] if args.rows else decode_rows(preset)
      for r in rows:
        # The head is read the same way in either layout (kernels.cpu.decode_head).
        for k, n in weight_shapes(preset_config(preset, args.vocab))[:5]:
          results.append(dict(preset=preset, **few_rows_measure(
              r, k, n, dt, args.repeats, cold_bytes=args.cold_mb * 1e6)))
      print(f"  {dt} {preset} done", file=sys.stderr, flush=True)
  names = ("x.W cold", "x.(Wt)t cold", "x.W hot", "x.(Wt)t hot")
  print(f"GB/s of weights read by a decode step's x·W; a jitted sum reads "
        f"{bw['bytes_per_s'] / 1e9:.1f} GB/s (same run)")
  print(f"{'dtype':9s} {'preset':6s} {'rows':>4s} {'K':>5s} {'N':>5s} " +
        " ".join(f"{n:>13s}" for n in names) + f" {'cold x':>7s}")
  for r in results:
    print(f"{r['dtype']:9s} {r['preset']:6s} {r['rows']:4d} {r['k']:5d} {r['n']:5d} " +
          " ".join(f"{r[n]['bytes_per_s'] / 1e9:13.1f}" for n in names) +
          f" {r['x.W cold']['s'] / r['x.(Wt)t cold']['s']:6.2f}x")
  return dict(read_bandwidth=bw, results=results)


# --- skinny -------------------------------------------------------------------------------------

def ffn_chain(x, layers):
  for w1, w2 in layers:
    x = x + jnp.maximum(x @ w1, 0.0) @ w2
  return x


def ffn_chain_numpy(x, layers):
  for w1, w2 in layers:
    x = x + np.maximum(x @ w1, 0.0) @ w2
  return x


def loop_dots() -> str:
  """Which of xla_dots / ynnpack the f32 decode loop uses on this CPU."""
  return "xla_dots" if cpu.decode_compiler_options(seq2seq.get_config("small")) else "ynnpack"


def skinny_measure(d: int, d_ff: int, n_layers: int, rows: int, repeats: int) -> dict:
  """GFLOP/s and weight bytes/s of the three chains for one (preset shape, rows)."""
  keys = jax.random.split(jax.random.key(0), 2 * n_layers + 1)
  layers = [(jax.random.normal(keys[2 * i], (d, d_ff)) * d ** -0.5,
             jax.random.normal(keys[2 * i + 1], (d_ff, d)) * d_ff ** -0.5)
            for i in range(n_layers)]
  x = jax.random.normal(keys[-1], (rows, d))
  np_layers = [(np.asarray(a), np.asarray(b)) for a, b in layers]
  np_x = np.asarray(x)
  xla = {"xla_dots": jax.jit(ffn_chain, compiler_options=cpu.XLA_DOTS),
         "ynnpack": jax.jit(ffn_chain)}
  want = ffn_chain_numpy(np_x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))
                                                    for a, b in np_layers])
  for name, f in xla.items():
    _allclose(f(x, layers), want, 1e-3, name)
  _allclose(ffn_chain_numpy(np_x, np_layers), want, 1e-3, "numpy")
  runs = {name: (lambda f=f: f(x, layers).block_until_ready()) for name, f in xla.items()}
  runs["numpy"] = lambda: ffn_chain_numpy(np_x, np_layers)
  flops = 2.0 * rows * n_layers * 2 * d * d_ff
  nbytes = 4.0 * n_layers * 2 * d * d_ff
  out = dict(rows=rows, d=d, d_ff=d_ff, layers=n_layers, flops=flops, weight_bytes=nbytes)
  for name, s in interleaved_medians(runs, repeats).items():
    out[name] = dict(s=s, flops_per_s=flops / s, bytes_per_s=nbytes / s)
  return out


def ceiling_tokens_per_s(cfg, batch: int, beams: int, flops_per_s: float,
                         src_len: int = 32, new_tokens: int = 64) -> float:
  """Decode tokens/s if each step's matmul FLOPs ran at `flops_per_s` (nothing else)."""
  flops, _ = bench_decode.step_cost(cfg, batch * beams, new_tokens, src_len, sources=batch)
  return batch * flops_per_s / flops


def ceilings(results: list[dict], names=("ynnpack", "numpy")) -> list[dict]:
  """ceiling_tokens_per_s of each bench_decode.py workload whose row count was measured."""
  by_shape = {(r["preset"], r["rows"]): r for r in results}
  out = []
  for (model, strategy), target in bench_decode.TARGETS.items():
    w = bench_decode.WORKLOADS[model]
    beams = getattr(bench_decode.STRATEGIES[strategy], "size", 1)
    r = by_shape.get((model, w["batch"] * beams))
    if r is None:
      continue
    cfg = seq2seq.get_config(model, vocab_size=w["vocab_size"])
    out.append(dict(model=model, strategy=strategy, rows=r["rows"], target_tokens_per_s=target,
                    **{name: ceiling_tokens_per_s(cfg, w["batch"], beams,
                                                  r[name]["flops_per_s"]) for name in names}))
  return out


def skinny(args) -> dict:
  results = []
  for preset in args.presets.split(","):
    cfg = seq2seq.get_config(preset)
    for rows in (int(r) for r in args.rows.split(",")):
      results.append(dict(preset=preset, **skinny_measure(
          cfg.d_model, cfg.d_ff, cfg.num_decoder_layers, rows, args.repeats)))
      print(f"  {preset} rows {rows} done", file=sys.stderr, flush=True)
  peak = bench_train.matmul_peak("float32")
  bandwidth = bench_decode.read_bandwidth()
  names, loop = ("xla_dots", "ynnpack", "numpy"), loop_dots()
  print(f"Decoder FFN chain x <- x + relu(x W1) W2, float32, numpy {np.__version__}; matmul "
        f"peak {peak['flops_per_s'] / 1e9:.0f} GFLOP/s, read bandwidth "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (same run); the f32 decode loop uses {loop}")
  print(f"{'preset':6s} {'rows':>4s} {'weights':>8s}  " +
        "  ".join(f"{n + ' GFLOP/s':>19s} {'GB/s':>5s}" for n in names) +
        f"  {'numpy/' + loop:>16s}")
  for r in results:
    cells = "  ".join(f"{r[n]['flops_per_s'] / 1e9:19.1f} {r[n]['bytes_per_s'] / 1e9:5.1f}"
                      for n in names)
    print(f"{r['preset']:6s} {r['rows']:4d} {r['weight_bytes'] / 2 ** 20:6.1f}MB  {cells}  "
          f"{r[loop]['s'] / r['numpy']['s']:15.2f}x")
  limits = ceilings(results, (loop, "numpy"))
  if limits:
    print("\nDecode ceiling, tokens/s, if every matmul of the step ran at the rate above "
          "(bench_decode.py's workloads):")
    print(f"{'model':6s} {'strategy':8s} {'rows':>4s} {loop:>10s} {'numpy':>7s} {'target':>6s}")
    for c in limits:
      print(f"{c['model']:6s} {c['strategy']:8s} {c['rows']:4d} {c[loop]:10.0f} "
            f"{c['numpy']:7.0f} {c['target_tokens_per_s']:6d}")
  return dict(numpy=np.__version__, loop_dots=loop, matmul_peak=peak,
              read_bandwidth=bandwidth, results=results, decode_ceilings=limits)


# --- int8 ---------------------------------------------------------------------------------------

def decode_step_weights(cfg) -> list[tuple[int, int, int]]:
  """(K, N, count per step) of every matmul of a cached decode step: per decoder layer the
  fused Q|K|V, the self-attention output, the cross-attention query and output, the FFN's
  two; the head once."""
  d, f, n = cfg.d_model, cfg.d_ff, cfg.num_decoder_layers
  return [(d, 3 * d, n), (d, d, 3 * n), (d, f, n), (f, d, n), (d, cfg.vocab_size, 1)]


def int8_weights(w_KxN):
  """int8 weights and one float32 scale per output column (absmax / 127)."""
  scale_N = jnp.maximum(jnp.max(jnp.abs(w_KxN), axis=0), 1e-30) / 127.0
  return jnp.round(w_KxN / scale_N).astype(jnp.int8), scale_N.astype(F32)


def int8_dot(x_MxK, wq_KxN, scale_N):
  """x·W with x quantized per row to int8 in the call, int32 accumulation, float32 out."""
  a_Mx1 = jnp.maximum(jnp.max(jnp.abs(x_MxK), axis=1, keepdims=True), 1e-30) / 127.0
  xq_MxK = jnp.round(x_MxK / a_Mx1).astype(jnp.int8)
  y_MxN = jax.lax.dot_general(xq_MxK, wq_KxN, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.int32)
  return y_MxN.astype(F32) * a_Mx1 * scale_N


INT8_FORMS = {
    "bf16": lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=F32),
    "int8": lambda x, w: int8_dot(x, *w),
}


def int8_measure(rows: int, k: int, n: int, repeats: int, cold_bytes: float = 100e6,
                 forms: dict = INT8_FORMS) -> dict:
  """Seconds per x·W of each form over distinct weight copies (each dot waiting for the
  previous one), checked against the float32 product: bf16 to 2%, int8 to 5% of its
  largest element."""
  copies = max(2, int(cold_bytes // (2 * k * n)))
  rng = np.random.default_rng(0)
  w0 = rng.standard_normal((k, n), np.float32) * k ** -0.5
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
  scaled = [jnp.asarray(w0 * (1 + 0.01 * i)) for i in range(copies)]
  weights = {"bf16": [w.astype(jnp.bfloat16) for w in scaled],
             "int8": [int8_weights(w) for w in scaled]}
  want = np.asarray(x, np.float64) @ (w0.astype(np.float64) * (1 + 0.01 * (copies - 1)))

  def chain(form):
    def f(x, ws):
      y = None
      for w in ws:   # the barrier keeps the next line out of the dot's fusion
        y = jax.lax.optimization_barrier(forms[form](x, w))
        x = x + 1e-6 * y.sum(axis=1, keepdims=True)
      return y
    return jax.jit(f)

  fns = {}
  for form in forms:
    f, ws = chain(form), weights[form]
    _allclose(f(x, ws), want, 2e-2 if form == "bf16" else 5e-2, f"{form} against float32")
    fns[form] = (lambda f=f, ws=ws: jax.block_until_ready(f(x, ws)))
  secs = interleaved_medians(fns, repeats, block=1)
  return dict(rows=rows, k=k, n=n, copies=copies,
              **{form: dict(s=t / copies) for form, t in secs.items()})


def int8(args) -> dict:
  results, steps = [], []
  for preset in args.presets.split(","):
    w = bench_decode.WORKLOADS.get(preset, {})
    cfg = seq2seq.get_config(preset, vocab_size=args.vocab or w.get("vocab_size", 8000))
    rows = [int(r) for r in args.rows.split(",")] if args.rows else decode_rows(preset)
    for r in rows:
      step = dict(preset=preset, rows=r, bf16=0.0, int8=0.0)
      for k, n, count in decode_step_weights(cfg):
        m = int8_measure(r, k, n, args.repeats, cold_bytes=args.cold_mb * 1e6)
        results.append(dict(preset=preset, count=count, **m))
        for form in ("bf16", "int8"):
          step[form] += count * m[form]["s"]
      steps.append(step)
      print(f"  {preset} rows {r} done", file=sys.stderr, flush=True)
  print("A decode step's matmuls, bf16 weights against int8 weights x int8 activations "
        "(XLA's int8 dot), cold weights; bf16 time / int8 time (> 1: int8 pays)")
  print(f"{'preset':6s} {'rows':>4s} {'K':>5s} {'N':>6s} {'x/step':>6s} {'bf16 us':>8s} "
        f"{'int8 us':>8s} {'ratio':>6s}")
  for r in results:
    print(f"{r['preset']:6s} {r['rows']:4d} {r['k']:5d} {r['n']:6d} {r['count']:6d} "
          f"{r['bf16']['s'] * 1e6:8.1f} {r['int8']['s'] * 1e6:8.1f} "
          f"{r['bf16']['s'] / r['int8']['s']:6.2f}")
  for st in steps:
    print(f"{st['preset']:6s} {st['rows']:4d} whole step: bf16 {st['bf16'] * 1e3:.2f} ms, "
          f"int8 {st['int8'] * 1e3:.2f} ms, {st['bf16'] / st['int8']:.2f}x")
  return dict(results=results, steps=steps)


# --- head_chunks --------------------------------------------------------------------------------

def head_measure(batch: int, length: int, d: int, vocab: int, dtype: str, chunks: list[int],
                 repeats: int) -> dict:
  """Seconds of the head + loss gradient in each number of slices, checked against the
  first count's."""
  ks = jax.random.split(jax.random.key(0), 3)
  y = jax.random.normal(ks[0], (batch, length, d))
  w = jax.random.normal(ks[1], (vocab, d)) * d ** -0.5
  t = jax.random.randint(ks[2], (batch, length), 1, vocab)
  t = jnp.where(jnp.arange(batch * length).reshape(batch, length) % 8 == 0, 0, t)
  wt = (t != 0).astype(F32)

  def loss(y, w, c):
    return cpu_head.head_loss(y, w, None, t, wt, label_smoothing=0.1, dtype=dtype,
                              w_is_VxD=True, chunks=c)[0]

  fns = {c: jax.jit(jax.value_and_grad(lambda y, w, c=c: loss(y, w, c), argnums=(0, 1)))
         for c in chunks}
  want = jax.tree_util.tree_leaves(fns[chunks[0]](y, w))
  for c in chunks[1:]:
    for got, ref in zip(jax.tree_util.tree_leaves(fns[c](y, w)), want):
      _allclose(got, ref, 2e-2, f"{c} slices against {chunks[0]}")
  secs = interleaved_medians({c: (lambda f=f: jax.block_until_ready(f(y, w)))
                              for c, f in fns.items()}, repeats, block=2)
  flops = 3 * 2.0 * batch * length * d * vocab   # logits, dy, dW
  return dict(batch=batch, length=length, d=d, vocab=vocab, dtype=dtype,
              rule=cpu_head.head_chunks(batch, length, vocab), flops=flops,
              by_chunks={str(c): dict(s=s, flops_per_s=flops / s) for c, s in secs.items()})


def head_chunks(args) -> dict:
  chunks = [int(c) for c in args.chunks.split(",")]
  results = []
  for preset in args.presets.split(","):
    w = bench_train.WORKLOADS.get(preset, {})
    cfg = preset_config(preset, args.vocab)
    shape = dict(batch=args.batch or w.get("batch", 8), length=args.length or w.get("length", 64),
                 d=cfg.d_model, vocab=cfg.vocab_size)
    for dt in args.dtypes.split(","):
      results.append(dict(preset=preset, **head_measure(**shape, dtype=dt, chunks=chunks,
                                                        repeats=args.repeats)))
      print(f"  {preset} {dt} done", file=sys.stderr, flush=True)
  print("Head + loss gradient, ms (GFLOP/s), by number of slices of the target length")
  print(f"{'preset':6s} {'dtype':9s} " + " ".join(f"{c:>14d}" for c in chunks) +
        f" {'rule':>5s} {'whole/rule':>10s}")
  for r in results:
    by = r["by_chunks"]
    cells = " ".join(f"{by[str(c)]['s'] * 1e3:6.1f} ({by[str(c)]['flops_per_s'] / 1e9:4.0f})"
                     for c in chunks)
    rule = str(r["rule"])
    ratio = (f"{by['1']['s'] / by[rule]['s']:9.2f}x" if rule in by and "1" in by
             else f"{'-':>10s}")
    print(f"{r['preset']:6s} {r['dtype']:9s} {cells} {r['rule']:5d} {ratio}")
  return dict(results=results)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="what", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--presets", default="small,base")
  common.add_argument("--vocab", type=int, default=None,
                      help="vocabulary (default: the preset's train workload's)")
  common.add_argument("--out", default="", help="JSON path (default: bench/results/micro_*.json)")
  p = sub.add_parser("layouts", parents=[common], help="a linear layer's matmuls, two layouts")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--m", type=int, default=2048, help="rows: batch x length (32 x 64 = 2048)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--few_rows", action="store_true",
                 help="a decode step's few-row x·W instead (cold and hot weights)")
  p.add_argument("--rows", default="", help="--few_rows: rows (default: the decode workload's)")
  p.add_argument("--cold_mb", type=float, default=100.0,
                 help="--few_rows: MB of distinct weight copies in the cold chain")
  p = sub.add_parser("skinny", parents=[common], help="the decoder's FFN chain, few rows")
  p.add_argument("--rows", default="8,16,32,64")
  p.add_argument("--repeats", type=int, default=15)
  p = sub.add_parser("int8", parents=[common], help="a decode step's matmuls, int8 vs bf16")
  p.add_argument("--rows", default="", help="rows (default: the decode workload's)")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--cold_mb", type=float, default=100.0,
                 help="MB of distinct weight copies per chain")
  p = sub.add_parser("head_chunks", parents=[common], help="the head + loss, in slices")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--chunks", default="1,2,4,8")
  p.add_argument("--batch", type=int, default=None, help="default: the train workload's")
  p.add_argument("--length", type=int, default=None, help="default: the train workload's")
  p.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)

  what = "few_rows" if getattr(args, "few_rows", False) else args.what
  run = {"layouts": layouts, "few_rows": few_rows, "skinny": skinny,
         "head_chunks": head_chunks, "int8": int8}[what]
  result = run(args)
  out = args.out or os.path.join(HERE, "results", f"micro_{what}.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(dict(what=what, date=datetime.datetime.now().isoformat(timespec="seconds"),
                   machine=bench_train.cpu_name(), cpus=os.cpu_count(),
                   jax=jax.__version__, backend=jax.default_backend(),
                   args={k: v for k, v in vars(args).items()}, **result), f, indent=2)
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
