"""Mixed precision trains like float32: the default `python train.py` run in both dtypes.

    python bench/bench_precision.py             # 2 dtypes x 3 seeds x 300 steps: ~8-10 min on 2 CPU cores
    python bench/bench_precision.py --seeds 1   # float32 + bfloat16 only, no noise reference: ~3 min
    python bench/bench_precision.py --steps 30 --seeds 2 --out /tmp/p.json   # check the script: ~2 min

The run is the embedded default experiment (`get_experiment("numbers")`: tiny model, no
dropout, English->French numbers, 300 steps), trained from scratch in each dtype with each
seed 0..N-1, each run in a fresh subprocess and its own workdir:

  float32_sK      model.dtype=float32, train.seed=K
  bfloat16_sK     model.dtype=bfloat16, train.seed=K     bf16 matmul inputs, f32
                  accumulation; f32 parameters, optimizer state, softmax, LayerNorm, loss

train.seed sets the initialisation *and* the order of the training batches, so
bfloat16_sK - float32_sK is the effect of the dtype alone, and seed t - seed s within a dtype
(other initialisation, other batches at each step) is the noise it is judged against. One
noise pair is not enough: runs can have short loss spikes (a step whose loss is several
times its neighbours') at different steps, and a spike in one run of a pair dominates that
pair's largest difference. Hence three seeds: three bf16 - f32 pairs
against six seed pairs.

Everything else is the default config, except `train.log_every=1` (the training loss of every
step, not the mean of 25; it costs a host sync per step, the same in every run). The float32
and bfloat16 runs see identical batches: the TFDS data, the SentencePiece vocabulary and the
tokenized splits are built once (in `<workdir>/tfds` and `<workdir>/data`) and copied into
each run's workdir, so no run rebuilds them and all share one vocabulary.

Expected result: the bf16 and f32 loss curves lie on top of each other; bf16 - f32 is
tiny while the loss falls (< 0.1% for ~40 steps) and then, as rounding differences
compound, grows, but stays inside the seed-to-seed differences (figures and plot:
docs/performance.md). Wall time is about the same in both dtypes (the tiny model is
dominated by overheads; bf16 speed is bench_train.py's job).

Reported per run: the training loss at the last step, the steps with a loss spike, the
final validation/test metrics of `TrainResult` (loss, token accuracy, BLEU, chrF, exact
match; the final evaluation reads the whole split unless `--eval-examples` caps it), and
wall time. Per pair, over the last 100 steps: max and mean |diff| / loss of the per-step
losses, and the difference of the 100-step mean losses; then the range of each over the
bf16 - f32 pairs beside its range over the seed pairs.

Writes bench/results/precision.json and bench/results/precision.png (top: loss vs step of
every run, log scale; middle: every pair's difference per step, bf16 - f32 in orange over
the seed pairs in grey; bottom: the same as |difference| / loss on a log scale, where the
late, small differences show). `--workdir DIR` keeps the runs (DIR/float32_s0 etc., each
with config.json and metrics.jsonl) and reuses DIR/tfds and DIR/data next time; the run
directories are recreated on every invocation (a leftover run would otherwise be resumed).
Without it a temporary directory is used and removed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_train import cpu_name  # noqa: E402
DEFAULT_OUT = os.path.join(HERE, "results", "precision.json")
WINDOW = 100  # the last steps over which the curves are compared
DTYPES = ("float32", "bfloat16")


def run_name(dtype: str, seed: int) -> str:
  return f"{dtype}_s{seed}"


def run_names(seeds: int) -> dict[str, list[str]]:
  """name -> overrides on top of the default experiment: each dtype with seeds 0..seeds-1."""
  return {run_name(dtype, seed): [f"model.dtype={dtype}", f"train.seed={seed}"]
          for seed in range(seeds) for dtype in DTYPES}


def pairs(seeds: int) -> dict[str, list[tuple[str, str]]]:
  """The differences compared: the dtype's (bf16 - f32 at each seed: same initialisation,
  same batches) and the noise reference's (seed t - seed s within each dtype)."""
  return {"dtype": [(run_name("float32", s), run_name("bfloat16", s)) for s in range(seeds)],
          "seed": [(run_name(d, s), run_name(d, t)) for d in DTYPES
                   for s in range(seeds) for t in range(s + 1, seeds)]}


