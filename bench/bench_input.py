"""Input pipeline speed against the train step it feeds.

    python bench/bench_input.py                       # numbers task + the Bible corpus
    python bench/bench_input.py --bible DIR           # the Bible corpus elsewhere
    python bench/bench_input.py --datasets numbers --seconds 2

For each dataset: the one-time costs ("tfds s": building the TFDS data, on the first run
only, the data dir is reused; "vocab+tok s": SentencePiece training and tokenization of the
training split in a fresh workdir; "reload s": load_dataset again with everything cached),
then the steady-state
rate of `ds.train_batches()` (packed [32, 64] rows, the batches the model sees), and of
resuming far into training (`train_batches(10**6)`: plan one epoch, then assemble).

The consumer: train.py's jitted train step (`Trainer.step`: forward + backward + Adam,
label-smoothed cross-entropy) of `get_config('small', vocab_size=8000)` on a [32, 64]
packed batch. The target: batches/s >= 20 x train steps/s. Prints a table and writes JSON to
bench/results/input.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time

import jax
import numpy as np

import seq2seq
from seq2seq.data import load_dataset
from seq2seq.data.corpus import open_corpus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import cpu_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIBLE = os.path.join(ROOT, "data", "bible")   # python -m seq2seq.data.bible data/bible
BATCH, SEQ_LEN = 32, 64
REQUIRED_RATIO = 20.0


def _config(name: str, data_dir: str, bible: str = BIBLE) -> seq2seq.Config:
  data = dict(data_dir=data_dir)
  if name == "bible":
    data.update(dataset="parallel_text", train_files=bible, vocab_size=8000)
  return seq2seq.Config(data=seq2seq.DataConfig(**data),
                        train=seq2seq.TrainConfig(batch_size=BATCH, seq_len=SEQ_LEN))


def bench_pipeline(name: str, root: str, seconds: float, bible: str = BIBLE) -> dict:
  cfg = _config(name, os.path.join(root, "tfds"), bible)
  workdir = os.path.join(root, f"work-{name}")
  shutil.rmtree(workdir, ignore_errors=True)  # time tokenizer training + tokenization
  t = time.perf_counter()
  open_corpus(cfg)  # build the TFDS data (or find it built)
  tfds_s = time.perf_counter() - t
  t = time.perf_counter()
  ds = load_dataset(cfg, workdir, process_index=0, process_count=1)
  load_s = time.perf_counter() - t
  t = time.perf_counter()
  load_dataset(cfg, workdir, process_index=0, process_count=1)  # everything cached
  reload_s = time.perf_counter() - t

  it = ds.train_batches(0)
  next(it)
  n, t = 0, time.perf_counter()
  while time.perf_counter() - t < seconds:
    next(it)
    n += 1
  rate = n / (time.perf_counter() - t)
  t = time.perf_counter()
  far = ds.train_batches(10**6)
  next(far)
  resume_s = time.perf_counter() - t
  s = ds.stats
  return dict(dataset=s["dataset"], train_examples=s["train_examples"],
              vocab_size=s["vocab_size"], tfds_s=tfds_s, load_s=load_s, reload_s=reload_s,
              batches_per_s=rate, examples_per_s=rate * s["examples_per_step"],
              resume_far_s=resume_s, steps_per_epoch=s["steps_per_epoch"],
              examples_per_step=s["examples_per_step"], src_fill=s["src_fill"],
              tgt_fill=s["tgt_fill"], dropped_too_long=s["dropped_too_long"],
              batch=next(ds.train_batches(0)))


def bench_train_step(batch: dict, repeats: int) -> dict:
  """Median seconds of train.py's jitted step (`Trainer.step`: forward, backward, Adam) of
  the `small` model, with its preset's recipe, on `batch`."""
  from seq2seq.train_lib import Trainer
  cfg = seq2seq.Config(model=seq2seq.get_config("small", vocab_size=8000),
                       train=seq2seq.TrainConfig(batch_size=BATCH, seq_len=SEQ_LEN))
  trainer = Trainer(cfg)
  state = trainer.init(jax.random.key(0))
  batch = trainer.global_batch({k: np.minimum(v, cfg.model.vocab_size - 1).astype(np.int32)
                                for k, v in batch.items()})
  times = []
  for _ in range(repeats + 1):  # the first compiles
    t = time.perf_counter()
    state, m = trainer.step(state, batch)
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t)
  compile_s, times = times[0], times[1:]
  med = statistics.median(times)
  return dict(model="small", vocab_size=8000, batch=[BATCH, SEQ_LEN], compile_s=compile_s,
              step_s=med, steps_per_s=1.0 / med, runs_s=times)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--datasets", default="numbers,bible")
  ap.add_argument("--bible", default=BIBLE, help="the Bible corpus' directory (default: "
                  "data/bible, which python -m seq2seq.data.bible data/bible writes)")
  ap.add_argument("--root", default="/tmp/seq2seq_bench_input",
                  help="TFDS data dir and workdirs go here")
  ap.add_argument("--seconds", type=float, default=3.0, help="per pipeline measurement")
  ap.add_argument("--repeats", type=int, default=10, help="timed train steps")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "input.json"))
  args = ap.parse_args(argv)
  import absl.logging  # TFDS logs through absl, as in train.py
  absl.logging.set_verbosity(absl.logging.ERROR)
  names = [n for n in args.datasets.split(",") if n]
  if "bible" in names and not os.path.isdir(args.bible):
    print(f"skipping bible: {args.bible} not found (python -m seq2seq.data.bible "
          f"{args.bible} writes it)", file=sys.stderr)
    names.remove("bible")
  if not names:
    sys.exit("error: no dataset to measure (--datasets numbers,bible)")

  pipes = {n: bench_pipeline(n, args.root, args.seconds, args.bible) for n in names}
  train = bench_train_step(pipes[names[0]]["batch"], args.repeats)
  for p in pipes.values():
    p.pop("batch")
    p["ratio_to_train_step"] = p["batches_per_s"] / train["steps_per_s"]
    p["meets_20x"] = p["ratio_to_train_step"] >= REQUIRED_RATIO

  print(f"\ntrain step: small (vocab 8000), batch {BATCH}x{SEQ_LEN}, fwd+bwd+adam: "
        f"{train['step_s'] * 1e3:.1f} ms = {train['steps_per_s']:.2f} steps/s "
        f"(compile {train['compile_s']:.1f} s)\n")
  cols = ("dataset", "examples", "vocab", "tfds s", "vocab+tok s", "reload s", "batches/s", "examples/s",
          "x train", "resume@1e6 s", "fill src/tgt")
  rows = [(p["dataset"], p["train_examples"], p["vocab_size"], f"{p['tfds_s']:.1f}",
           f"{p['load_s']:.1f}",
           f"{p['reload_s']:.2f}", f"{p['batches_per_s']:.0f}", f"{p['examples_per_s']:.0f}",
           f"{p['ratio_to_train_step']:.0f}x", f"{p['resume_far_s']:.3f}",
           f"{p['src_fill']:.2f}/{p['tgt_fill']:.2f}") for p in pipes.values()]
  widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(cols)]
  print("  ".join(str(c).rjust(w) for c, w in zip(cols, widths)))
  for r in rows:
    print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))

  result = dict(
      benchmark="input_pipeline", date=datetime.datetime.now().isoformat(timespec="seconds"),
      host=dict(platform=platform.platform(), cpu=cpu_name(), cpus=os.cpu_count(),
                jax=jax.__version__,
                backend=jax.default_backend()),
      required_ratio=REQUIRED_RATIO, train_step=train, pipelines=pipes)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\nwrote {args.out}")
  return 0 if all(p["meets_20x"] for p in pipes.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
