"""The three matmuls of a linear layer's training step, as XLA compiles them on this CPU:
the way the backward pass is written decides whether XLA runs them on its fast kernels.

    python bench/bench_matmul_layouts.py            # ~1 min
    python bench/bench_matmul_layouts.py --dtypes bfloat16 --m 1024

y = x·W has two gradients: dx = g·Wᵀ and dW = xᵀ·g. Written plainly (`jnp.dot(g, w.T)`,
`jnp.dot(x.T, g)`), each reads a transposed operand. XLA's CPU backend (jax 0.10) keeps
transposes as strided views, and a dot with a strided operand, or one contracting the
rows of its left operand, is not handed to its YNNPACK kernels: XLA converts it to float32
and runs it through Eigen. In bf16 that forfeits the 2x of AVX512-BF16/AMX. The project's
`layers.dot_nt` contracts g·Wᵀ in place (dot_general, no transpose) and `layers.dot_tn`
copies the smaller operand of xᵀ·g into a row-major transpose first. This times, per shape
of the `small` and `base` presets (M = batch x length rows):
  fwd         x·W (the reference: always on the fast kernels)
  dx plain    jnp.dot(g, W.T)          dx ours   layers.dot_nt(g, W)
  dW plain    jnp.dot(x.T, g)          dW ours   layers.dot_tn(x, g)
with bf16 inputs and f32 accumulation (or all f32), beside the 2048^3 matmul peak measured
in the same run. The results are checked to agree. JSON to bench/results/.

    python bench/bench_matmul_layouts.py --few_rows    # ~1 min: the decode step's form

--few_rows times instead the forward x·W of a decode step: N = 8..64 rows (batch x beams)
times each weight of the preset, once per step, so the weights come from memory, not the
cache ("cold": a chain of dots over distinct copies of W, ~100 MB in all, larger than an
L3), and once more with one W repeated ("hot"), two ways:
  x·W       jnp.dot(x, W) from the [K, N] kernel, as stored
  x·(Wᵀ)ᵀ   layers.dot_nt(x, Wt) from a row-major [N, K] copy Wt (`layers._dot` picks this
            for a few bf16 rows times a matrix whose sides are all >= 512)
in GB/s of weights read, beside a jitted sum's read rate over 256 MB (same run).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from seq2seq.layers import dot_nt, dot_tn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_skinny import _interleaved_medians  # noqa: E402
from bench_train import matmul_peak  # noqa: E402

# (K, N) of every weight of the two presets' train steps: attention projections (fused
# q|k|v, cross k|v over all decoder layers), FFN in and out, the tied output head.
SHAPES = {"small": [(256, 768), (256, 256), (256, 1024), (1024, 256), (256, 1536),
                    (256, 8000)],
          "base": [(512, 1536), (512, 512), (512, 2048), (2048, 512), (512, 6144),
                   (512, 32000)]}
F32 = jnp.float32


def measure(m: int, k: int, n: int, dtype: str, repeats: int) -> dict:
  ks = jax.random.split(jax.random.key(0), 3)
  x, w, g = (jax.random.normal(kk, s, F32).astype(dtype)
             for kk, s in zip(ks, [(m, k), (k, n), (m, n)]))
  fns = {
      "fwd": (jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=F32)), (x, w)),
      "dx_plain": (jax.jit(lambda g, w: jnp.dot(g, w.T, preferred_element_type=F32)), (g, w)),
      "dx_ours": (jax.jit(dot_nt), (g, w)),
      "dw_plain": (jax.jit(lambda x, g: jnp.dot(x.T, g, preferred_element_type=F32)), (x, g)),
      "dw_ours": (jax.jit(dot_tn), (x, g)),
  }
  outs = {name: np.asarray(f(*a)) for name, (f, a) in fns.items()}
  for a, b in (("dx_plain", "dx_ours"), ("dw_plain", "dw_ours")):
    np.testing.assert_allclose(outs[b], outs[a], rtol=2e-3, atol=2e-3 * np.abs(outs[a]).max())
  secs = _interleaved_medians({name: (lambda f=f, a=a: jax.block_until_ready(f(*a)))
                               for name, (f, a) in fns.items()}, repeats, block=3)
  flops = 2.0 * m * k * n
  return dict(m=m, k=k, n=n, dtype=dtype, flops=flops,
              **{name: dict(s=s, flops_per_s=flops / s) for name, s in secs.items()})


def _write(path: str, **results) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                   jax=jax.__version__, backend=jax.default_backend(), **results), f, indent=2)
  print(f"wrote {path}")


def few_rows_measure(rows: int, k: int, n: int, dtype: str, repeats: int,
                     cold_bytes: float = 100e6) -> dict:
  """Seconds per x·W of each form, cold and hot, and the weights' GB/s."""
  size = np.dtype(dtype).itemsize * k * n
  copies = max(2, int(cold_bytes // size))
  rng = np.random.default_rng(0)
  w0 = rng.standard_normal((k, n), np.float32) * 0.05
  ws = [jnp.asarray(w0 * (1 + 0.01 * i), dtype) for i in range(copies)]
  wts = [jnp.asarray((w0 * (1 + 0.01 * i)).T.copy(), dtype) for i in range(copies)]
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype)
  forms = {"x.W": lambda x, w: jnp.dot(x, w, preferred_element_type=F32), "x.(Wt)t": dot_nt}

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
      outs[form, temp] = np.asarray(f(x, wl))
      fns[f"{form} {temp}"] = (lambda f=f, wl=wl: jax.block_until_ready(f(x, wl)))
  for temp in ("cold", "hot"):
    a, b = outs["x.W", temp], outs["x.(Wt)t", temp]
    np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max())
  secs = _interleaved_medians(fns, repeats, block=1)
  return dict(rows=rows, k=k, n=n, dtype=dtype, copies=copies, weight_bytes=size,
              **{name: dict(s=t / copies, bytes_per_s=size * copies / t)
                 for name, t in secs.items()})


