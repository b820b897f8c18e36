"""The decode step's matmuls alone: how fast can this machine multiply a few rows by the
decoder's weights, with XLA and with the best BLAS at hand?

    python bench/bench_skinny.py                  # ~1 min
    python bench/bench_skinny.py --rows 8,64 --presets base

A cached decode step multiplies N rows (batch x beams: 8, 16, 32 or 64 in bench_decode.py)
by every decoder layer's FFN weights. This times exactly that chain, one FFN per decoder
layer of the preset (x <- x + relu(x W1) W2, distinct weights, so they stream from memory
as in the decode loop), three ways:
  xla_dots     jitted with XLA's own dot emitter (decoding.XLA_DOTS: the f32 decode loop's
               options on CPUs without AVX-512)
  ynnpack      jitted with XLA's default CPU options (YNNPACK fusions; the loop's with AVX-512)
  numpy        NumPy's matmul (its BLAS: OpenBLAS in the wheels), float32
and prints GFLOP/s and weight GB/s beside the matmul peak and the read bandwidth measured in
the same run. If a well-tuned BLAS is no faster than XLA on these shapes, the gap between
bench_decode.py's tokens/s and its roofline limit lies in skinny matmuls on this CPU, not
in how the loop is built. The three chains are checked to agree.

Then, for each bench_decode.py workload whose row count was measured, the ceiling at those
rates: the tokens/s if every matmul FLOP of its step (bench_decode.step_cost) ran as fast
as this chain does (batch x rate / FLOPs per step; beam search's cache move not counted).
JSON to bench/results/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

# OpenBLAS's threads spin for up to 2^28 cycles after each call, stealing the cores from
# XLA's next call (which then ran up to 2x slower here); 2^4 makes them sleep at once.
# Read when NumPy loads OpenBLAS, so it must come first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import jax
import jax.numpy as jnp
import numpy as np

import seq2seq
from seq2seq import decoding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import STRATEGIES, TARGETS, WORKLOADS, read_bandwidth, step_cost  # noqa: E402
from bench_train import matmul_peak  # noqa: E402

LOOP = "xla_dots" if decoding.cpu_f32_decode_options() else "ynnpack"   # the decode loop's


def ffn_chain(x, layers):
  for w1, w2 in layers:
    x = x + jnp.maximum(x @ w1, 0.0) @ w2
  return x


def ffn_chain_numpy(x, layers):
  for w1, w2 in layers:
    x = x + np.maximum(x @ w1, 0.0) @ w2
  return x


def _interleaved_medians(fns: dict, repeats: int, block: int = 10) -> dict:
  """Per-call wall time of each function: blocks of `block` back-to-back calls (as in the
  decode loop), the blocks of the functions in turns so that a drift hits all alike, the
  median over `repeats` blocks, each after an untimed call."""
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      fn()
      t = time.perf_counter()
      for _ in range(block):
        fn()
      times[name].append((time.perf_counter() - t) / block)
  return {name: statistics.median(ts) for name, ts in times.items()}


def measure(d: int, d_ff: int, n_layers: int, rows: int, repeats: int) -> dict:
  """GFLOP/s and weight bytes/s of the three chains for one (preset shape, rows)."""
  keys = jax.random.split(jax.random.key(0), 2 * n_layers + 1)
  layers = [(jax.random.normal(keys[2 * i], (d, d_ff)) * d ** -0.5,
             jax.random.normal(keys[2 * i + 1], (d_ff, d)) * d_ff ** -0.5)
            for i in range(n_layers)]
  x = jax.random.normal(keys[-1], (rows, d))
  np_layers = [(np.asarray(a), np.asarray(b)) for a, b in layers]
  np_x = np.asarray(x)
  xla = {"xla_dots": jax.jit(ffn_chain, compiler_options=decoding.XLA_DOTS),
         "ynnpack": jax.jit(ffn_chain)}
  ref = ffn_chain_numpy(np_x.astype(np.float64), [(a.astype(np.float64), b.astype(np.float64))
                                                   for a, b in np_layers])
  runs = {name: (lambda f=f: f(x, layers).block_until_ready()) for name, f in xla.items()}
  runs["numpy"] = lambda: ffn_chain_numpy(np_x, np_layers)
  for name, f in xla.items():
    np.testing.assert_allclose(np.asarray(f(x, layers)), ref, rtol=1e-3, atol=1e-3,
                               err_msg=name)
  np.testing.assert_allclose(ffn_chain_numpy(np_x, np_layers), ref, rtol=1e-3, atol=1e-3)
  flops = 2.0 * rows * n_layers * 2 * d * d_ff
  nbytes = 4.0 * n_layers * 2 * d * d_ff
  out = dict(rows=rows, d=d, d_ff=d_ff, layers=n_layers, flops=flops, weight_bytes=nbytes)
  for name, s in _interleaved_medians(runs, repeats).items():
    out[name] = dict(s=s, flops_per_s=flops / s, bytes_per_s=nbytes / s)
  return out


def ceiling_tokens_per_s(cfg, batch: int, beams: int, flops_per_s: float,
                         src_len: int = 32, new_tokens: int = 64) -> float:
  """Decode tokens/s if each step's matmul FLOPs ran at `flops_per_s` (nothing else)."""
  flops, _ = step_cost(cfg, batch * beams, new_tokens, src_len, sources=batch)
  return batch * flops_per_s / flops


