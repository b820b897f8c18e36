"""Checks bench/gpu/run.py runs in their own processes; each prints one JSON line
(`RESULT {...}`) and exits 0 when it could look, whatever it found.

    python bench/gpu/checks.py attention [--preset base] [--batch 16] [--length 64]
        Which attention the compiled programs run: lowers and compiles a bf16 train step
        (`train_lib.Trainer.step`, on packed rows as train.py's) and the cached decode loop
        (greedy and beam 4) of the preset with the default kernels ("auto": `accelerator`
        on a GPU), and counts the cuDNN fused-attention custom calls (`__cudnn$fmha...`)
        in each compiled HLO (and every custom call's target, should XLA name them
        otherwise), with kernels/accelerator.py's verdict for every form of attention it
        traced.
    python bench/gpu/checks.py compile_probe
        Cold compile times (no compile cache) of three tiny programs: a broadcast, a
        1024x1024 matmul and a sum, a chain of elementwise ops. Each is one or two
        kernels and nothing to autotune but the matmul: seconds here are a cost per
        program (PTX assembly, the driver), not XLA's autotuning.
    python bench/gpu/checks.py compile_profile [--preset small] [--batch 128] [--length 256]
        Where the cold compile of a bf16 train step of the preset (on packed rows) goes:
        seconds tracing, lowering and compiling (no compile cache), and XLA's own account
        of the compile from a host trace (`jax.profiler`, its TraceMe events: HLO passes,
        autotuning, LLVM, PTX assembly, cuDNN): the events with the most time, in all and
        not counting the events inside them (summed over threads: XLA compiles on
        several), with how many times each ran.
    python bench/gpu/checks.py checkpoints WORKDIR
        Every checkpoint of WORKDIR restored (`load.load_workdir`, which checks each
        array's checksum): its step and a SHA-256 of its parameters, or the error.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FMHA = re.compile(r"__cudnn\$fmha\w*")
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def _count(names) -> dict:
  found = {}
  for name in names:
    found[name] = found.get(name, 0) + 1
  return found


def fmha_calls(hlo_text: str) -> dict:
  """{custom-call target: count} of cuDNN's fused attention in compiled HLO text."""
  return _count(FMHA.findall(hlo_text))


def _program(compiled, seconds: float) -> dict:
  text = compiled.as_text()
  return dict(fmha=fmha_calls(text), custom_calls=_count(CUSTOM_CALL.findall(text)),
              compile_s=seconds)


def _train_step(preset: str, batch: int, length: int, workload: str):
  """(config, the jitted bf16 train step, its abstract arguments) of the preset at
  batch x length, bench_train.py's workload otherwise; the batch packed as train.py's are
  (tokens, segment ids and positions of source and target)."""
  import jax
  import jax.numpy as jnp
  import bench_train
  from seq2seq import train_lib
  cfg = bench_train.workload_config(preset, "bfloat16", workload=workload)
  cfg = cfg.replace(train=cfg.train.replace(batch_size=batch, seq_len=length))
  trainer = train_lib.Trainer(cfg, bos_id=bench_train.BOS)
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=trainer.batch_sharding)
  return cfg, trainer.step, (trainer.abstract_state,
                             {k: tokens for k in bench_train.BATCH_KEYS})


