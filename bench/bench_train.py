"""Training speed: tokens/s, MFU, first-step compile time and peak memory of `Trainer.step`.

    python bench/bench_train.py                       # small + base, float32 + bfloat16
    python bench/bench_train.py --presets small --dtypes float32 --steps 10
    python bench/bench_train.py --workload gpu --presets small,base,big --dtypes bfloat16 \
        --steps 10 --warmup 3 --peak_n 8192          # on a GPU (bench/gpu/run.sh does this)

Workloads (those of the project's speed targets): `small` = get_config('small',
vocab_size=8000) at batch 32 x 64; `base` = get_config('base', vocab_size=32000) at batch
16 x 64 (source and target length 64). Shared embeddings and tied output head, dropout 0.1
(residual, embeddings and FFN hidden units), label smoothing 0.1, Adam
(`seq2seq.train_lib.Trainer`, one device, pack=False). Batches are random tokens with a random length per row in [47, 64] (EOS last,
then padding id 0): ~13% padding.

`--workload gpu` (sized for one datacenter GPU) trains on what train.py trains on: the
first 8 batches train.py would draw (`seq2seq.data.dataset.load_dataset`: SentencePiece,
length policy "drop", first-fit packing into rows with segment ids and positions) from the
Bible corpus (`--corpus`, default data/bible; where it is missing, the embedded numbers
task, and the JSON's `data` says which), tokenized with bible_gpu's 8,000-piece vocabulary,
at each workload's row length. So its rows hold several pairs each and end in padding, as
train.py's do, and a speed is also a run on them that did not fail (every step's loss and
gradient norm must be finite, else the row fails).
`bible_gpu` = `train.py --config bible_gpu` itself (the base model, dropout 0.2, at 128
rows of 64 tokens, vocabulary 8,000); `small`, `base` and `big` (vocabulary 8,000, 32,000,
32,000; dropout 0.1 as above) at 128 rows of 256 tokens (`big`: 64), the length of the
base/big presets' runs. Its targets are target tokens/s in bf16 (base >= 500,000, big >=
250,000). `--workload dry`: `tiny` (bible_gpu's run on a 32-d model) at 4 rows of 32
tokens, vocabulary 512, the same way, for a dry run of the script (tests/test_gpu_script.py).
The batches are kept in --data_dir (with the dataset, the vocabulary and the tokenized
corpus), where bench_peers_torch.py reads the same ones.

Modes: `float32` and `bfloat16` (model dtype="bfloat16": matmul inputs bf16, f32
accumulation, f32 params and optimizer state).

Every (preset, dtype) runs in a fresh subprocess, which
  1. builds the Trainer and the state, times the first `step` call (compile_s = first call
     minus the median warm step: tracing + XLA compilation),
  2. runs `--warmup` more steps, then times `--steps` steps (median; tokens/s = non-pad
     target tokens per step / median step time), each step's loss and gradient norm read
     back (a non-finite one fails the row, as it stops train.py); the first and warm-up
     steps run under train.py's net (seq2seq/net.py: a step that fails with cuDNN's
     attention is redone on XLA's, and the row's `redone_on_xla` says so), the timed ones
     as train.py's after its watched steps,
  3. reads its peak resident memory (VmHWM of /proc/self/status) before anything else,
  4. measures the matmul peak of its dtype: a jitted 2048x2048 @ 2048x2048 dot (--peak_n;
     8192 on a GPU), f32 x f32 -> f32, or bf16 x bf16 -> f32 (preferred_element_type=
     float32), best of several calls after warm-up, in the same process right after the
     train steps.
On a GPU it also reads the device's peak memory in use, and gives MFU against the card's
dense bf16 datasheet peak (DATASHEET_BF16) beside the measured matmul peak.

MFU = model FLOP/s / matmul peak of the same dtype, and limit = the tokens/s at MFU 100%
(the ceiling the measured peak puts on this step). Model FLOPs are counted analytically
over the padded shapes (what the step computes), matmuls only:

    fwd = B * [ N_e * S * (8 d^2 + 4 d d_ff + 4 S d)                      encoder
              + N_d * T * (8 d^2 + 4 d^2 + 4 d d_ff + 4 T d + 4 S d)      decoder
              + N_d * S * 4 d^2                                       cross-attn K, V
              + T * 2 d V ]                                             output head
    train FLOPs per step = 3 * fwd   (backward = 2 x forward)

(8 d^2 = Q, K, V, O projections; 4 d d_ff = the two FFN matmuls; 4 L d = attention scores
Q K^T and probs @ V over all L keys, no causal discount; 2 d V = the tied output head.)
Embedding gathers, LayerNorm, softmax, loss and Adam are not counted.

Prints a table and writes JSON to bench/results/train.json.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = {"small": dict(vocab_size=8000, batch=32, length=64),
             "base": dict(vocab_size=32000, batch=16, length=64)}
# bible_gpu: the run of `train.py --config bible_gpu` (its model and training config). The
# others at the base/big presets' row length; big at half the rows: its saved activations
# at 128 x 256 would near 80 GB, and 16k tokens a step already fill one GPU.
GPU_WORKLOADS = {"bible_gpu": dict(experiment="bible_gpu", vocab_size=8000, batch=128,
                                   length=64),
                 "small": dict(vocab_size=8000, batch=128, length=256),
                 "base": dict(vocab_size=32000, batch=128, length=256),
                 "big": dict(vocab_size=32000, batch=64, length=256)}
# bible_gpu's run made smaller still (model fields in "model"): seconds of compiling on a CPU.
DRY_WORKLOADS = {"tiny": dict(experiment="bible_gpu", vocab_size=512, batch=4, length=32,
                              model=dict(d_model=32, num_heads=2, d_ff=64,
                                         num_encoder_layers=1, num_decoder_layers=1))}
WORKLOAD_SETS = {"cpu": WORKLOADS, "gpu": GPU_WORKLOADS, "dry": DRY_WORKLOADS}
# The project's speed targets, train tokens/s (docs/performance.md, "The targets").
TARGETS = {("small", "float32"): 2800, ("small", "bfloat16"): 5000,
           ("base", "float32"): 480, ("base", "bfloat16"): 1000}
GPU_TARGETS = {("base", "bfloat16"): 500_000, ("big", "bfloat16"): 250_000}
TARGET_SETS = {"cpu": TARGETS, "gpu": GPU_TARGETS, "dry": {}}
# Dense bf16 tensor-core peaks of the vendor's datasheets, FLOP/s, by device_kind substring
# (first match): the H100 SXM's 989.4 TFLOP/s is also the H200's.
DATASHEET_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12),
                  ("H200", 989.4e12), ("A100", 312e12))
TARGET_BASE_COMPILE_S = 30.0
PAD, BOS, EOS = 0, 1, 2
MIN_LEN = 47
PEAK_N = 2048
# The gpu and dry workloads' batches: train.py's first NUM_BATCHES on CORPUS (a path from
# the repository's root: {train,validation,test}.{en,fr}; else the embedded numbers task),
# tokenized with a vocabulary of DATA_VOCAB pieces (bible_gpu's; the dry run's).
CORPUS = "data/bible"
DATA_VOCAB = {"gpu": 8000, "dry": 512}
NUM_BATCHES = 8
BATCH_KEYS = ("src", "tgt", "src_segments", "tgt_segments", "src_positions", "tgt_positions")
DATA_DIR = os.path.join(tempfile.gettempdir(), "seq2seq-bench-data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOP_FORMULA = ("3 * B * [N_e*S*(8d^2 + 4d*d_ff + 4Sd) + N_d*T*(12d^2 + 4d*d_ff + 4Td + 4Sd)"
                " + N_d*S*4d^2 + T*2dV]")


def train_flops(cfg, batch: int, src_len: int, tgt_len: int) -> float:
  """Matmul FLOPs of one train step (forward + backward = 3 x forward), padded shapes."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  s, t = src_len, tgt_len
  enc = cfg.num_encoder_layers * s * (8 * d * d + 4 * d * f + 4 * s * d)
  dec = cfg.num_decoder_layers * t * (12 * d * d + 4 * d * f + 4 * t * d + 4 * s * d)
  cross_kv = cfg.num_decoder_layers * s * 4 * d * d
  head = t * 2 * d * v
  return 3.0 * batch * (enc + dec + cross_kv + head)


