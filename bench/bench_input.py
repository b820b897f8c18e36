"""Input pipeline speed against the train step it feeds; and train.py at the paper's data size.

    python bench/bench_input.py                       # numbers task + the Bible corpus
    python bench/bench_input.py --bible DIR           # the Bible corpus elsewhere
    python bench/bench_input.py --datasets numbers --seconds 2
    python bench/bench_input.py --pairs 1000000,4500000,9000000     # corpora of that size
    python bench/bench_input.py --pairs 4500000 --hosts 1,2,4       # as 1, 2, 4 hosts

--pairs N,...: for each N, a corpus of N training pairs (the Bible's training verses drawn
at random, a random number appended to both sides so that lines rarely repeat; the Bible's
own validation and test splits; ~280 bytes a pair, written once under --root, never
committed), then train.py as a user runs it, in a new process: the `small` model, a 32k
vocabulary, 2 steps of batch 8 in a fresh workdir (the first run: building everything), then
one more step (a resume: everything cached), and the same command on the Bible itself.
For each run: seconds to the first step, the data's phases (train.py's "data ready" line),
the peak resident memory of train.py and its children, before the first step (the data,
the model's init) and over the whole run (the evaluation's decoding included); after the
resume, the seconds that checking the cached token ids takes (every split's SHA-256 and
arrays, as a resume checks them). --hosts H,...: the same as H processes on this machine,
the hosts of one run (jax.distributed over loopback), each process's peak measured, and a
resume of the one-host workdir on H hosts (its shards gathered from the one host's token
ids). Writes bench/results/input_scale.json.

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
import re
import statistics
import subprocess
import sys
import threading
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


# --- train.py at the paper's data size -----------------------------------------------------

def make_corpus(bible: str, out: str, pairs: int, seed: int = 0) -> str:
  """`pairs` training pairs drawn from the Bible's training verses, a random number
  appended to both sides; the Bible's validation and test splits. Written once."""
  done = os.path.join(out, ".complete")
  if os.path.exists(done):
    return out
  os.makedirs(out, exist_ok=True)
  verses = {lang: open(os.path.join(bible, f"train.{lang}"), encoding="utf-8").read()
            .split("\n")[:-1] for lang in ("en", "fr")}
  rng = np.random.default_rng(seed)
  with open(os.path.join(out, "train.en"), "w", encoding="utf-8") as en, \
       open(os.path.join(out, "train.fr"), "w", encoding="utf-8") as fr:
    for a in range(0, pairs, 200_000):
      m = min(200_000, pairs - a)
      idx = rng.integers(0, len(verses["en"]), m).tolist()
      num = rng.integers(0, 10 ** 6, m).tolist()
      en.write("".join(f"{verses['en'][i]} {k}\n" for i, k in zip(idx, num)))
      fr.write("".join(f"{verses['fr'][i]} {k}\n" for i, k in zip(idx, num)))
  for split in ("validation", "test"):
    for lang in ("en", "fr"):
      shutil.copyfile(os.path.join(bible, f"{split}.{lang}"), os.path.join(out, f"{split}.{lang}"))
  open(done, "w").close()
  return out