def attention(preset: str, batch: int, length: int, workload: str,
              strategies=("greedy", "beam4")) -> dict:
  import jax
  import jax.numpy as jnp
  from seq2seq import decoding, search
  from seq2seq.kernels import accelerator
  from seq2seq.model import Transformer

  cfg, step, args = _train_step(preset, batch, length, workload)
  out = dict(preset=preset, batch=batch, length=length, backend=jax.default_backend(),
             kernels=cfg.model.kernels, requested=accelerator.requested())
  t = time.perf_counter()
  hlo = step.lower(*args).compile()
  out["train_step"] = _program(hlo, time.perf_counter() - t)

  model = cfg.model.replace(dropout_rate=0.0)
  x = jnp.ones((1, 4), jnp.int32)
  params = jax.eval_shape(Transformer(model).init, jax.random.key(0), x, x)
  src = jax.ShapeDtypeStruct((batch, length // 2), jnp.int32)
  known = {"greedy": search.Greedy(), "beam4": search.Beam(4)}
  for name, strategy in ((f"decode_{s}", known[s]) for s in strategies):
    t = time.perf_counter()
    hlo = decoding.decode_jit_for(model).lower(
        params, src, jax.random.key(0), cfg=model, strategy=strategy, max_len=length,
        per_row_limit=False, bos_id=1, eos_id=2, pad_id=0, min_len=0, full_recompute=False,
        return_logits=False).compile()
    out[name] = _program(hlo, time.perf_counter() - t)
  out["verdicts"] = accelerator.verdicts()
  out["cudnn_in_train_step"] = bool(out["train_step"]["fmha"])
  out["cudnn_in_decode"] = any(bool(out[f"decode_{s}"]["fmha"]) for s in strategies)
  return out


def compile_probe() -> dict:
  import jax
  import jax.numpy as jnp
  programs = {
      "broadcast": (lambda: jnp.ones((256, 256)), ()),
      "matmul_sum": (lambda a, b: (a @ b).sum(), (jnp.zeros((1024, 1024)),) * 2),
      "elementwise": (lambda x: jnp.tanh(x * 2.0 + 1.0).astype(jnp.bfloat16), (jnp.zeros(4096),)),
  }
  out = dict(backend=jax.default_backend(), compile_s={})
  for name, (fn, args) in programs.items():
    t = time.perf_counter()
    jax.block_until_ready(jax.jit(fn)(*args))
    out["compile_s"][name] = round(time.perf_counter() - t, 3)
  return out


def _event_name(name: str) -> str:
  """One name for every instance of an event: no fusion number, no program name."""
  return re.sub(r"\.\d+$", "", re.sub(r" \(jit_\w+\)$", "", name))


def trace_totals(events: list[dict], top: int = 25) -> dict:
  """Complete trace events ({name, ts, dur, pid, tid}, microseconds) summed by name, the
  `top` largest with their counts: in all (`by_total`), and not counting the events nested
  inside them on the same thread (`by_self`: one thread's add up to its busy time)."""
  total, own, count = {}, {}, {}
  threads = {}
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
  for evs in threads.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []   # [end, name, own time so far]
    def close(entry):
      total[entry[1]] = total.get(entry[1], 0.0) + entry[3]
      own[entry[1]] = own.get(entry[1], 0.0) + entry[2]
    for e in evs:
      while stack and stack[-1][0] <= e["ts"]:
        close(stack.pop())
      name, dur = _event_name(e["name"]), float(e["dur"])
      if stack:
        stack[-1][2] -= dur
      count[name] = count.get(name, 0) + 1
      stack.append([e["ts"] + dur, name, dur, dur])
    while stack:
      close(stack.pop())
  rank = lambda d: [dict(name=n, s=round(v / 1e6, 3), count=count[n])
                    for n, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
  return dict(by_total=rank(total), by_self=rank(own))


def compile_profile(preset: str, batch: int, length: int, workload: str) -> dict:
  import glob
  import gzip
  import tempfile
  import jax

  cfg, step, args = _train_step(preset, batch, length, workload)
  out = dict(preset=preset, batch=batch, length=length, backend=jax.default_backend(),
             kernels=cfg.model.kernels)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0   # Python's calls would crowd out XLA's events
  options.host_tracer_level = 3     # XLA's passes and their parts
  options.enable_hlo_proto = False
  with tempfile.TemporaryDirectory() as where:
    try:
      jax.profiler.start_trace(where, create_perfetto_trace=True, profiler_options=options)
    except Exception as e:   # noqa: BLE001 - the compile is still timed, without a trace
      out["profile"] = f"the profiler did not start: {type(e).__name__}: {e}"[:300]
    t0 = time.perf_counter()
    traced = step.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    out.update(trace_s=round(t1 - t0, 2), lower_s=round(t2 - t1, 2), compile_s=round(t3 - t2, 2))
    if "profile" in out:
      return out
    jax.profiler.stop_trace()
    found = glob.glob(os.path.join(where, "**", "*trace.json.gz"), recursive=True)
    if not found:
      out["profile"] = "no trace written"
      return out
    with gzip.open(found[0], "rt") as f:
      trace = json.load(f)
  out["profile"] = trace_totals(trace["traceEvents"] if isinstance(trace, dict) else trace)
  return out


def checkpoints(workdir: str) -> dict:
  import jax
  import numpy as np
  from seq2seq import checkpoint as ckpt_lib
  from seq2seq.load import load_workdir
  steps = ckpt_lib.Checkpoints(workdir, read_only=True).steps()
  loaded = {}
  for step in steps:
    try:
      _, params, _ = load_workdir(workdir, step)
      h = hashlib.sha256()
      for leaf in jax.tree_util.tree_leaves(params):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
      loaded[str(step)] = dict(ok=True, sha256=h.hexdigest())
    except Exception as e:   # noqa: BLE001 - recorded, whatever it is
      loaded[str(step)] = dict(ok=False, error=f"{type(e).__name__}: "
                                               f"{(str(e).splitlines() or [''])[0][:300]}")
  return dict(workdir=workdir, steps=steps, checkpoints=loaded,
              all_load=bool(steps) and all(v["ok"] for v in loaded.values()))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="what", required=True)
  a = sub.add_parser("attention")
  a.add_argument("--preset", default="base")
  a.add_argument("--workload", default="gpu", help="bench_train.py's workload set")
  a.add_argument("--batch", type=int, default=16)
  a.add_argument("--length", type=int, default=64)
  a.add_argument("--strategies", default="greedy,beam4", help="decode loops compiled")
  c = sub.add_parser("checkpoints")
  c.add_argument("workdir")
  sub.add_parser("compile_probe")
  p = sub.add_parser("compile_profile")
  p.add_argument("--preset", default="small")
  p.add_argument("--workload", default="gpu", help="bench_train.py's workload set")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--length", type=int, default=256)
  args = ap.parse_args(argv)
  if args.what in ("compile_probe", "compile_profile"):   # cold: no compile cache
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    r = (compile_probe() if args.what == "compile_probe" else
         compile_profile(args.preset, args.batch, args.length, args.workload))
    print("RESULT " + json.dumps(r), flush=True)
    return 0
  from seq2seq import compile_cache
  compile_cache.enable()
  if args.what == "attention":
    r = attention(args.preset, args.batch, args.length, args.workload,
                  tuple(args.strategies.split(",")))
  else:
    r = checkpoints(args.workdir)
  print("RESULT " + json.dumps(r), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