def datasheet_bf16_peak(device_kind: str) -> float | None:
  """The dense bf16 datasheet peak of a GPU named `device_kind` (None if not listed)."""
  return next((peak for name, peak in DATASHEET_BF16 if name in device_kind), None)


def random_batch(rng, batch: int, length: int, vocab: int, min_len: int = MIN_LEN):
  import numpy as np
  out = {}
  for key in ("src", "tgt"):
    lens = rng.integers(min_len, length + 1, batch)
    x = rng.integers(3, vocab, (batch, length)).astype(np.int32)
    pos = np.arange(length)[None, :]
    x[pos == (lens[:, None] - 1)] = EOS
    x[pos >= lens[:, None]] = PAD
    out[key] = x
  return out


def _corpus_files(corpus: str) -> list[str] | None:
  """The six files of `corpus` (a path from the repository's root, or absolute), or None
  where one is missing."""
  prefix = os.path.join(ROOT, corpus)
  files = [os.path.join(prefix, f"{split}.{lang}") for split in ("train", "validation", "test")
           for lang in ("en", "fr")]
  return files if all(os.path.isfile(f) for f in files) else None


def packed_batches(workload_set: str, preset: str, corpus: str = CORPUS,
                   data_dir: str = DATA_DIR, n: int = NUM_BATCHES) -> tuple[list[dict], dict]:
  """The first `n` batches train.py would train on at the workload's batch x length (dicts
  of int32 [batch, length]: src, tgt, their segments and positions), from `corpus` (else the
  embedded numbers task), and what they are made of. Kept in `data_dir`: a later call, or
  bench_peers_torch.py where seq2seq does not import, reads the same batches back."""
  import numpy as np
  w = WORKLOAD_SETS[workload_set][preset]
  vocab, files = DATA_VOCAB[workload_set], _corpus_files(corpus)
  ident = [[f, os.path.getsize(f), os.path.getmtime(f)] for f in files] if files else "numbers"
  key = hashlib.sha256(json.dumps([ident, vocab, w["batch"], w["length"], n]).encode())
  path = os.path.join(data_dir, f"batches-{key.hexdigest()[:16]}.npz")
  if not os.path.exists(path):
    batches, data = _train_py_batches(corpus, files, vocab, w["batch"], w["length"], n,
                                      data_dir)
    tmp = f"{path}.{os.getpid()}.tmp.npz"
    np.savez(tmp, data=json.dumps(data),
             **{f"{k}_{i}": v for i, b in enumerate(batches) for k, v in b.items()})
    os.replace(tmp, path)
  with np.load(path) as z:
    data = json.loads(str(z["data"]))
    batches = [{k: z[f"{k}_{i}"] for k in BATCH_KEYS} for i in range(n)]
  return batches, dict(data, **batch_stats(batches))


