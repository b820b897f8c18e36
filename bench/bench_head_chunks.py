"""The output head + loss of a train step, whole or in slices of the target length.

    python bench/bench_head_chunks.py            # ~1 min
    python bench/bench_head_chunks.py --dtypes bfloat16 --chunks 1,4

Times the gradient of `losses.head_cross_entropy` (the tied [V, D] head, label smoothing
0.1, 1/8 padding) for the `small` (32 x 64 rows, D 256, V 8,000) and `base` (16 x 64 rows,
D 512, V 32,000) train-step workloads, cut into 1, 2, 4 or 8 slices of the target length,
interleaved. The train step uses `losses.head_chunks(batch, length, vocab)` slices: this is
the evidence for its rule (a slice's float32 logits within ~20 MB, at least 512 rows per
slice). The slices' results are checked against the whole. JSON to bench/results/.
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

from seq2seq.losses import head_chunks, head_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_skinny import _interleaved_medians  # noqa: E402

WORKLOADS = {"small": dict(batch=32, length=64, d=256, vocab=8000),
             "base": dict(batch=16, length=64, d=512, vocab=32000)}


def measure(batch: int, length: int, d: int, vocab: int, dtype: str, chunks: list[int],
            repeats: int) -> dict:
  ks = jax.random.split(jax.random.key(0), 3)
  y = jax.random.normal(ks[0], (batch, length, d))
  w = jax.random.normal(ks[1], (vocab, d)) * d ** -0.5
  t = jax.random.randint(ks[2], (batch, length), 1, vocab)
  t = jnp.where(jnp.arange(batch * length).reshape(batch, length) % 8 == 0, 0, t)
  wt = (t != 0).astype(jnp.float32)
  fns = {c: jax.jit(jax.value_and_grad(
      lambda y, w, c=c: head_cross_entropy(y, w, None, t, wt, 0.1, dtype, True, c)[0],
      argnums=(0, 1))) for c in chunks}
  ref = fns[chunks[0]](y, w)
  for c in chunks[1:]:
    for a, b in zip(jax.tree_util.tree_leaves(fns[c](y, w)), jax.tree_util.tree_leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(jnp.abs(b).max()))
  secs = _interleaved_medians({c: (lambda f=f: jax.block_until_ready(f(y, w)))
                               for c, f in fns.items()}, repeats, block=2)
  flops = 3 * 2.0 * batch * length * d * vocab
  return dict(batch=batch, length=length, d=d, vocab=vocab, dtype=dtype,
              rule=head_chunks(batch, length, vocab), flops=flops,
              by_chunks={str(c): dict(s=s, flops_per_s=flops / s) for c, s in secs.items()})


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--chunks", default="1,2,4,8")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "head_chunks.json"))
  args = ap.parse_args(argv)
  chunks = [int(c) for c in args.chunks.split(",")]
  results = []
  for preset in args.presets.split(","):
    for dt in args.dtypes.split(","):
      results.append(dict(preset=preset, **measure(**WORKLOADS[preset], dtype=dt,
                                                   chunks=chunks, repeats=args.repeats)))
      print(f"  {preset} {dt} done", file=sys.stderr, flush=True)
  print(f"Head + loss gradient, ms (GFLOP/s), by number of slices of the target length; "
        f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} CPUs")
  print(f"{'preset':6s} {'dtype':9s} " + " ".join(f"{c:>14d}" for c in chunks) +
        f" {'rule':>5s} {'whole/rule':>10s}")
  for r in results:
    cells = " ".join(f"{r['by_chunks'][str(c)]['s'] * 1e3:6.1f} ({r['by_chunks'][str(c)]['flops_per_s'] / 1e9:4.0f})"
                     for c in chunks)
    rule = str(r["rule"])
    ratio = (f"{r['by_chunks']['1']['s'] / r['by_chunks'][rule]['s']:9.2f}x"
             if rule in r["by_chunks"] and "1" in r["by_chunks"] else f"{'-':>10s}")
    print(f"{r['preset']:6s} {r['dtype']:9s} {cells} {r['rule']:5d} {ratio}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                   machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                   jax=jax.__version__, backend=jax.default_backend(), results=results), f,
              indent=2)
  print(f"wrote {args.out}")
  return results


if __name__ == "__main__":
  main()