def base_overrides(args) -> list[str]:
  """Overrides shared by every run (and the data preparation)."""
  items = ["train.log_every=1", f"data.data_dir={args.data_dir}"]
  if args.steps is not None:
    items.append(f"train.steps={args.steps}")
  return items


def _config(overrides: list[str]):
  from seq2seq import config as config_lib
  return config_lib.override(config_lib.get_experiment("numbers"), overrides)


def _quiet():
  import absl.logging  # TFDS and Orbax log through absl, as in train.py
  absl.logging.set_verbosity(absl.logging.ERROR)


def child_prepare(overrides: list[str], data_workdir: str) -> dict:
  """Builds the TFDS data, the vocabulary and every tokenized split once, in data_workdir."""
  _quiet()
  from seq2seq.data import load_dataset
  t = time.perf_counter()
  cfg = _config(overrides)
  ds = load_dataset(cfg, data_workdir)
  for split in ds.splits:
    if split != "train":
      for _ in ds.eval_batches(split, cfg.train.eval_batch_size):
        pass
  return dict(seconds=time.perf_counter() - t, vocab_size=ds.tokenizer.vocab_size,
              splits={s: ds.num_examples(s) for s in ds.splits})


def child_train(overrides: list[str], workdir: str, eval_examples: int) -> dict:
  """One training run via train_lib.train; the training loss of every step via on_log."""
  from seq2seq.kernels import malloc
  malloc.keep_freed_memory()   # as train.py does, before JAX starts
  _quiet()
  from seq2seq import train_lib
  from seq2seq.metrics import read_metrics
  if eval_examples > 0:  # cap the final evaluation too (quick checks only)
    run_eval = train_lib.run_eval

    def capped(trainer, cfg, *a, final=False, **kw):
      cfg = cfg.replace(train=cfg.train.replace(num_eval_examples=eval_examples))
      return run_eval(trainer, cfg, *a, final=False, **kw)
    train_lib.run_eval = capped
  cfg = _config(overrides)
  steps, losses, accs, times = [], [], [], []

  def on_log(step, m):
    steps.append(int(step))
    losses.append(float(m["loss"]))
    accs.append(float(m["accuracy"]))
    times.append(time.perf_counter())

  t0 = time.perf_counter()
  r = train_lib.train(cfg, workdir, progress=False, on_log=on_log)
  t1 = time.perf_counter()
  periodic = [row for row in read_metrics(workdir)  # the evaluations before the final one
              if row["split"] == "validation" and row["step"] < r.step]
  return dict(
      overrides=overrides, workdir=workdir, step=r.step, steps=steps, loss=losses,
      accuracy=accs, train_seconds=r.seconds,
      first_step_s=times[0] - t0 if times else None,  # dataset load + compile + step 1
      loop_s=times[-1] - times[0] if times else None,  # steps 2..N (incl. periodic evals)
      final_eval_s=t1 - times[-1] if times else None,
      eval_metrics=r.eval_metrics, test_metrics=r.test_metrics, periodic_validation=periodic)


def _run_child(argv: list[str], label: str) -> tuple[dict, float]:
  t = time.perf_counter()
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv,
                        stdout=subprocess.PIPE, text=True)
  wall = time.perf_counter() - t
  line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
  if proc.returncode != 0 or line is None:
    sys.exit(f"{label}: FAILED (exit {proc.returncode})")
  return json.loads(line[len("RESULT "):]), wall


