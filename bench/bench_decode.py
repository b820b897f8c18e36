"""Decoding speed: the cached loop against the same loop recomputing the whole prefix.

    python bench/bench_decode.py                      # everything (several minutes on CPU)
    python bench/bench_decode.py --models small --modes cached
    python bench/bench_decode.py --workload gpu --models base --modes cached \
        --dtype bfloat16 --peak_n 8192           # on a GPU (bench/gpu/run.sh does this)

Workloads (those of the project's speed targets): random params, random sources of 32
tokens, 64 new tokens per row (EOS is forbidden before the 64th token via min_len, so every
row decodes exactly 64 tokens); `small` = get_config('small', vocab_size=8000) at batch 16,
`base` = get_config('base', vocab_size=32000) at batch 8. Strategies: greedy and beam
search of 4 (alpha 0.6). `--workload gpu`: batch 128 (`small`, `base`, `big`), targets for
`base` in bf16 of 68,000 (greedy) and 40,000 (beam 4) tokens/s; `--workload dry`: `tiny` at
batch 2, for a dry run of the script.

Modes: `cached` is `decoding.decode` as users call it (KV cache, cross-attention keys and
values projected once), given weights already in the compute dtype
(`decoding.decode_params`, made once, as `translate_nbest` and decode.py do: with float32
params each bfloat16 call would also cast them, ~50 ms for `base`); `full` is the same
jitted loop with `full_recompute=True`: every step runs the teacher-forced decoder
(`Transformer.decode`) over the whole [rows, 64] token buffer, recomputing self- and
cross-attention keys/values and the logits of all 64 positions (causal masking makes the
result equal; tests check it).

Mode `latency`: one interactive sentence, batch 1, as bench/bench_peers_ct2.py measures
CTranslate2: a source of 28 random tokens (about 20 words; EOS last, drawn like the workload's
sources), exactly 30 new tokens (min_len = max_len), `decoding.decode` as in `cached`; the
median of `--latency_repeats` calls after 2 warm-up calls, in milliseconds per sentence.

tokens/s counts output tokens of the returned translation (batch x 64 per call), whatever
the beam size. compile_s is the first call minus a warm call (tracing + XLA compilation of
the one decode program). cpu_s is the process CPU time of a warm call (steadier than wall
time on a shared machine). Prints a table and writes JSON to bench/results/.

How close to the machine's limit (cached mode). Two peaks are measured in the same run: the
matmul peak of the compute dtype (bench_train.matmul_peak: a 2048^3 dot) and the memory read
bandwidth (a jitted sum over 256 MB). Each cached step must at least do `step_cost`'s work:

    FLOPs = 2 * N * [N_d * (6 d^2 + 2 d d_ff + 2 L d + 2 S d) + d V]
    bytes = size * [N_d * (6 d^2 + 2 d d_ff + 12 d + d_ff) + d V       weights read once
                     + N_d * 2 d (N L + B S)]                          self and cross K, V

(N rows = batch B x beams, L cache slots = new tokens, S source length, size = bytes per
element of the compute dtype: the weights are cast beforehand. 6 d^2 = self Q, K, V, O and
cross Q, O; 12 d + d_ff = biases and LayerNorms. The cross-attention K, V projections run
once per call and are not counted, nor are beam search's cache moves.) The roofline limit
is batch * steps / sum over steps of max(FLOPs / matmul peak, bytes / bandwidth) tokens/s:
the ceiling that this machine's measured peaks put on any implementation doing that work.
`% peak` is model FLOP/s over the matmul peak, `% limit` is tokens/s over that limit.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from seq2seq import decoding, search
from seq2seq.config import get_config
from seq2seq.kernels import accelerator
from seq2seq.kernels import cpu as cpu_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import cpu_name, device_peak_bytes, matmul_peak, timed_calls  # noqa: E402

WORKLOADS = {"small": dict(vocab_size=8000, batch=16), "base": dict(vocab_size=32000, batch=8)}
GPU_WORKLOADS = {"small": dict(vocab_size=8000, batch=128),
                 "base": dict(vocab_size=32000, batch=128),
                 "big": dict(vocab_size=32000, batch=128)}
DRY_WORKLOADS = {"tiny": dict(vocab_size=64, batch=2,
                              model=dict(d_model=32, num_heads=2, d_ff=64,
                                         num_encoder_layers=1, num_decoder_layers=1))}
WORKLOAD_SETS = {"cpu": WORKLOADS, "gpu": GPU_WORKLOADS, "dry": DRY_WORKLOADS}
STRATEGIES = {"greedy": search.Greedy(), "beam4": search.Beam(size=4, alpha=0.6)}
# The project's speed targets, cached tokens/s (docs/performance.md, "The targets").
TARGETS = {("small", "greedy"): 6000, ("small", "beam4"): 3000,
           ("base", "greedy"): 1100, ("base", "beam4"): 550}
GPU_TARGETS = {("base", "greedy"): 68_000, ("base", "beam4"): 40_000}
TARGET_SETS = {"cpu": TARGETS, "gpu": GPU_TARGETS, "dry": {}}
TARGET_SPEEDUP = 8.0      # cached >= 8x recomputation, small greedy, 64 new tokens
TARGET_COMPILE_S = 15.0   # the decode loop compiles in at most this
BOS, EOS = 1, 2
COST_FORMULA = ("FLOPs/step = 2N[N_d(6d^2 + 2d*d_ff + 2Ld + 2Sd) + dV]; bytes/step = "
                "size[N_d(6d^2 + 2d*d_ff + 12d + d_ff) + dV + 2N_d*d(N*L + B*S)]")


def random_sources(vocab_size: int, rows: int, src_len: int) -> np.ndarray:
  """[rows, src_len] int32 random ids in [3, vocab_size), EOS last."""
  src = np.random.default_rng(0).integers(3, vocab_size, (rows, src_len)).astype(np.int32)
  src[:, -1] = EOS
  return src


def workload(model: str, dtype: str, src_len: int = 32, package: str = "seq2seq",
             kernels: str = "", workload_set: str = "cpu"):
  """(config, random params cast as `decode` casts them, source batch [B, src_len]) of the
  workload `model`, built by `package` (this seq2seq, or another version: bench/ab.py)."""
  s2s = importlib.import_module(package)
  dec = importlib.import_module(package + ".decoding")
  model_cls = importlib.import_module(package + ".model").Transformer
  w = WORKLOAD_SETS[workload_set][model]
  cfg = s2s.get_config(model, vocab_size=w["vocab_size"]).replace(dropout_rate=0.0,
                                                                  dtype=dtype,
                                                                  **w.get("model", {}))
  if kernels:
    cfg = cfg.replace(kernels=kernels)
  x = jnp.ones((1, 4), jnp.int32)
  params = dec.decode_params(cfg, jax.jit(model_cls(cfg).init)(jax.random.key(0), x, x))
  return cfg, params, random_sources(cfg.vocab_size, w["batch"], src_len)


def step_cost(cfg, rows: int, cache_len: int, src_len: int,
              sources: int | None = None) -> tuple[float, float]:
  """(matmul FLOPs, minimum bytes read) of one cached decode step of `rows` rows decoding
  `sources` sources (rows / beams; default rows): attention over all `cache_len` cache slots
  (what the step computes), weights read once per step, the cross-attention K, V once per
  source (a source's beams share them)."""
  d, f, v, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_decoder_layers
  sources = rows if sources is None else sources
  size = np.dtype(jnp.dtype(cfg.dtype)).itemsize
  flops = 2.0 * rows * (n * (6 * d * d + 2 * d * f + 2 * cache_len * d + 2 * src_len * d)
                        + d * v)
  weights = n * (6 * d * d + 2 * d * f + 12 * d + f) + d * v
  kv = n * 2 * d * (rows * cache_len + sources * src_len)
  return flops, float(size * (weights + kv))


def read_bandwidth(mbytes: int = 256, repeats: int = 7) -> dict:
  """Bytes/s of a jitted sum over an `mbytes` MB float32 array, best of `repeats`."""
  x = jnp.ones((mbytes * 2 ** 20 // 4,), jnp.float32)
  times = timed_calls(jax.jit(jnp.sum), x, repeats=repeats)
  return dict(mbytes=mbytes, best_s=min(times), bytes_per_s=x.nbytes / min(times),
              times_s=times)


def roofline(cfg, batch: int, beams: int, src_len: int, new_tokens: int, run_s: float,
             peak_flops: float, bandwidth: float) -> dict:
  """Model FLOP/s, bytes/s and the roofline limit of one cached decode call."""
  flops, nbytes = step_cost(cfg, batch * beams, new_tokens, src_len, sources=batch)
  compute_s, memory_s = flops / peak_flops, nbytes / bandwidth
  bound_s = new_tokens * max(compute_s, memory_s)
  return dict(flops_per_step=flops, bytes_per_step=nbytes,
              model_flops_per_s=new_tokens * flops / run_s,
              bytes_per_s=new_tokens * nbytes / run_s,
              fraction_of_peak=new_tokens * flops / run_s / peak_flops,
              bound="compute" if compute_s > memory_s else "memory",
              limit_tokens_per_s=batch * new_tokens / bound_s,
              fraction_of_limit=bound_s / run_s)


def _time_decode(cfg, params, src, strategy, new_tokens, full_recompute, repeats, warmup=0):
  def call():
    t, c = time.perf_counter(), time.process_time()
    out = decoding.decode(cfg, params, src, strategy, bos_id=BOS, eos_id=EOS,
                          max_len=new_tokens, min_len=new_tokens,
                          full_recompute=full_recompute)
    return time.perf_counter() - t, time.process_time() - c, out

  first, _, out = call()
  assert (out.lengths == new_tokens).all(), out.lengths
  for _ in range(warmup - 1):
    call()
  runs = [call()[:2] for _ in range(repeats)]
  warm = statistics.median(r[0] for r in runs)
  return dict(first_call_s=first, compile_s=max(first - warm, 0.0), run_s=warm,
              runs_s=[r[0] for r in runs], cpu_s=statistics.median(r[1] for r in runs),
              tokens_per_s=src.shape[0] * new_tokens / warm)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="small,base")
  ap.add_argument("--strategies", default="greedy,beam4")
  ap.add_argument("--modes", default="cached,full",
                  help="cached, full (recompute) and/or latency (batch 1)")
  ap.add_argument("--src_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5, help="warm calls timed (cached)")
  ap.add_argument("--full_repeats", type=int, default=1, help="warm calls timed (full)")
  ap.add_argument("--latency_src_len", type=int, default=28)
  ap.add_argument("--latency_new_tokens", type=int, default=30)
  ap.add_argument("--latency_repeats", type=int, default=20, help="warm calls timed (latency)")
  ap.add_argument("--dtype", default="float32", help="compute dtype (float32 or bfloat16)")
  ap.add_argument("--kernels", default="", help="model.kernels (default: the config's, auto)")
  ap.add_argument("--f32_dots", default="auto", choices=("auto", "xla", "ynnpack"),
                  help="the f32 loop's dots on CPU: auto = XLA's own dot emitter without "
                       "AVX-512, YNNPACK (XLA's default) with it; xla or ynnpack force one, to "
                       "A/B the f32 decode loop's XLA options (kernels/cpu.py) on a new machine")
  ap.add_argument("--workload", default="cpu", choices=tuple(WORKLOAD_SETS),
                  help="batch sizes: cpu (the CPU targets'), gpu (batch 128), dry")
  ap.add_argument("--peak_n", type=int, default=2048, help="matmul peak's n (n^3 dot)")
  ap.add_argument("--bandwidth_mb", type=int, default=256,
                  help="size of the array the read bandwidth is measured on")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "decode.json"))
  args = ap.parse_args(argv)
  workloads = WORKLOAD_SETS[args.workload]
  for name in args.models.split(","):
    if name not in workloads:
      sys.exit(f"unknown model {name!r} for workload {args.workload}; choose from "
               f"{', '.join(workloads)}")
  cpu_kernels.F32_DOTS = args.f32_dots
  jax.config.update("jax_enable_compilation_cache", False)   # compile times from scratch

  rows, cfgs = [], {}
  for name in args.models.split(","):
    w = workloads[name]
    cfg, params, src = workload(name, args.dtype, args.src_len, kernels=args.kernels,
                                workload_set=args.workload)
    src1 = random_sources(cfg.vocab_size, 1, args.latency_src_len)
    cfgs[name] = cfg
    for sname in args.strategies.split(","):
      result = {}
      for mode in args.modes.split(","):
        if mode == "latency":
          r = _time_decode(cfg, params, src1, STRATEGIES[sname], args.latency_new_tokens,
                           False, args.latency_repeats, warmup=2)
          r.update(src_len=args.latency_src_len, new_tokens=args.latency_new_tokens,
                   ms_per_sentence=1e3 * r["run_s"])
          result[mode] = r
          print(f"  {name:5s} {sname:6s} {mode:7s} {r['ms_per_sentence']:7.1f} ms/sentence "
                f"(batch 1, {args.latency_src_len} -> {args.latency_new_tokens} tokens; cpu "
                f"{1e3 * r['cpu_s']:.1f} ms)", file=sys.stderr, flush=True)
          continue
        r = _time_decode(cfg, params, src, STRATEGIES[sname], args.new_tokens,
                         mode == "full", args.repeats if mode == "cached" else args.full_repeats)
        result[mode] = r
        print(f"  {name:5s} {sname:6s} {mode:6s} {r['tokens_per_s']:9.0f} tok/s  "
              f"run {r['run_s']:.3f}s (cpu {r['cpu_s']:.3f}s)  compile {r['compile_s']:.1f}s",
              file=sys.stderr, flush=True)
      row = dict(model=name, strategy=sname, batch=w["batch"], vocab=cfg.vocab_size,
                 target_tokens_per_s=TARGET_SETS[args.workload].get((name, sname)), **result)
      if "cached" in result and "full" in result:
        row["speedup"] = result["cached"]["tokens_per_s"] / result["full"]["tokens_per_s"]
      rows.append(row)

  # The machine's peaks, measured after the decode runs so they don't disturb them.
  peak = matmul_peak(args.dtype, n=args.peak_n)
  bandwidth = read_bandwidth(args.bandwidth_mb)
  for r in rows:
    if "cached" in r:
      beams = getattr(STRATEGIES[r["strategy"]], "size", 1)
      r["cached"]["roofline"] = roofline(
          cfgs[r["model"]], r["batch"], beams, args.src_len, args.new_tokens,
          r["cached"]["run_s"], peak["flops_per_s"], bandwidth["bytes_per_s"])

  head = (f"{'model':6s} {'strategy':8s} {'batch':>5s} {'cached tok/s':>12s} {'target':>7s} "
          f"{'GFLOP/s':>8s} {'% peak':>6s} {'GB/s':>5s} {'limit':>6s} {'% limit':>7s} "
          f"{'full tok/s':>10s} {'speedup':>8s} {'compile s':>9s} {'batch-1 ms':>10s}")
  print(f"\nDecode speed: src_len {args.src_len}, {args.new_tokens} new tokens, "
        f"dtype {args.dtype}, jax {jax.__version__}, {cpu_name()}, XLA options of the f32 "
        f"loop {cpu_kernels.decode_compiler_options(get_config('small')) or 'default'}, "
        f"load average {os.getloadavg()[0]:.1f}\n"
        f"Measured in this run: matmul peak {peak['flops_per_s'] / 1e9:.0f} GFLOP/s "
        f"({args.dtype}, {peak['n']}^3), read bandwidth "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (sum over {bandwidth['mbytes']} MB); "
        f"limit = roofline tokens/s of the cached step's\nminimum work ({COST_FORMULA})\n"
        f"batch-1 ms: latency mode, one {args.latency_src_len}-token source, "
        f"{args.latency_new_tokens} new tokens, median of {args.latency_repeats} calls\n"
        f"{head}\n{'-' * len(head)}")
  def cell(value, width, fmt):  # "-" for what this run did not measure
    return f"{'-' if value is None else format(value, fmt):>{width}s}"

  def pct(x):
    return None if x is None else 100 * x

  for r in rows:
    c, f, lat = r.get("cached") or {}, r.get("full") or {}, r.get("latency") or {}
    rl = c.get("roofline") or {}
    print(f"{r['model']:6s} {r['strategy']:8s} {r['batch']:5d} "
          f"{cell(c.get('tokens_per_s'), 12, '.0f')} "
          f"{cell(r['target_tokens_per_s'], 7, 'd')} "
          f"{cell(rl.get('model_flops_per_s', 0) / 1e9 if rl else None, 8, '.1f')} "
          f"{cell(pct(rl.get('fraction_of_peak')), 5, '.0f')}% "
          f"{cell(rl.get('bytes_per_s', 0) / 1e9 if rl else None, 5, '.1f')} "
          f"{cell(rl.get('limit_tokens_per_s'), 6, '.0f')} "
          f"{cell(pct(rl.get('fraction_of_limit')), 6, '.0f')}% "
          f"{cell(f.get('tokens_per_s'), 10, '.0f')} "
          f"{cell(r.get('speedup'), 7, '.1f')}{'x' if 'speedup' in r else ' '} "
          f"{cell(c.get('compile_s'), 9, '.1f')} {cell(lat.get('ms_per_sentence'), 10, '.1f')}")
  small_greedy = next((r for r in rows if r["model"] == "small" and r["strategy"] == "greedy"
                       and "speedup" in r), None)
  if small_greedy:
    ok = small_greedy["speedup"] >= TARGET_SPEEDUP
    print(f"\nsmall greedy: cache is {small_greedy['speedup']:.1f}x faster than recomputing "
          f"({'meets' if ok else 'MISSES'} the >= {TARGET_SPEEDUP:.0f}x requirement)")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              jax=jax.__version__, device=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), machine=platform.machine(), cpu=cpu_name(),
              load_avg=os.getloadavg(), args=vars(args),
              cpu_f32_decode_options=cpu_kernels.decode_compiler_options(get_config("small")),
              matmul_peak=peak, read_bandwidth=bandwidth, cost_formula=COST_FORMULA,
              backend=jax.default_backend(), attention=accelerator.verdicts(),
              device_peak_bytes=device_peak_bytes())
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
