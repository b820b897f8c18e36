"""A change's speed, judged in one process: an older commit against the working tree.

    python bench/ab.py HEAD train --preset small --dtype bfloat16            # ~1.5 min
    python bench/ab.py main decode --preset small --strategy beam4 --dtype bfloat16

A shared VM slows by about a fifth for seconds at a time, whatever runs on it
(docs/performance.md, "How to measure"), so two benchmark processes run one after the
other can differ by more than the change being judged. Here both versions live in one
process: the commit's `seq2seq/` (exported with `git archive`, its imports renamed to
`seq2seq_old`) beside the working tree's `seq2seq`, each with its own jitted train step
(bench_train.py's workload) or decode call (bench_decode.py's, cached, 64 new tokens). Each
pair times one of each, in alternating order (the best of `--calls` calls each), so a burst
slows both. Prints the medians and the median of the pairwise ratios old time / new time
(> 1: the working tree is faster), checks that the two decode the same tokens, and writes
JSON (`--out`).
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
OLD = "seq2seq_old"
# `from seq2seq.x import`, `from seq2seq import`, `import seq2seq`, `"seq2seq.` (importlib)
_IMPORTS = re.compile(r'(\bfrom\s+|\bimport\s+|["\'])seq2seq(?=[\s.;,"\']|$)', re.M)


def rename_imports(source: str, name: str = OLD) -> str:
  """The package's own imports of `seq2seq` (and its importlib strings) renamed to `name`."""
  return _IMPORTS.sub(lambda m: m.group(1) + name, source)


def export_package(commit: str, into: str, repo: str = ROOT, name: str = OLD) -> str:
  """`commit`'s seq2seq/ written to `into`/`name`/ with its imports renamed; returns that
  directory. Raises ValueError (one line) for a commit git does not know."""
  proc = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit, "seq2seq"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  if proc.returncode != 0:
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    raise ValueError(f"git archive {commit} seq2seq in {repo}: {err[-1] if err else 'failed'}")
  dest = os.path.join(into, name)
  with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
    for member in tar.getmembers():
      if not member.isfile():
        continue
      path = os.path.join(dest, os.path.relpath(member.name, "seq2seq"))
      os.makedirs(os.path.dirname(path), exist_ok=True)
      data = tar.extractfile(member).read()
      if path.endswith(".py"):
        data = rename_imports(data.decode(), name).encode()
      with open(path, "wb") as f:
        f.write(data)
  return dest


def train_runner(package: str, preset: str, dtype: str, kernels: str = ""):
  """A function that runs one train step of bench_train.py's workload with `package`."""
  import jax
  import bench_train
  trainer, state, _, batches = bench_train.workload(preset, dtype, package, kernels)
  done = [state, 0]   # the state after the steps so far, and their count

  def step():
    state, metrics = trainer.step(done[0], batches[done[1] % len(batches)])
    jax.block_until_ready((state, metrics))
    done[:] = [state, done[1] + 1]
  return step


def decode_runner(package: str, preset: str, dtype: str, strategy: str, kernels: str = ""):
  """A function that runs one cached decode call of bench_decode.py's workload."""
  import bench_decode
  decoding = importlib.import_module(package + ".decoding")
  cfg, params, src = bench_decode.workload(preset, dtype, package=package, kernels=kernels)
  want = bench_decode.STRATEGIES[strategy]
  strat = getattr(decoding, type(want).__name__)(**vars(want))   # this package's class

  def call():
    return decoding.decode(cfg, params, src, strat, bos_id=bench_decode.BOS,
                           eos_id=bench_decode.EOS, max_len=64, min_len=64).tokens
  return call


def alternate(runs: dict, pairs: int, calls: int) -> dict[str, list[float]]:
  """Seconds per call of each runner (the best of `calls`), `pairs` times, the order
  alternating between pairs."""
  names, times = list(runs), {k: [] for k in runs}
  for p in range(pairs):
    for k in (names if p % 2 == 0 else names[::-1]):
      best = float("inf")
      for _ in range(calls):
        t = time.perf_counter()
        runs[k]()
        best = min(best, time.perf_counter() - t)
      times[k].append(best)
  return times


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("commit", help="the older version: any commit git knows (HEAD, a hash, ...)")
  ap.add_argument("mode", choices=("train", "decode"))
  ap.add_argument("--preset", default="small", choices=("small", "base"))
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--strategy", default="greedy", choices=("greedy", "beam4"),
                  help="decode only")
  ap.add_argument("--kernels", default="",
                  help="model.kernels of the working tree's side (default: the config's)")
  ap.add_argument("--pairs", type=int, default=12)
  ap.add_argument("--calls", type=int, default=3, help="calls per turn; the best one counts")
  ap.add_argument("--out", default=os.path.join(HERE, "results", "ab.json"))
  args = ap.parse_args(argv)
  if args.pairs < 1 or args.calls < 1:
    sys.exit("error: --pairs and --calls must be at least 1")
  from seq2seq.kernels import malloc
  if args.mode == "train":   # as train.py and bench_train.py do, before JAX starts
    malloc.keep_freed_memory()
  tmp = tempfile.TemporaryDirectory(prefix="ab_")
  try:
    export_package(args.commit, tmp.name)
  except ValueError as e:
    sys.exit(f"error: {e}")
  sys.path.insert(0, tmp.name)
  import jax
  jax.config.update("jax_enable_compilation_cache", False)

  what = (f"{args.mode} {args.preset} {args.dtype}"
          + (f" {args.strategy}" if args.mode == "decode" else "")
          + (f", the working tree's kernels={args.kernels}" if args.kernels else ""))
  print(f"{what}: {args.commit} ({OLD}) against the working tree, {args.pairs} pairs",
        file=sys.stderr, flush=True)
  runs, first = {}, {}
  for name, package, kernels in (("old", OLD, ""), ("new", "seq2seq", args.kernels)):
    runs[name] = (train_runner(package, args.preset, args.dtype, kernels)
                  if args.mode == "train" else
                  decode_runner(package, args.preset, args.dtype, args.strategy, kernels))
    first[name] = runs[name]()     # compiles
  same = None
  if args.mode == "decode":
    import numpy as np
    same = bool(np.array_equal(np.asarray(first["old"]), np.asarray(first["new"])))
  for name in runs:                 # warm
    runs[name]()
  malloc.release_freed_memory()
  times = alternate(runs, args.pairs, args.calls)
  ratios = [o / n for o, n in zip(times["old"], times["new"])]
  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", args.commit], text=True,
                          stdout=subprocess.PIPE).stdout.strip()
  result = dict(
      commit=args.commit, commit_hash=commit, what=what, pairs=args.pairs, calls=args.calls,
      old_s=times["old"], new_s=times["new"], old_median_s=statistics.median(times["old"]),
      new_median_s=statistics.median(times["new"]), speedup_median=statistics.median(ratios),
      speedup_range=[min(ratios), max(ratios)], same_tokens=same, kernels=args.kernels)
  print(f"old {1e3 * result['old_median_s']:.1f} ms, new {1e3 * result['new_median_s']:.1f} ms"
        f" per call (medians); new is {result['speedup_median']:.3f}x as fast (median of "
        f"{args.pairs} pairs, {min(ratios):.3f}-{max(ratios):.3f})"
        + ("" if same is None else f"; same tokens: {same}"))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