def _train_py_batches(corpus: str, files, vocab: int, batch: int, length: int, n: int,
                      data_dir: str) -> tuple[list[dict], dict]:
  """train.py's data pipeline (load_dataset) on the corpus: its first `n` batches."""
  from seq2seq.config import Config, DataConfig, TrainConfig
  from seq2seq.data.dataset import load_dataset
  if files:
    prefix = os.path.dirname(files[0])
    data = DataConfig(dataset="parallel_text", **{f"{s}_files": os.path.join(prefix, s)
                                                  for s in ("train", "validation", "test")})
    source = f"parallel_text {prefix}"
  else:
    data = DataConfig(dataset="numbers", lowercase_source=True)
    source = f"numbers (embedded: no corpus at {corpus})"
  data = data.replace(vocab_size=vocab, max_src_len=length, max_tgt_len=length,
                      data_dir=os.path.join(data_dir, "tfds"))
  workdir = os.path.join(data_dir, hashlib.sha256(f"{source} {vocab}".encode()).hexdigest()[:12])
  ds = load_dataset(Config(data=data, train=TrainConfig(batch_size=batch, seq_len=length)),
                    workdir, process_index=0, process_count=1)
  stream = ds.train_batches(0)
  batches = [{k: v for k, v in next(stream).items() if k in BATCH_KEYS} for _ in range(n)]
  st = ds.stats
  return batches, dict(source=source, tokenizer_vocab=ds.tokenizer.vocab_size,
                       pairs=st["train_examples"], pairs_dropped_too_long=st["dropped_too_long"],
                       pipeline="train.py's: load_dataset, first-fit packing, batches 0-"
                                f"{n - 1}")


