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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--m", type=int, default=2048, help="rows: batch x length (32x64 = 2048)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "matmul_layouts.json"))
  args = ap.parse_args(argv)

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
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                   jax=jax.__version__, backend=jax.default_backend(), m=args.m,
                   matmul_peaks=peaks, results=results), f, indent=2)
  print(f"wrote {args.out}")
  return results


if __name__ == "__main__":
  main()