def few_rows_main(args) -> list:
  from bench_decode import read_bandwidth
  bw = read_bandwidth()
  results = []
  for dt in args.dtypes.split(","):
    for preset in args.presets.split(","):
      for rows in ((8, 32) if preset == "base" else (16, 64)):
        for k, n in SHAPES[preset][:5]:          # the head is read the same way either form
          results.append(dict(preset=preset, **few_rows_measure(rows, k, n, dt, args.repeats)))
      print(f"  {dt} {preset} done", file=sys.stderr, flush=True)
  print(f"GB/s of weights read by a decode step's x·W, jax {jax.__version__}, "
        f"{jax.default_backend()}, {os.cpu_count()} CPUs; a jitted sum reads "
        f"{bw['bytes_per_s'] / 1e9:.1f} GB/s (same run)")
  names = ("x.W cold", "x.(Wt)t cold", "x.W hot", "x.(Wt)t hot")
  print(f"{'dtype':9s} {'preset':6s} {'rows':>4s} {'K':>5s} {'N':>5s} " +
        " ".join(f"{n:>13s}" for n in names) + f" {'cold x':>7s}")
  print("-" * 100)
  for r in results:
    print(f"{r['dtype']:9s} {r['preset']:6s} {r['rows']:4d} {r['k']:5d} {r['n']:5d} " +
          " ".join(f"{r[n]['bytes_per_s'] / 1e9:13.1f}" for n in names) +
          f" {r['x.W cold']['s'] / r['x.(Wt)t cold']['s']:6.2f}x")
  _write(args.out.replace("matmul_layouts.json", "matmul_few_rows.json"),
         read_bandwidth=bw, results=results)
  return results


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--m", type=int, default=2048, help="rows: batch x length (32x64 = 2048)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "matmul_layouts.json"))
  ap.add_argument("--few_rows", action="store_true",
                  help="time a decode step's few-row x·W instead (cold and hot weights)")
  args = ap.parse_args(argv)
  if args.few_rows:
    return few_rows_main(args)

  dtypes = args.dtypes.split(",")
  peaks = {dt: matmul_peak(dt) for dt in dtypes}
  results = []
  for dt in dtypes:
    for preset in args.presets.split(","):
      for k, n in SHAPES[preset]:
        results.append(dict(preset=preset, **measure(args.m, k, n, dt, args.repeats)))
      print(f"  {dt} {preset} done", file=sys.stderr, flush=True)

  names = ("fwd", "dx_plain", "dx_ours", "dw_plain", "dw_ours")
  print(f"GFLOP/s of a linear layer's three matmuls, M = {args.m} rows, jax {jax.__version__}, "
        f"{jax.default_backend()}, {os.cpu_count()} CPUs")
  print("peak (2048^3, same run): " + ", ".join(
      f"{dt} {p['flops_per_s'] / 1e9:.0f} GFLOP/s" for dt, p in peaks.items()))
  print(f"{'dtype':9s} {'preset':6s} {'K':>5s} {'N':>6s} " +
        " ".join(f"{n:>9s}" for n in names) + f" {'dx x':>6s} {'dW x':>6s}")
  print("-" * 94)
  for r in results:
    print(f"{r['dtype']:9s} {r['preset']:6s} {r['k']:5d} {r['n']:6d} " +
          " ".join(f"{r[n]['flops_per_s'] / 1e9:9.0f}" for n in names) +
          f" {r['dx_plain']['s'] / r['dx_ours']['s']:5.2f}x"
          f" {r['dw_plain']['s'] / r['dw_ours']['s']:5.2f}x")
  _write(args.out, m=args.m, matmul_peaks=peaks, results=results)
  return results


if __name__ == "__main__":
  main()