def batch_stats(batches: list[dict]) -> dict:
  """What the rows of `batches` hold: the share of source and target positions that are
  tokens, pairs per row, rows that end in padding, target tokens per batch."""
  import numpy as np
  src, tgt = (np.stack([b[k] for b in batches]) for k in ("src", "tgt"))
  out = dict(src_fill=float((src != PAD).mean()), tgt_fill=float((tgt != PAD).mean()),
             rows_with_padding=float(((src == PAD) | (tgt == PAD)).any(-1).mean()),
             target_tokens_per_batch=(tgt != PAD).sum((1, 2)).tolist())
  if "tgt_segments" in batches[0]:
    out["pairs_per_row"] = float(np.stack([b["tgt_segments"] for b in batches]).max(-1).mean())
  return out


def _vm_hwm_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024.0
  return float("nan")


def cpu_name() -> str:
  """This CPU's model name, count and the flags that decide matmul speed (AVX-512,
  AVX512-BF16, AMX), as /proc/cpuinfo lists them."""
  flags, model = set(), platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name") and model == platform.machine():
          model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
  except OSError:
    pass
  has = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
  return f"{model}, {os.cpu_count()} CPUs" + (f" ({', '.join(has) or 'no AVX-512'})"
                                              if flags else "")


def timed_calls(f, *args, repeats: int = 7) -> list[float]:
  """Wall times of `repeats` calls of jitted `f` after two warm-up calls."""
  for _ in range(2):
    f(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - t)
  return times