def compare(a: dict, b: dict, window: int) -> dict:
  """b - a per step (on the steps both logged), and summaries over the last `window` steps."""
  import numpy as np
  la = dict(zip(a["steps"], a["loss"]))
  lb = dict(zip(b["steps"], b["loss"]))
  steps = sorted(set(la) & set(lb))
  x = np.array([la[s] for s in steps])
  y = np.array([lb[s] for s in steps])
  d = y - x
  w = slice(max(len(steps) - window, 0), None)
  rel = np.abs(d[w]) / x[w]
  return dict(steps=steps, diff=d.tolist(), window=len(steps[w]),
              max_abs_diff=float(np.abs(d[w]).max()), max_rel_diff=float(rel.max()),
              mean_rel_diff=float(rel.mean()),
              window_mean_diff=float(y[w].mean() - x[w].mean()),
              window_mean_rel_diff=float(abs(y[w].mean() - x[w].mean()) / x[w].mean()))


def spikes(run: dict, after: int = 100, factor: float = 1.5, lookback: int = 10) -> list[int]:
  """Steps after `after` whose training loss exceeds `factor` x the median of the previous
  `lookback` steps' losses (a rough mark for the plot and the table, nothing more)."""
  import numpy as np
  steps, loss = run["steps"], run["loss"]
  return [steps[i] for i in range(lookback, len(steps))
          if steps[i] > after and loss[i] > factor * np.median(loss[i - lookback:i])]


def summarize(comps: dict, pairs_by_kind: dict) -> dict:
  """Per kind of difference (dtype, seed): the range over its pairs of each window statistic."""
  out = {}
  for kind, ps in pairs_by_kind.items():
    cs = [comps[p] for p in ps]
    if cs:
      out[kind] = {f: [min(c[f] for c in cs), max(c[f] for c in cs)]
                   for f in ("max_rel_diff", "mean_rel_diff", "window_mean_rel_diff")}
      out[kind]["pairs"] = len(cs)
  return out


def _label(pair: tuple[str, str]) -> str:
  a, b = pair
  return f"{b} - {a}"


