"""Mixed precision trains like float32: the default `python train.py` run in both dtypes.

    python bench/bench_precision.py                   # 3 runs x 300 steps: ~8-10 min on 2 CPU cores
    python bench/bench_precision.py --no-noise-ref    # float32 + bfloat16 only: ~6 min
    python bench/bench_precision.py --steps 30 --out /tmp/p.json   # check the script: ~1.5 min

The run is the embedded default experiment (`get_experiment("numbers")`: tiny model, no
dropout, English->French numbers, 300 steps), trained from scratch three times, each in a
fresh subprocess and its own workdir:

  float32         model.dtype=float32, train.seed=0           (the reference)
  bfloat16        model.dtype=bfloat16, train.seed=0           bf16 matmul inputs, f32
                  accumulation; f32 parameters, optimizer state, softmax, LayerNorm, loss
  float32_seed1   model.dtype=float32, train.seed=1            the noise reference
                  (train.seed sets the initialisation *and* the order of the training
                  batches, so this run sees other batches at each step)

Everything else is the default config, except `train.log_every=1` (the training loss of every
step, not the mean of 25; it costs a host sync per step, the same in every run). The float32
and bfloat16 runs see identical batches: the TFDS data, the SentencePiece vocabulary and the
tokenized splits are built once (in `<workdir>/tfds` and `<workdir>/data`) and copied into
each run's workdir, so no run rebuilds them and all share one vocabulary.

Expected result: the bf16 and f32 loss curves lie on top of each other; bf16 - f32 is
small at every step (largest early, while the loss falls fast) and over the last 100
steps it is well inside the seed-to-seed difference |f32(seed 1) - f32(seed 0)|. Both dtypes
reach >= 99.5% exact match on the held-out test numbers (2026-11-23 on B: f32 99.8%, bf16
99.9%; the f32 run had a loss spike at step 273 and recovered). Wall time on this CPU is
about the same for both (the tiny model is dominated by overheads; bf16 speed is
bench_train.py's job).

Reported per run: the training loss at the last step, max and mean |diff| / loss over the last
100 steps (per-step training losses; the seed reference's includes batch-to-batch noise since
its batches differ, so the difference of the 100-step mean losses is also given), the final
validation/test metrics of `TrainResult` (loss, token accuracy, BLEU, chrF, exact match; the
final evaluation reads the whole split unless `--eval-examples` caps it), and wall time.

Writes bench/results/precision.json and bench/results/precision.png (top: loss vs step of
every run, log scale; middle: bf16 - f32 and f32(seed 1) - f32(seed 0) per step; bottom: the
same as |difference| / f32 loss on a log scale, where the late, small differences show).
`--workdir DIR` keeps the runs (DIR/float32 etc., each with config.json and metrics.jsonl)
and reuses DIR/tfds and DIR/data next time; the run directories are recreated on every
invocation (a leftover run would otherwise be resumed). Without it a temporary directory is
used and removed.
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
DEFAULT_OUT = os.path.join(HERE, "results", "precision.json")
WINDOW = 100  # the last steps over which the curves are compared

RUNS = {  # name -> overrides on top of the default experiment
    "float32": ["model.dtype=float32", "train.seed=0"],
    "bfloat16": ["model.dtype=bfloat16", "train.seed=0"],
    "float32_seed1": ["model.dtype=float32", "train.seed=1"],
}


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
  _quiet()
  from seq2seq import train_lib
  if eval_examples > 0:  # cap the final evaluation too (quick checks only)
    run_eval = train_lib._run_eval

    def capped(trainer, cfg, *a, final=False, **kw):
      cfg = cfg.replace(train=cfg.train.replace(num_eval_examples=eval_examples))
      return run_eval(trainer, cfg, *a, final=False, **kw)
    train_lib._run_eval = capped
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
  periodic = []  # the validation evaluations before the final one
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if row["split"] == "validation" and row["step"] < r.step:
        periodic.append(row)
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


def plot(runs: dict, comps: dict, path: str, title: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  style = {"float32": dict(color="tab:blue", lw=1.6, label="float32 (seed 0)"),
           "bfloat16": dict(color="tab:orange", lw=1.2, ls="--", label="bfloat16 (seed 0)"),
           "float32_seed1": dict(color="0.55", lw=1.0, label="float32 (seed 1), noise ref")}
  fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10), sharex=True,
                                      gridspec_kw=dict(height_ratios=[3, 2, 2]))
  for name, r in runs.items():
    ax1.plot(r["steps"], r["loss"], **style[name])
  ax1.set_yscale("log")
  ax1.set_ylabel("training loss (per step, label-smoothed)")
  ax1.grid(True, which="both", alpha=0.3)
  ax1.legend()
  ax1.set_title(title, fontsize=10)
  f32 = dict(zip(runs["float32"]["steps"], runs["float32"]["loss"]))
  for key, color, lw, label in (("seed", "0.55", 0.9, "f32(seed 1) - f32(seed 0)  (noise)"),
                                ("bf16", "tab:orange", 1.2, "bf16 - f32")):
    if key not in comps:
      continue
    c = comps[key]
    ax2.plot(c["steps"], c["diff"], color=color, lw=lw, label=label)
    rel = [abs(d) / f32[s] for s, d in zip(c["steps"], c["diff"])]
    ax3.plot(c["steps"], [max(r, 1e-7) for r in rel], color=color, lw=lw,
             label=f"|{label.split('  ')[0]}| / loss")
  ax2.axhline(0.0, color="k", lw=0.6)
  c = comps["bf16"]
  for ax in (ax2, ax3):
    ax.axvspan(c["steps"][-c["window"]], c["steps"][-1], color="tab:green", alpha=0.08,
               label=f"last {c['window']} steps")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
  ax2.set_ylabel("loss difference")
  ax3.set_yscale("log")
  ax3.set_ylabel("|difference| / f32 loss")
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
  ap.add_argument("--eval-examples", type=int, default=None,
                  help="examples per split in the final evaluation (0 = all; default: all "
                       "for the full run, 200 when --steps is given)")
  ap.add_argument("--no-noise-ref", action="store_true",
                  help="skip the float32 seed-1 run (the noise reference)")
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
  names = [n for n in RUNS if not (args.no_noise_ref and n == "float32_seed1")]
  try:
    data_workdir = os.path.join(root, "data")
    print(f"preparing the data once in {data_workdir} (TFDS data in {args.data_dir})",
          file=sys.stderr, flush=True)
    prep, prep_wall = _run_child(["--_child", "prepare", "--_dir", data_workdir,
                                  "--_overrides", json.dumps(shared)], "data")
    print(f"  data: {prep['splits']}, vocabulary {prep['vocab_size']}, "
          f"{prep_wall:.0f} s", file=sys.stderr, flush=True)
    runs = {}
    for name in names:
      wd = os.path.join(root, name)
      shutil.rmtree(wd, ignore_errors=True)  # a fresh run, never a resumed one
      os.makedirs(wd)
      shutil.copy2(os.path.join(data_workdir, "vocab.model"), wd)
      shutil.copytree(os.path.join(data_workdir, "data_cache"), os.path.join(wd, "data_cache"))
      print(f"training {name} ({', '.join(RUNS[name])}) in {wd}", file=sys.stderr, flush=True)
      r, wall = _run_child(["--_child", "train", "--_dir", wd, "--eval-examples",
                            str(args.eval_examples), "--_overrides",
                            json.dumps(shared + RUNS[name])], name)
      r["wall_s"] = wall
      runs[name] = r
      print(f"  {name}: final loss {r['loss'][-1]:.4f}, test {_fmt_eval(r['test_metrics'])}, "
            f"{wall:.0f} s", file=sys.stderr, flush=True)
  finally:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)

  comps = {"bf16": compare(runs["float32"], runs["bfloat16"], WINDOW)}
  if "float32_seed1" in runs:
    comps["seed"] = compare(runs["float32"], runs["float32_seed1"], WINDOW)

  import jax
  steps = runs["float32"]["step"]
  eval_note = ("whole splits" if args.eval_examples == 0
               else f"first {args.eval_examples} examples per split")
  print(f"\nMixed precision vs float32: the `numbers` experiment, {steps} steps, "
        f"train.log_every=1; jax {jax.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; final evaluation on {eval_note}")
  head = (f"{'run':14s} {'final loss':>10s} {'val loss':>8s} {'val acc':>7s} "
          f"{'test BLEU':>9s} {'test exact':>10s} {'test acc':>8s} {'train s':>7s} "
          f"{'wall s':>6s}")
  print(head + "\n" + "-" * len(head))
  for name, r in runs.items():
    v, t = r["eval_metrics"], r["test_metrics"]
    print(f"{name:14s} {r['loss'][-1]:10.4f} {v.get('loss', float('nan')):8.4f} "
          f"{v.get('accuracy', float('nan')):7.4f} {t.get('bleu', float('nan')):9.1f} "
          f"{t.get('exact_match', float('nan')):10.4f} {t.get('accuracy', float('nan')):8.4f} "
          f"{r['train_seconds']:7.0f} {r['wall_s']:6.0f}")
  head = (f"{'difference':26s} {'steps':>9s} {'max |d|/loss':>12s} {'mean |d|/loss':>13s} "
          f"{'d of mean loss':>14s}")
  print(f"\nper-step training loss, last {comps['bf16']['window']} steps\n{head}\n"
        + "-" * len(head))
  for key, label in (("bf16", "bf16 - f32"), ("seed", "f32(seed1) - f32(seed0)")):
    if key in comps:
      c = comps[key]
      print(f"{label:26s} {c['steps'][-c['window']]:4d}-{c['steps'][-1]:<4d} "
            f"{100 * c['max_rel_diff']:11.2f}% {100 * c['mean_rel_diff']:12.2f}% "
            f"{c['window_mean_diff']:+14.4f}")
  if "seed" in comps:
    ratio = comps["bf16"]["max_rel_diff"] / max(comps["seed"]["max_rel_diff"], 1e-12)
    print(f"max |bf16 - f32| over the last {comps['bf16']['window']} steps is "
          f"{ratio:.3g}x the seed-to-seed max |diff|")

  out = os.path.abspath(args.out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  png = os.path.splitext(out)[0] + ".png"
  plot(runs, comps, png, f"numbers experiment, {steps} steps: float32 vs bfloat16 "
       f"(bf16 matmul inputs, f32 accumulation/params)")
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              jax=jax.__version__, device=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), machine=platform.machine(),
              load_avg=os.getloadavg(),
              args={k: v for k, v in vars(args).items() if not k.startswith("_")},
              shared_overrides=shared, runs={n: RUNS[n] for n in names},
              window=WINDOW, data=dict(prep, wall_s=prep_wall), plot=png)
  summary = {k: {f: v for f, v in c.items() if f not in ("steps", "diff")}
             for k, c in comps.items()}
  with open(out, "w") as f:
    json.dump(dict(meta=meta, summary=summary, runs=runs,
                   differences={k: dict(steps=c["steps"], diff=c["diff"])
                                for k, c in comps.items()}), f, indent=1)
  print(f"wrote {out} and {png}")


if __name__ == "__main__":
  main()