def _tree_rss(pids: list[int]) -> list[tuple[int, int]]:
  """(resident bytes, of them file-backed or shared) of each process of `pids` with its
  descendants (one pass over /proc). File pages (the mapped token ids, the libraries) are
  counted in a process's resident memory but can be reclaimed; anonymous ones cannot."""
  parent = {}
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f:
          parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, ValueError, IndexError):
        pass
  out = []
  for pid in pids:
    tree, grew = {pid}, True
    while grew:
      more = {p for p, pp in parent.items() if pp in tree} - tree
      tree |= more
      grew = bool(more)
    total = shared = 0
    for p in tree:
      try:
        with open(f"/proc/{p}/statm") as f:
          fields = f.read().split()
        total += int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
        shared += int(fields[2]) * os.sysconf("SC_PAGE_SIZE")
      except (OSError, ValueError, IndexError):
        pass
    out.append((total, shared))
  return out


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_train(args: list[str], log: str, hosts: int = 1) -> dict:
  """train.py with `args` in new processes, `hosts` of them as the hosts of one run
  (jax.distributed over loopback): seconds to the first step, the data phases (process 0's
  lines), and each process's peak resident memory with its children's, before the first
  step and in all (the largest of them as peak_data_gb / peak_gb), and how much of process
  0's peak before the first step was file pages."""
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args]
  port = _free_port()
  start = time.perf_counter()
  procs = [subprocess.Popen(
      cmd + (["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(hosts),
              "--process_id", str(i)] if hosts > 1 else []),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", cwd=ROOT)
      for i in range(hosts)]
  seen, done = {}, threading.Event()
  peak = {"all": [0] * hosts, "data": [0] * hosts}
  at_peak = {"file_gb": 0.0}

  def watch():
    while not done.is_set():   # (not p.poll(): os.wait4 below reaps them, with their usage)
      for i, (rss, shared) in enumerate(_tree_rss([p.pid for p in procs])):
        peak["all"][i] = max(peak["all"][i], rss)
        if "training" not in seen and rss > peak["data"][i]:
          peak["data"][i] = rss
          if i == 0:
            at_peak["file_gb"] = shared / 1e9
      time.sleep(0.1)
  threading.Thread(target=watch, daemon=True).start()

  def echo(i):   # each process's output to its log; process 0's lines timed
    with open(log if i == 0 else f"{log}.{i}", "w") as out:
      for line in procs[i].stdout:
        out.write(line)
        now = time.perf_counter() - start
        for key, pattern in (("training", r"^training \d+-d"), ("first_step", r"first step in"),
                             ("data", r"^data ready in")):
          if i == 0 and key not in seen and re.search(pattern, line):
            seen[key] = (now, line.strip())
  readers = [threading.Thread(target=echo, args=(i,), daemon=True) for i in range(hosts)]
  for r in readers:
    r.start()
  for r in readers:
    r.join()
  done.set()
  codes, maxrss = [], []
  for p in procs:
    _, status, usage = os.wait4(p.pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
    maxrss.append(usage.ru_maxrss * 1024 / 1e9)
  wall = time.perf_counter() - start
  if any(codes) or "first_step" not in seen:
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {codes}); see {log}")
  phases = {}
  if "data" in seen:
    phases = {k.strip(): float(v) for k, v in re.findall(r"([a-z ]+?) ([\d.]+) s", seen["data"][1]
                                                  .split(":", 1)[1])}
  return dict(exit=0, hosts=hosts, wall_s=wall, to_training_s=seen["training"][0],
              to_first_step_s=seen["first_step"][0], data_phases_s=phases,
              peak_data_gb=max(peak["data"]) / 1e9, peak_gb=max(peak["all"]) / 1e9,
              per_process_peak_data_gb=[x / 1e9 for x in peak["data"]],
              per_process_peak_gb=[x / 1e9 for x in peak["all"]],
              peak_data_file_gb=at_peak["file_gb"],
              ru_maxrss_gb=maxrss, log=log)


SCALE_ARGS = ["--config", "small", "--src_lang", "en", "--tgt_lang", "fr",
              "--config.data.vocab_size=32000", "--config.train.steps=2",
              "--config.train.batch_size=8"]


def check_seconds(work: str) -> float:
  """Seconds `token_ids.load` takes to check every cached split of a workdir (each file's
  SHA-256 and arrays), as a resume does before its first step."""
  from seq2seq.data import token_ids
  from seq2seq.data.tokenizer import Tokenizer
  vocab = Tokenizer.load(os.path.join(work, "vocab.model")).vocab_size
  start = time.perf_counter()
  for where in sorted(os.scandir(os.path.join(work, "data_cache")), key=lambda e: e.name):
    if where.is_dir() and not where.name.startswith("."):
      token_ids.load(where.path, vocab)
  return time.perf_counter() - start


def _eval_split(corpus: str, split: str, pairs: int, root: str) -> str:
  """The prefix of the corpus' `split` files; with `pairs`, of their first `pairs` lines
  (written under `root`)."""
  if not pairs:
    return os.path.join(corpus, split)
  out = os.path.join(root, f"{split}-{pairs}-{os.path.basename(os.path.normpath(corpus))}")
  for lang in ("en", "fr"):
    with open(os.path.join(corpus, f"{split}.{lang}"), encoding="utf-8") as f:
      lines = [next(f) for _ in range(pairs)]
    with open(f"{out}.{lang}", "w", encoding="utf-8") as f:
      f.writelines(lines)
  return out


def bench_scale(sizes: list[int], bible: str, root: str, hosts=(1,), eval_pairs: int = 0
                ) -> list[dict]:
  """For each corpus and host count: a first run and its resume in a new workdir; after
  the resume on one host, the seconds checking its token ids take; and on more hosts, a
  resume of the one-host workdir too (its shards gathered from the one host's ids). With
  `eval_pairs`, the runs evaluate that many validation and test pairs (their final
  evaluation decodes every pair of the Bible's splits otherwise: minutes on several
  processes)."""
  rows = []
  for pairs in [0, *sizes]:   # 0: the Bible itself
    corpus = bible if pairs == 0 else make_corpus(bible, os.path.join(root, f"corpus-{pairs}"),
                                                  pairs)
    text = sum(os.path.getsize(os.path.join(corpus, f"train.{l}")) for l in ("en", "fr"))
    one_host, steps = None, 3
    for h in hosts:
      work = os.path.join(root, f"work-{pairs}" + (f"-{h}hosts" if h > 1 else ""))
      shutil.rmtree(work, ignore_errors=True)
      os.makedirs(root, exist_ok=True)
      files = [f"--train_files={os.path.join(corpus, 'train')}"] + [
          f"--{s}_files={_eval_split(corpus, s, eval_pairs, root)}" for s in ("validation", "test")]
      first = run_train(["--workdir", work, *SCALE_ARGS, *files], f"{work}.first.log", h)
      again = run_train(["--workdir", work, "--config.train.steps=3"], f"{work}.resume.log", h)
      row = dict(pairs=pairs or sum(1 for _ in open(os.path.join(bible, "train.en"))),
                 corpus="bible" if pairs == 0 else f"generated {pairs}", hosts=h,
                 text_mb=text / 1e6, first=first, resume=again)
      if h == 1:
        again["check_s"] = check_seconds(work)
        one_host = work
      elif one_host is not None:
        steps += 1
        row["resume_one_host_workdir"] = run_train(
            ["--workdir", one_host, f"--config.train.steps={steps}"],
            f"{work}.resume-of-1-host.log", h)
      rows.append(row)
      other = row.get("resume_one_host_workdir")
      print(f"{row['corpus']:>18} on {h} host(s): first run {first['to_first_step_s']:.0f} s "
            f"to the first step, peak {first['peak_data_gb']:.2f} GB a process before it, "
            f"{first['peak_gb']:.2f} GB in all; resume {again['to_first_step_s']:.1f} s, "
            f"{again['peak_data_gb']:.2f} / {again['peak_gb']:.2f} GB"
            + (f"; checking its token ids {again['check_s']:.2f} s" if h == 1 else "")
            + (f"; the 1-host workdir resumed here {other['to_first_step_s']:.1f} s, "
               f"{other['peak_data_gb']:.2f} GB" if other else "")
            + f" (file pages: {first['peak_data_file_gb']:.2f} GB of the first run's peak "
              f"before its first step)", flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--datasets", default="numbers,bible")
  ap.add_argument("--bible", default=BIBLE, help="the Bible corpus' directory (default: "
                  "data/bible, which python -m seq2seq.data.bible data/bible writes)")
  ap.add_argument("--root", default="/tmp/seq2seq_bench_input",
                  help="TFDS data dir and workdirs go here")
  ap.add_argument("--seconds", type=float, default=3.0, help="per pipeline measurement")
  ap.add_argument("--repeats", type=int, default=10, help="timed train steps")
  ap.add_argument("--out", default=None, help="JSON written (default bench/results/"
                  "input.json, input_scale.json with --pairs)")
  ap.add_argument("--pairs", default="", help="train.py on generated corpora of these many "
                  "pairs (comma-separated), beside the Bible")
  ap.add_argument("--eval_pairs", type=int, default=0, help="with --pairs: the runs' "
                  "validation and test splits are the Bible's first N pairs (0: all)")
  ap.add_argument("--hosts", default="1", help="with --pairs: train.py as this many processes "
                  "on this machine, the hosts of one run (comma-separated counts)")
  args = ap.parse_args(argv)
  results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  if args.pairs:
    if not os.path.isdir(args.bible):
      sys.exit(f"error: {args.bible} not found (python -m seq2seq.data.bible {args.bible})")
    rows = bench_scale([int(n) for n in args.pairs.split(",") if n], args.bible, args.root,
                       [int(h) for h in args.hosts.split(",") if h], args.eval_pairs)
    out = args.out or os.path.join(results, "input_scale.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
      json.dump(dict(benchmark="input_scale",
                     date=datetime.datetime.now().isoformat(timespec="seconds"),
                     host=dict(platform=platform.platform(), cpu=cpu_name(),
                               cpus=os.cpu_count(), jax=jax.__version__),
                     command="train.py " + " ".join(SCALE_ARGS), eval_pairs=args.eval_pairs,
                     runs=rows), f, indent=2)
    print(f"wrote {out}")
    return 0
  args.out = args.out or os.path.join(results, "input.json")
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