def matmul_peak(dtype: str, n: int = PEAK_N, repeats: int = 7) -> dict:
  """FLOP/s of a jitted n^3 dot in `dtype` with f32 accumulation/output, best of `repeats`."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  times = timed_calls(f, a, b, repeats=repeats)
  best = min(times)
  return dict(n=n, dtype=dtype, best_s=best, flops_per_s=2.0 * n ** 3 / best,
              times_s=times)


def workload_config(preset: str, dtype: str, package: str = "seq2seq", kernels: str = "",
                    workload: str = "cpu"):
  """The run's Config: the preset at the workload's vocabulary, batch and length (built by
  `package`, the seq2seq package or another version of it: bench/ab.py), with
  model.kernels = `kernels` if given."""
  seq2seq = importlib.import_module(package)
  config = importlib.import_module(package + ".config")
  Config, TrainConfig = config.Config, config.TrainConfig
  w = WORKLOAD_SETS[workload][preset]
  if "experiment" in w:   # that run's model and training config (train.py --config NAME)
    run = config.get_experiment(w["experiment"])
    model = run.model.replace(vocab_size=w["vocab_size"], dtype=dtype, **w.get("model", {}))
    train = run.train.replace(batch_size=w["batch"], seq_len=w["length"])
  else:
    model = seq2seq.get_config(preset, vocab_size=w["vocab_size"]).replace(
        dtype=dtype, dropout_rate=0.1, share_embeddings=True, tie_output=True,
        # Also on the FFN's hidden units (not the paper's, nor our default): the workload of
        # every earlier run, and what the peer's nn.Transformer does.
        ffn_dropout_rate=0.1, **w.get("model", {}))
    train = TrainConfig(batch_size=w["batch"], seq_len=w["length"], label_smoothing=0.1)
  if kernels:
    model = model.replace(kernels=kernels)
  return Config(model=model, train=train)


def host_batches(preset: str, workload: str = "cpu", corpus: str = CORPUS,
                 data_dir: str = DATA_DIR) -> tuple[list[dict], dict]:
  """(the workload's batches as host arrays, what they are): 4 random ones for the CPU
  workloads, train.py's packed ones (`packed_batches`) for the others."""
  if workload != "cpu":
    return packed_batches(workload, preset, corpus, data_dir)
  import numpy as np
  w = WORKLOAD_SETS[workload][preset]
  rng = np.random.default_rng(0)
  local = [random_batch(rng, w["batch"], w["length"], w["vocab_size"],
                        w.get("min_len", MIN_LEN)) for _ in range(4)]
  return local, dict(source=f"random tokens, one pair per row of length uniform in "
                            f"[{w.get('min_len', MIN_LEN)}, {w['length']}]",
                     **batch_stats(local))


def workload(preset: str, dtype: str, package: str = "seq2seq", kernels: str = "",
             workload: str = "cpu", local: list[dict] | None = None):
  """(Trainer, initial state, its batches as host arrays, the same as global batches) of the
  workload, built by `package` (see workload_config); the batches `host_batches` gives
  unless `local` is given."""
  import jax
  trainer = importlib.import_module(package + ".train_lib").Trainer(
      workload_config(preset, dtype, package, kernels, workload), bos_id=BOS)
  state = trainer.init(jax.random.key(0))
  jax.block_until_ready(state)
  if local is None:
    local, _ = host_batches(preset, workload)
  if max(int(b[k].max()) for b in local for k in ("src", "tgt")) >= trainer.cfg.model.vocab_size:
    raise ValueError(f"{preset}: token ids past the model's vocabulary "
                     f"({trainer.cfg.model.vocab_size})")
  return trainer, state, local, [trainer.global_batch(b) for b in local]


def device_peak_bytes() -> int | None:
  """The default device's peak memory in use, where its backend reports it (GPU, TPU)."""
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:   # noqa: BLE001 - backends without memory statistics
    return None
  return stats.get("peak_bytes_in_use")


def run_one(preset: str, dtype: str, steps: int, warmup: int, kernels: str = "",
            workload_set: str = "cpu", peak_n: int = PEAK_N, corpus: str = CORPUS,
            data_dir: str = DATA_DIR) -> dict:
  """One (preset, dtype) measurement; meant to run in a fresh process. Its `error` says
  which step had a non-finite loss or gradient norm, if one had."""
  import jax
  from seq2seq import net
  from seq2seq.kernels import accelerator, malloc

  rss_start = _vm_hwm_mb()
  w = WORKLOAD_SETS[workload_set][preset]
  local, data = host_batches(preset, workload_set, corpus, data_dir)
  trainer, state, local, batches = workload(preset, dtype, kernels=kernels,
                                            workload=workload_set, local=local)
  model = trainer.cfg.model
  tgt_tokens = [int((b["tgt"] != PAD).sum()) for b in local]
  pad_frac = 1.0 - sum(tgt_tokens) / (len(local) * w["batch"] * w["length"])

  redone = []

  def step(i, watch=False):   # the first and warm-up steps under the net, as train.py's first
    nonlocal state, trainer
    t, c = time.perf_counter(), time.process_time()
    trainer, state, m, said = net.step_with_fallback(trainer, state, batches[i % len(batches)],
                                                     watch=watch)
    jax.block_until_ready((state, m))
    dt, dc = time.perf_counter() - t, time.process_time() - c
    redone.extend(said)
    return dt, dc, float(m["loss_sum"]) / max(float(m["tokens"]), 1.0), float(m["grad_norm"])

  first = step(0, watch=True)
  malloc.release_freed_memory()   # as train.py does after compiling
  warm = [step(1 + i, watch=True) for i in range(warmup)]
  runs = [step(1 + warmup + i) for i in range(steps)]
  bad = [i + 1 for i, r in enumerate([first, *warm, *runs])
         if not (math.isfinite(r[2]) and math.isfinite(r[3]))]
  step_s = statistics.median(r[0] for r in runs)
  cpu_s = statistics.median(r[1] for r in runs)
  idx = [(1 + warmup + i) % len(batches) for i in range(steps)]
  tok_per_step = statistics.mean(tgt_tokens[i] for i in idx)
  peak_rss_mb = _vm_hwm_mb()  # before the matmul-peak buffers exist
  device_peak = device_peak_bytes()

  peak = matmul_peak(dtype, n=peak_n)
  flops = train_flops(model, w["batch"], w["length"], w["length"])
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  kind = jax.devices()[0].device_kind
  sheet = datasheet_bf16_peak(kind) if jax.default_backend() == "gpu" else None
  return dict(
      workload=workload_set, device=kind, kernels=trainer.cfg.model.kernels,
      attention=accelerator.verdicts(), redone_on_xla=redone, device_peak_bytes=device_peak,
      datasheet_bf16_flops_per_s=sheet,
      mfu_datasheet=flops / step_s / sheet if sheet else None,
      preset=preset, dtype=dtype, batch=w["batch"], length=w["length"],
      vocab=w["vocab_size"], params=int(n_params), data=data, pad_fraction=pad_frac,
      target_tokens_per_step=tok_per_step, first_step_s=first[0],
      compile_s=max(first[0] - step_s, 0.0), step_s=step_s,
      steps_s=[r[0] for r in runs], cpu_s_per_step=cpu_s,
      tokens_per_s=tok_per_step / step_s,
      target_tokens_per_s=TARGET_SETS[workload_set].get((preset, dtype)),
      train_flops_per_step=flops, model_flops_per_s=flops / step_s,
      matmul_peak_flops_per_s=peak["flops_per_s"], matmul_peak=peak,
      mfu=flops / step_s / peak["flops_per_s"],
      limit_tokens_per_s=tok_per_step * peak["flops_per_s"] / flops, peak_rss_mb=peak_rss_mb,
      rss_after_import_mb=rss_start, losses=[r[2] for r in [first, *warm, *runs]],
      grad_norms=[r[3] for r in [first, *warm, *runs]], final_loss=runs[-1][2],
      **(dict(error=f"non-finite loss or gradient norm at step {bad[0]} of "
                    f"{1 + warmup + steps}") if bad else {}))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--steps", type=int, default=3, help="timed steps after warm-up")
  ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "train.json"))
  ap.add_argument("--kernels", default="", help="model.kernels (default: the config's, auto)")
  ap.add_argument("--workload", default="cpu", choices=tuple(WORKLOAD_SETS),
                  help="batch shapes: cpu (the CPU targets'), gpu (one datacenter GPU), dry")
  ap.add_argument("--peak_n", type=int, default=PEAK_N, help="matmul peak's n (n^3 dot)")
  ap.add_argument("--corpus", default=CORPUS,
                  help="gpu and dry workloads: the corpus of their batches ({train,validation,"
                       "test}.{en,fr}); where it is missing, the embedded numbers task")
  ap.add_argument("--data_dir", default=DATA_DIR,
                  help="where those batches, their dataset, vocabulary and tokens are kept")
  ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  workloads = WORKLOAD_SETS[args.workload]

  if args._child:  # preset,dtype: measure and print one JSON line (exit 1: a bad step)
    from seq2seq.kernels import malloc
    malloc.keep_freed_memory()   # as train.py does, before JAX starts
    preset, dtype = args._child.split(",")
    import jax
    jax.config.update("jax_enable_compilation_cache", False)   # compile times from scratch
    r = run_one(preset, dtype, args.steps, args.warmup, args.kernels, args.workload,
                args.peak_n, args.corpus, args.data_dir)
    print("RESULT " + json.dumps(r), flush=True)
    return 1 if "error" in r else 0

  rows = []
  for preset in args.presets.split(","):
    if preset not in workloads:
      sys.exit(f"unknown preset {preset!r}; choose from {', '.join(workloads)}")
    for dtype in args.dtypes.split(","):
      if dtype not in ("float32", "bfloat16"):
        sys.exit(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
      t = time.perf_counter()
      proc = subprocess.run(
          [sys.executable, os.path.abspath(__file__), "--_child", f"{preset},{dtype}",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--kernels", args.kernels,
           "--workload", args.workload, "--peak_n", str(args.peak_n), "--corpus", args.corpus,
           "--data_dir", args.data_dir],
          stdout=subprocess.PIPE, text=True)
      line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
      r = json.loads(line[len("RESULT "):]) if line else dict(preset=preset, dtype=dtype)
      r["wall_s"] = time.perf_counter() - t
      rows.append(r)
      if proc.returncode != 0 or line is None:
        r.update(failed=True, returncode=proc.returncode)
        print(f"  {preset} {dtype}: FAILED (exit {proc.returncode})"
              f"{': ' + r['error'] if 'error' in r else ''}", file=sys.stderr)
        continue
      print(f"  {preset:5s} {dtype:8s} {r['tokens_per_s']:7.0f} tok/s  step "
            f"{r['step_s']:.3f}s (cpu {r['cpu_s_per_step']:.2f}s)  MFU {100 * r['mfu']:.1f}% "
            f"of {r['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s  compile {r['compile_s']:.1f}s"
            f"  peak RSS {r['peak_rss_mb']:.0f} MB  ({r['wall_s']:.0f}s)",
            file=sys.stderr, flush=True)

  import jax  # only for the header / metadata
  head = (f"{'preset':6s} {'dtype':8s} {'batch':>7s} {'tok/s':>7s} {'target':>6s} "
          f"{'step s':>7s} {'GFLOP/s':>8s} {'peak GF/s':>9s} {'MFU':>6s} {'limit':>6s} "
          f"{'compile s':>9s} "
          f"{'peak RSS MB':>11s}")
  print(f"\nTrain step: target tokens/s (non-pad), jax {jax.__version__}, "
        f"{cpu_name()}, load average "
        f"{os.getloadavg()[0]:.1f}, {args.steps} timed steps after {1 + args.warmup} warm-up"
        f"\nMFU = model FLOP/s / {args.peak_n}^3 matmul peak of the same dtype (f32 accumulation),"
        f" measured in the same process; limit = tokens/s at 100% MFU;\n"
        f"train FLOPs/step = {FLOP_FORMULA}\n"
        f"{head}\n{'-' * len(head)}")
  for r in rows:
    if r.get("failed"):
      print(f"{r['preset']:6s} {r['dtype']:8s} FAILED (exit {r['returncode']})"
            f"{': ' + r['error'] if 'error' in r else ''}")
      continue
    target = r["target_tokens_per_s"]
    print(f"{r['preset']:6s} {r['dtype']:8s} {r['batch']:3d}x{r['length']:<3d} "
          f"{r['tokens_per_s']:7.0f} {'-' if target is None else target:>6} {r['step_s']:7.3f} "
          f"{r['model_flops_per_s'] / 1e9:8.1f} {r['matmul_peak_flops_per_s'] / 1e9:9.1f} "
          f"{100 * r['mfu']:5.1f}% {r['limit_tokens_per_s']:6.0f} {r['compile_s']:9.1f} "
          f"{r['peak_rss_mb']:11.0f}")
  ok = [r for r in rows if not r.get("failed")]
  if ok and args.workload != "cpu":
    for r in ok:
      if r.get("mfu_datasheet") is not None:
        print(f"{r['preset']} {r['dtype']}: MFU {100 * r['mfu_datasheet']:.1f}% of the "
              f"{r['device']} datasheet's dense bf16 {r['datasheet_bf16_flops_per_s'] / 1e12:.0f}"
              f" TFLOP/s; device peak memory "
              f"{(r['device_peak_bytes'] or 0) / 2 ** 30:.1f} GiB")
    for r in ok:
      d = r["data"]
      print(f"{r['preset']} batches: {d['source']}, rows of {r['length']} tokens "
            f"{100 * d['src_fill']:.0f}% / {100 * d['tgt_fill']:.0f}% filled (source / "
            f"target), {d['pairs_per_row']:.1f} pairs a row; loss {r['final_loss']:.3f}")
  elif ok:
    print(f"padding: {100 * statistics.mean(r['pad_fraction'] for r in ok):.1f}% of target "
          f"positions; targets: small f32 >= 2800, bf16 >= 5000; base f32 >= 480, bf16 >= "
          f"1000 tok/s; base first-step compile <= {TARGET_BASE_COMPILE_S:.0f} s")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              jax=jax.__version__, device=jax.devices()[0].device_kind,
              cpu_count=os.cpu_count(), machine=platform.machine(), cpu=cpu_name(),
              load_avg=os.getloadavg(), args={k: v for k, v in vars(args).items()
                                               if k != "_child"},
              flop_formula=FLOP_FORMULA,
              targets={f"{p}/{d}": v for (p, d), v in TARGET_SETS[args.workload].items()},
              target_base_compile_s=TARGET_BASE_COMPILE_S)
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=2)
  print(f"wrote {args.out}")
  return 1 if len(ok) < len(rows) else 0


if __name__ == "__main__":
  sys.exit(main())
