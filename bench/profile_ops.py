"""Where the time goes: warm train steps or decode calls under `jax.profiler`, summed per op.

    python bench/profile_ops.py train --preset small                  # ~1 min
    python bench/profile_ops.py train --preset base --dtype bfloat16
    python bench/profile_ops.py decode --preset small --strategy beam4
    python bench/profile_ops.py decode --preset base --top 40 --hlo /tmp/decode.hlo

Same workloads as bench_train.py / bench_decode.py. Every op the trace shows (XLA:CPU
thunks: `dot.12`, `ynn_fusion.3`, `loop_fusion.7`, ...) is matched with its instruction in
the compiled HLO, whose metadata names the code that produced it
(`decoder/layers_1/ffn_norm/ffn/wi/dot_general`). The table sums the time per source
location with layer indices merged (`layers_*`) and marks backward-pass ops (`bwd`).
`ops` is the sum of op durations: with 2 threads it may exceed the wall time; `busy` is
the wall time covered by at least one op, so 1 - busy is time between ops (executor
overhead, Python, waiting). XLA runs independent ops side by side, and two that share the
cores each take longer than alone: the `share` column splits every moment between the ops
running then, so it adds up to the busy time and says what an op costs the step.

Tracing has a cost: small ops come out up to ~2x longer than untraced, so use the table to
rank where time goes and confirm a change with bench_train.py / bench_decode.py.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+) ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WRAPPER = re.compile(r"^(?:jit|jvp|transpose|vmap|remat|checkpoint)\((.*)\)$")


def hlo_index(hlo_text: str) -> dict:
  """instruction name -> (shape, opcode, source path) from compiled HLO text."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m:
      src = _OP_NAME.search(line)
      out[m.group(1)] = (m.group(2), m.group(3), src.group(1) if src else "")
  return out


def location(op_name: str) -> str:
  """A short, layer-merged label for a metadata op_name."""
  bwd = "transpose(" in op_name
  parts = []
  for p in op_name.split("/"):
    while (m := _WRAPPER.match(p)):  # jvp(transpose(f)) -> f
      p = m.group(1)
    if p in ("while", "body", "cond", "", "<lambda>", "_decode_impl", "Transformer"):
      continue
    parts.append(re.sub(r"layers_\d+", "layers_*", p))
  label = "/".join(parts[-5:]) or "(no metadata)"
  return ("bwd " if bwd else "") + label


def wall_shares(spans: list[tuple[float, float]]) -> tuple[list[float], float]:
  """Each [start, end) span's share of the wall time: while n spans run at once, each is
  charged 1/n of that time. The shares add up to the busy time (the union of the spans),
  which is also returned. Two dots that run side by side on two cores each take about
  twice as long as alone; their shares show what each actually costs the step."""
  edges = sorted({t for span in spans for t in span})
  starts = collections.defaultdict(list)
  for i, (s, _) in enumerate(spans):
    starts[s].append(i)
  shares, active, busy = [0.0] * len(spans), set(), 0.0
  for t0, t1 in zip(edges, edges[1:]):
    active = {i for i in active.union(starts.get(t0, ())) if spans[i][1] > t0}
    if active:
      busy += t1 - t0
      for i in active:
        shares[i] += (t1 - t0) / len(active)
  return shares, busy


def summarize(trace_path: str, index: dict, iters: int, wall_s: float, top: int) -> str:
  with gzip.open(trace_path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  ops = [e for e in events if e.get("ph") == "X" and e.get("name") in index]
  if not ops:
    return "no op events in the trace (is this XLA:CPU?)"
  spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in ops]
  shares, busy = wall_shares(spans)
  by_loc, by_kind, by_op, loc_wall, op_wall = (collections.Counter() for _ in range(5))
  count = collections.Counter()
  for e, share in zip(ops, shares):
    shape, opcode, src = index[e["name"]]
    us = float(e.get("dur", 0.0))
    loc = location(src)
    by_loc[loc] += us
    loc_wall[loc] += share
    count[loc] += 1
    kind = "dot" if ("dot" in e["name"] or "dot" in src.rsplit("/", 1)[-1]) else opcode
    by_kind[kind] += us
    by_op[(e["name"], shape, loc)] += us
    op_wall[(e["name"], shape, loc)] += share
  total = sum(by_loc.values())
  per = 1e3 * iters  # us -> ms per iteration
  lines = [f"wall {1e3 * wall_s / iters:.1f} ms/iter; ops {total / per:.1f} ms/iter "
           f"(sum over threads); busy {busy / per:.1f} ms/iter = "
           f"{100 * busy / 1e6 / wall_s:.0f}% of wall; {len(ops) / iters:.0f} ops/iter",
           "(ms/iter: an op's own duration; share: its part of the busy time, each moment "
           "split between the ops running then, so shares add up to the busy time)"]
  if busy / 1e6 < 0.6 * wall_s:
    lines.append("(ops cover little of the wall time: dots that XLA runs itself on Eigen's "
                 "thread pool, as in the f32 decode loop, are traced at launch, not for "
                 "their run time)")
  lines += ["", f"{'ms/iter':>8s} {'share':>7s} {'%ops':>5s} {'n/iter':>6s}  by source location"]
  for loc, us in by_loc.most_common(top):
    lines.append(f"{us / per:8.2f} {loc_wall[loc] / per:7.2f} {100 * us / total:5.1f} "
                 f"{count[loc] / iters:6.0f}  {loc}")
  lines += ["", f"{'ms/iter':>8s} {'%ops':>5s}  by op kind"]
  for kind, us in by_kind.most_common(12):
    lines.append(f"{us / per:8.2f} {100 * us / total:5.1f}  {kind}")
  lines += ["", f"{'ms/iter':>8s} {'share':>7s} {'%ops':>5s}  top single ops (name, shape, location)"]
  for (name, shape, loc), us in by_op.most_common(min(top, 25)):
    lines.append(f"{us / per:8.2f} {op_wall[(name, shape, loc)] / per:7.2f} "
                 f"{100 * us / total:5.1f}  {name} {shape}  {loc}")
  return "\n".join(lines)


