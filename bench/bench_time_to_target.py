"""Time-to-target of the default job: how long `python train.py` takes to reach 99% exact
match on held-out data, from a cold start.

    python bench/bench_time_to_target.py            # ~2-3 min on 2 CPU cores

Runs `python train.py --workdir <tmp>` (the embedded default, 300 steps) in a subprocess
with a fresh TFDS data dir (TFDS_DATA_DIR=<tmp>/tfds, so dataset generation, vocabulary and
tokenization are included) and an empty compile cache (SEQ2SEQ_COMPILE_CACHE=<tmp>/jax, so
XLA compiles everything as on a new machine; `--warm_cache` keeps the user's instead), and
reads `<workdir>/metrics.jsonl`. Reports
  * time to target: seconds from launch to the first validation evaluation (every
    eval_every=100 steps, 200 examples decoded greedily) with exact match >= 99%,
  * total wall time (full validation + test decoding included) and the final test figures.
Target (the project's): <= 120 s. Writes bench/results/time_to_target.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from seq2seq.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 120.0   # the project's speed target


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", type=float, default=0.99)
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "time_to_target.json"))
  ap.add_argument("--warm_cache", action="store_true",
                  help="use the user's compile cache (a second run) instead of an empty one")
  args, extra = ap.parse_known_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, "run")
    env = dict(os.environ, TFDS_DATA_DIR=os.path.join(tmp, "tfds"))
    if not args.warm_cache:
      env.pop("JAX_COMPILATION_CACHE_DIR", None)
      env["SEQ2SEQ_COMPILE_CACHE"] = os.path.join(tmp, "jax")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--workdir", workdir,
           "--no_progress", *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    total = time.time() - t0
    if proc.returncode != 0:
      sys.exit(f"error: train.py exited with {proc.returncode}:\n{proc.stdout[-2000:]}")
    rows = read_metrics(workdir)
  evals = [r for r in rows if r.get("split") == "validation" and "exact_match" in r]
  hit = next((r for r in evals if r["exact_match"] >= args.target), None)
  test = next((r for r in reversed(rows) if r.get("split") == "test"), {})
  first_train = next((r for r in rows if r.get("split") == "train"), None)
  res = dict(command=" ".join(["python", "train.py", *extra]), total_s=total,
             compile_cache="warm (the user's)" if args.warm_cache else "empty",
             time_to_target_s=None if hit is None else hit["time"] - t0,
             target_step=None if hit is None else hit["step"], target=args.target,
             validation=[{k: r[k] for k in ("step", "exact_match", "bleu")} | {
                 "t_s": r["time"] - t0} for r in evals],
             first_log_s=None if first_train is None else first_train["time"] - t0,
             test={k: test.get(k) for k in ("exact_match", "bleu", "chrf", "examples")},
             load_avg=os.getloadavg())
  print(f"{res['command']}: time to {100 * args.target:.0f}% validation exact match: "
        + (f"{res['time_to_target_s']:.0f} s (step {res['target_step']})" if hit else "not reached")
        + f"; total {total:.0f} s; test exact match {test.get('exact_match')} on "
        f"{test.get('examples')} examples; compile cache {res['compile_cache']}; "
        f"target <= {TARGET_S:.0f} s")
  for r in res["validation"]:
    print(f"  step {r['step']:4d} at {r['t_s']:5.0f} s: exact match {r['exact_match']:.3f}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