def ceilings(results: list[dict]) -> list[dict]:
  """ceiling_tokens_per_s of each bench_decode workload at the measured rates."""
  by_shape = {(r["preset"], r["rows"]): r for r in results}
  out = []
  for (model, strategy), target in TARGETS.items():
    w = WORKLOADS[model]
    beams = getattr(STRATEGIES[strategy], "size", 1)
    r = by_shape.get((model, w["batch"] * beams))
    if r is None:
      continue
    cfg = seq2seq.get_config(model, vocab_size=w["vocab_size"])
    out.append(dict(model=model, strategy=strategy, rows=r["rows"], target_tokens_per_s=target,
                    **{name: ceiling_tokens_per_s(cfg, w["batch"], beams,
                                                  r[name]["flops_per_s"])
                       for name in (LOOP, "numpy")}))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--rows", default="8,16,32,64")
  ap.add_argument("--repeats", type=int, default=15)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "skinny.json"))
  args = ap.parse_args(argv)

  results = []
  for preset in args.presets.split(","):
    cfg = seq2seq.get_config(preset)
    for rows in (int(r) for r in args.rows.split(",")):
      r = measure(cfg.d_model, cfg.d_ff, cfg.num_decoder_layers, rows, args.repeats)
      results.append(dict(preset=preset, **r))
      print(f"  {preset} rows {rows} done", file=sys.stderr, flush=True)
  peak = matmul_peak("float32")
  bandwidth = read_bandwidth()

  names = ("xla_dots", "ynnpack", "numpy")
  print(f"Decoder FFN chain x <- x + relu(x W1) W2, float32, jax {jax.__version__}, "
        f"numpy {np.__version__}, {os.cpu_count()} CPUs")
  print(f"Measured in this run: matmul peak {peak['flops_per_s'] / 1e9:.0f} GFLOP/s (2048^3), "
        f"read bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (sum over 256 MB)")
  print(f"{'preset':6s} {'rows':>4s} {'weights':>8s}  " +
        "  ".join(f"{n + ' GFLOP/s':>19s} {'GB/s':>5s}" for n in names) + f"  {'numpy/' + LOOP:>15s}")
  print("-" * 108)
  for r in results:
    cells = "  ".join(f"{r[n]['flops_per_s'] / 1e9:19.1f} {r[n]['bytes_per_s'] / 1e9:5.1f}"
                      for n in names)
    print(f"{r['preset']:6s} {r['rows']:4d} {r['weight_bytes'] / 2 ** 20:6.1f}MB  {cells}  "
          f"{r[LOOP]['s'] / r['numpy']['s']:14.2f}x")
  limits = ceilings(results)
  if limits:
    print(f"\nDecode ceiling if every matmul of the step ran at the rate above ({LOOP}: the "
          f"f32 decode loop's dots on this CPU; bench_decode.py workloads, tokens/s):")
    print(f"{'model':6s} {'strategy':8s} {'rows':>4s} {LOOP:>10s} {'numpy':>7s} "
          f"{'target':>6s}")
    for c in limits:
      print(f"{c['model']:6s} {c['strategy']:8s} {c['rows']:4d} {c[LOOP]:10.0f} "
            f"{c['numpy']:7.0f} {c['target_tokens_per_s']:6d}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                   jax=jax.__version__, numpy=np.__version__, matmul_peak=peak,
                   read_bandwidth=bandwidth, results=results, decode_ceilings=limits), f,
              indent=2)
  print(f"wrote {args.out}")
  return results


if __name__ == "__main__":
  main()