def _trace(fn, iters: int, d: str):
  """Calls fn iters times under jax.profiler, writing the trace under d: its Perfetto
  file's path, and the seconds the calls took."""
  import jax
  wall = 0.0   # of the calls alone: starting and stopping the trace take seconds
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(iters):
      t = time.perf_counter()
      fn()
      wall += time.perf_counter() - t
  paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
  return max(paths, key=os.path.getmtime), wall


def profile_train(preset: str, dtype: str):
  import jax
  import numpy as np
  import bench_train as bt
  import seq2seq
  from seq2seq.config import Config, TrainConfig
  from seq2seq.train_lib import Trainer
  w = bt.WORKLOADS[preset]
  model = seq2seq.get_config(preset, vocab_size=w["vocab_size"]).replace(dtype=dtype,
                                                                         dropout_rate=0.1)
  cfg = Config(model=model, train=TrainConfig(batch_size=w["batch"], seq_len=w["length"],
                                              label_smoothing=0.1))
  trainer = Trainer(cfg, bos_id=bt.BOS)
  state = trainer.init(jax.random.key(0))
  batch = trainer.global_batch(bt.random_batch(np.random.default_rng(0), w["batch"],
                                               w["length"], w["vocab_size"]))
  hlo = trainer.step.lower(state, batch).compile().as_text()
  box = [state]

  def run():
    box[0], m = trainer.step(box[0], batch)
    jax.block_until_ready((box[0], m))

  for _ in range(2):
    run()
  return hlo, run


def profile_decode(preset: str, dtype: str, strategy: str):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import bench_decode as bd
  import seq2seq
  from seq2seq import decoding
  from seq2seq.model import Transformer
  w = bd.WORKLOADS[preset]
  cfg = seq2seq.get_config(preset, vocab_size=w["vocab_size"]).replace(dropout_rate=0.0,
                                                                       dtype=dtype)
  x = jnp.ones((1, 4), jnp.int32)
  params = jax.jit(Transformer(cfg).init)(jax.random.key(0), x, x)
  params = decoding.decode_params(cfg, params)   # as bench_decode
  src = np.random.default_rng(0).integers(3, cfg.vocab_size, (w["batch"], 32)).astype(np.int32)
  src[:, -1] = bd.EOS
  kw = dict(strategy=bd.STRATEGIES[strategy], max_len=64, per_row_limit=False, bos_id=bd.BOS,
            eos_id=bd.EOS, pad_id=0, min_len=64, full_recompute=False, return_logits=False)
  hlo = decoding.decode_jit_for(cfg).lower(params, jnp.asarray(src), jax.random.key(0),
                                            cfg=cfg, **kw).compile().as_text()

  def run():
    decoding.decode(cfg, params, src, bd.STRATEGIES[strategy], bos_id=bd.BOS, eos_id=bd.EOS,
                    max_len=64, min_len=64)

  for _ in range(2):
    run()
  return hlo, run


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("train", "decode"))
  ap.add_argument("--preset", default="small", choices=("small", "base"))
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--strategy", default="greedy", choices=("greedy", "beam4"))
  ap.add_argument("--iters", type=int, default=2)
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--hlo", default="", help="also write the compiled HLO text here")
  ap.add_argument("--trace_dir", default="", help="keep the trace here (to open in "
                  "ui.perfetto.dev); else it is removed once summed")
  args = ap.parse_args(argv)
  if args.what == "train":
    from seq2seq.kernels import malloc
    malloc.keep_freed_memory()   # as train.py does, before JAX starts
    hlo, run = profile_train(args.preset, args.dtype)
    what = f"train step, {args.preset} {args.dtype}"
  else:
    hlo, run = profile_decode(args.preset, args.dtype, args.strategy)
    what = f"decode call (64 steps), {args.preset} {args.strategy} {args.dtype}"
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(hlo)
  with tempfile.TemporaryDirectory(prefix="seq2seq_prof_") as tmp:
    path, wall = _trace(run, args.iters, args.trace_dir or tmp)
    print(f"{what}, {args.iters} iterations traced\n")
    print(summarize(path, hlo_index(hlo), args.iters, wall, args.top))
  if args.trace_dir:
    print(f"\ntrace: {path}")


if __name__ == "__main__":
  main()