def plot(runs: dict, seeds: int, comps: dict, pairs_by_kind: dict, path: str, title: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10), sharex=True,
                                      gridspec_kw=dict(height_ratios=[3, 2, 2]))
  blues, oranges = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
  for seed in range(seeds):
    for dtype in DTYPES:
      r = runs[run_name(dtype, seed)]
      shade = 0.85 - 0.4 * seed / max(seeds - 1, 1)
      ax1.plot(r["steps"], r["loss"], lw=1.1, ls="-" if dtype == "float32" else "--",
               color=(blues if dtype == "float32" else oranges)(shade),
               label=f"{dtype} (seed {seed})")
  ax1.set_yscale("log")
  ax1.set_ylabel("training loss (per step, label-smoothed)")
  ax1.grid(True, which="both", alpha=0.3)
  ax1.legend(fontsize=8, ncol=2)
  ax1.set_title(title, fontsize=10)
  # seed pairs first (grey, behind), then the dtype pairs (orange)
  for kind, color, lw, label in (("seed", "0.6", 0.8, "seed t - seed s, same dtype (noise)"),
                                 ("dtype", "tab:orange", 1.1, "bf16 - f32, same seed")):
    for i, pair in enumerate(pairs_by_kind[kind]):
      c = comps[pair]
      ref = dict(zip(runs[pair[0]]["steps"], runs[pair[0]]["loss"]))
      kw = dict(color=color, lw=lw, alpha=0.8, label=label if i == 0 else None)
      ax2.plot(c["steps"], c["diff"], **kw)
      ax3.plot(c["steps"], [max(abs(d) / ref[s], 1e-7) for s, d in zip(c["steps"], c["diff"])],
               **kw)
  ax2.axhline(0.0, color="k", lw=0.6)
  c = comps[pairs_by_kind["dtype"][0]]
  for ax in (ax2, ax3):
    ax.axvspan(c["steps"][-c["window"]], c["steps"][-1], color="tab:green", alpha=0.08,
               label=f"last {c['window']} steps")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
  ax2.set_ylabel("loss difference")
  ax3.set_yscale("log")
  ax3.set_ylabel("|difference| / loss")
  ax3.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _fmt_eval(m: dict) -> str:
  if not m:
    return "-"
  return (f"loss {m['loss']:.3f} acc {m['accuracy']:.4f} BLEU {m['bleu']:.1f} "
          f"exact {m['exact_match']:.4f} ({m['examples']})")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=None,
                  help="override train.steps (default: the experiment's 300); a quick check "
                       "also caps the final evaluation, see --eval-examples")
  ap.add_argument("--seeds", type=int, default=3,
                  help="train each dtype with seeds 0..N-1 (default: %(default)s; 1 = no "
                       "noise reference)")
  ap.add_argument("--eval-examples", type=int, default=None,
                  help="examples per split in the final evaluation (0 = all; default: all "
                       "for the full run, 200 when --steps is given)")
  ap.add_argument("--workdir", default=None,
                  help="keep everything under this directory (default: a temporary one)")
  ap.add_argument("--data-dir", default=None,
                  help="TFDS data directory (default: <workdir>/tfds, built on first use)")
  ap.add_argument("--out", default=DEFAULT_OUT, help="JSON path; the plot goes next to it "
                  "with a .png suffix (default: %(default)s)")
  ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
  ap.add_argument("--_dir", default="", help=argparse.SUPPRESS)
  ap.add_argument("--_overrides", default="[]", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)

  if args._child:  # one step of the benchmark in a fresh process: print one JSON line
    overrides = json.loads(args._overrides)
    if args._child == "prepare":
      r = child_prepare(overrides, args._dir)
    else:
      r = child_train(overrides, args._dir, args.eval_examples or 0)
    print("RESULT " + json.dumps(r), flush=True)
    return

  if args.seeds < 1:
    sys.exit(f"error: --seeds must be at least 1, got {args.seeds}")
  if args.eval_examples is None:
    args.eval_examples = 0 if args.steps is None else 200
  tmp = None
  if args.workdir is None:
    tmp = root = tempfile.mkdtemp(prefix="bench_precision_")
  else:
    root = os.path.abspath(args.workdir)
    os.makedirs(root, exist_ok=True)
  args.data_dir = os.path.abspath(args.data_dir or os.path.join(root, "tfds"))
  shared = base_overrides(args)
  run_overrides = run_names(args.seeds)
  try:
    data_workdir = os.path.join(root, "data")
    print(f"preparing the data once in {data_workdir} (TFDS data in {args.data_dir})",
          file=sys.stderr, flush=True)
    prep, prep_wall = _run_child(["--_child", "prepare", "--_dir", data_workdir,
                                  "--_overrides", json.dumps(shared)], "data")
    print(f"  data: {prep['splits']}, vocabulary {prep['vocab_size']}, "
          f"{prep_wall:.0f} s", file=sys.stderr, flush=True)
    runs = {}
    for k, (name, overrides) in enumerate(run_overrides.items()):
      wd = os.path.join(root, name)
      shutil.rmtree(wd, ignore_errors=True)  # a fresh run, never a resumed one
      os.makedirs(wd)
      shutil.copy2(os.path.join(data_workdir, "vocab.model"), wd)
      shutil.copytree(os.path.join(data_workdir, "data_cache"), os.path.join(wd, "data_cache"))
      print(f"[{k + 1}/{len(run_overrides)}] training {name} ({', '.join(overrides)}) in {wd}",
            file=sys.stderr, flush=True)
      r, wall = _run_child(["--_child", "train", "--_dir", wd, "--eval-examples",
                            str(args.eval_examples), "--_overrides",
                            json.dumps(shared + overrides)], name)
      r["wall_s"] = wall
      r["spikes"] = spikes(r)
      runs[name] = r
      print(f"  {name}: final loss {r['loss'][-1]:.4f}, test {_fmt_eval(r['test_metrics'])}, "
            f"{wall:.0f} s", file=sys.stderr, flush=True)
  finally:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)

  pairs_by_kind = pairs(args.seeds)
  comps = {p: compare(runs[p[0]], runs[p[1]], WINDOW) for ps in pairs_by_kind.values()
           for p in ps}
  summary = summarize(comps, pairs_by_kind)

  import jax
  import numpy as np
  steps = runs[run_name("float32", 0)]["step"]
  window = comps[pairs_by_kind["dtype"][0]]["window"]
  eval_note = ("whole splits" if args.eval_examples == 0
               else f"first {args.eval_examples} examples per split")
  print(f"\nMixed precision vs float32: the `numbers` experiment, {steps} steps, "
        f"train.log_every=1, seeds 0-{args.seeds - 1}; jax {jax.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; final evaluation on "
        f"{eval_note}")
  head = (f"{'run':12s} {'final loss':>10s} {'val loss':>8s} {'val acc':>7s} "
          f"{'test BLEU':>9s} {'test exact':>10s} {'test acc':>8s} {'train s':>7s} "
          f"{'wall s':>6s}  loss spikes after step 100 (> 1.5x the last 10 steps' median)")
  print(head + "\n" + "-" * len(head))
  for name, r in runs.items():
    v, t = r["eval_metrics"], r["test_metrics"]
    print(f"{name:12s} {r['loss'][-1]:10.4f} {v.get('loss', float('nan')):8.4f} "
          f"{v.get('accuracy', float('nan')):7.4f} {t.get('bleu', float('nan')):9.1f} "
          f"{t.get('exact_match', float('nan')):10.4f} {t.get('accuracy', float('nan')):8.4f} "
          f"{r['train_seconds']:7.0f} {r['wall_s']:6.0f}  {r['spikes'] or '-'}")
  for dtype in DTYPES:
    exact = [runs[run_name(dtype, seed)]["test_metrics"].get("exact_match", float("nan"))
             for seed in range(args.seeds)]
    print(f"{dtype}: test exact match mean {np.mean(exact):.4f}, min {min(exact):.4f}")
  head = (f"{'difference':26s} {'steps':>9s} {'max |d|/loss':>12s} {'mean |d|/loss':>13s} "
          f"{'d of mean loss':>14s}")
  print(f"\nper-step training loss, last {window} steps\n{head}\n" + "-" * len(head))
  for kind in ("dtype", "seed"):
    for p in pairs_by_kind[kind]:
      c = comps[p]
      print(f"{_label(p):26s} {c['steps'][-c['window']]:4d}-{c['steps'][-1]:<4d} "
            f"{100 * c['max_rel_diff']:11.2f}% {100 * c['mean_rel_diff']:12.2f}% "
            f"{c['window_mean_diff']:+14.4f}")
  if "seed" in summary:
    d, s = summary["dtype"], summary["seed"]
    print(f"over the last {window} steps, bf16 - f32 at the same seed ({d['pairs']} pairs) "
          f"against seed-to-seed within a dtype ({s['pairs']} pairs), ranges over the pairs:")
    for f, label in (("max_rel_diff", "max |d| / loss"), ("mean_rel_diff", "mean |d| / loss"),
                     ("window_mean_rel_diff", "|d of mean loss| / loss")):
      print(f"  {label:24s} bf16 - f32 {100 * d[f][0]:6.2f}-{100 * d[f][1]:<6.2f}%   "
            f"seed-to-seed {100 * s[f][0]:6.2f}-{100 * s[f][1]:<6.2f}%")

  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  png = os.path.splitext(out)[0] + ".png"
  plot(runs, args.seeds, comps, pairs_by_kind, png, f"numbers experiment, {steps} steps: float32 vs "
       f"bfloat16 (bf16 matmul inputs, f32 accumulation/params), seeds 0-{args.seeds - 1}")
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              jax=jax.__version__, device=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), machine=platform.machine(), cpu=cpu_name(),
              load_avg=os.getloadavg(),
              args={k: v for k, v in vars(args).items() if not k.startswith("_")},
              shared_overrides=shared, runs=run_overrides,
              window=WINDOW, data=dict(prep, wall_s=prep_wall), plot=png)
  with open(out, "w") as f:
    json.dump(dict(meta=meta, summary=summary, runs=runs,
                   differences={_label(p): c for p, c in comps.items()}), f, indent=1)
  print(f"wrote {out} and {png}")


if __name__ == "__main__":
  main()
