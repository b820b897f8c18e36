"""PyTorch peer on the bench workloads: train tokens/s, uncached + cached decode, matmul peak.

A same-machine baseline for bench/bench_train.py and bench/bench_decode.py: the same model
sizes, batches and decode shapes, built from `torch.nn.Transformer(batch_first=True)`
(modes train, decode) and from Hugging Face `transformers` MarianMT (mode decode_cached).
It does not import `seq2seq` (the constants below are copied), so it runs from a venv
that has torch, numpy and transformers only. Install them in a SEPARATE venv (keep the
project venv clean; pin the versions: the CPU torch wheel, not a multi-GB CUDA build):

    python3 -m venv ~/venvs/torch
    ~/venvs/torch/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    ~/venvs/torch/bin/pip install numpy transformers==5.23.0   # transformers: decode_cached only

(The index URL gives the CPU wheel, 2.13.0+cpu; PyPI's default build brings the CUDA
libraries.)

(transformers pulls in tokenizers, safetensors and huggingface_hub; sentencepiece is NOT
needed: no tokenizer is built and nothing is downloaded. Without transformers the
decode_cached rows fail and the other modes still run.)

Run (from the repo root):

    ~/venvs/torch/bin/python bench/bench_peers_torch.py        # everything, ~6-7 min on 2 idle cores
    ~/venvs/torch/bin/python bench/bench_peers_torch.py --presets small --modes train,decode --steps 2   # ~40 s
    ~/venvs/torch/bin/python bench/bench_peers_torch.py --presets base --modes decode --steps 1
    ~/venvs/torch/bin/python bench/bench_peers_torch.py --presets small --modes decode_cached --steps 1

Workloads (those of the project's speed targets): `small` = vocab 8,000, d_model 256, 3+3
layers, 4 heads, d_ff 1,024; `base` = vocab 32,000, d_model 512, 6+6 layers, 8 heads,
d_ff 2,048.
Shared source/target embedding (N(0, d^-1/2) init like ours) scaled by sqrt(d_model) plus
sinusoidal positions, output head tied to the embedding (no bias), post-LN (torch's default
norm_first=False), ReLU, LayerNorm eps 1e-6. Two changes to the stock module so it computes
what our model computes: attention dropout 0 (nn.Transformer applies its `dropout` to
attention probabilities too; ours only to embeddings, residual branches and the FFN hidden
layer, all 0.1 here), and no final encoder/decoder LayerNorm (nn.Transformer always adds
one; our post-LN model has none). Other small differences, irrelevant to speed: torch's
attention has a key bias (ours has none); torch's label smoothing spreads eps over all V
tokens (ours over the V-1 wrong ones).

Modes:
  train   forward + backward + torch.optim.Adam(betas=(0.9, 0.98), eps=1e-9, constant lr,
          default implementation) on random batches built exactly like `random_batch` in
          bench_train.py (batch 32 x 64 small, 16 x 64 base; row length uniform in [47, 64],
          EOS last, then PAD=0: ~13% padding), src/tgt key padding masks and a causal
          target mask, teacher forcing (decoder input = target shifted right behind BOS),
          label-smoothed (0.1) cross-entropy averaged over non-pad targets, dropout 0.1.
          2 untimed warm-up steps, then the median of `--steps` timed steps; tokens/s =
          non-pad target tokens per step / median step time (as bench_train.py).
  decode  greedy decoding the way an nn.Transformer user does it, WITHOUT a KV cache (the
          module has none): encode once (`model.encoder`), then for each of 64 steps run
          `model.decoder` on the whole prefix [BOS, y_1..y_i] (self- and cross-attention
          keys/values all recomputed) and take the argmax of the tied head at the last
          position. Batch 16 (small) / 8 (base), random sources of 32 tokens (EOS last,
          like bench_decode.py), exactly 64 new tokens per row (no EOS stop), under
          torch.inference_mode() in eval mode. 1 untimed warm-up call, then the median of
          `--steps` timed calls; tokens/s = batch * 64 / call time. Compare with
          bench_decode.py's `cached` (what our users get) and `full` (our recompute loop,
          which recomputes a fixed 64-token buffer each step, so it does more work than
          this growing prefix).
  decode_cached  KV-CACHED decoding the way a Hugging Face user does it: `transformers`
          MarianMTModel(MarianConfig(...)) with RANDOM weights (built from the config, no
          download; HF_HUB_OFFLINE=1 is set), same sizes as above, shared embeddings and
          tied head (Marian's default; plus Marian's zero final_logits_bias), scale_embedding
          =True, Marian's static sinusoidal positions (max_position_embeddings 256), post-LN,
          activation relu (Marian's config default is gelu; ours is ReLU), Marian's default
          N(0, 0.02) init, attention = transformers' default (sdpa). Token ids: pad 0,
          eos 2, decoder_start 1 (= our PAD/EOS/BOS); forced_eos_token_id=None (Marian's
          default config would force EOS as the last token). Timed call:
            model.generate(input_ids, attention_mask, use_cache=True, do_sample=False,
                           num_beams=1 | 4, min_new_tokens=64, max_new_tokens=64,
                           early_stopping=False[, length_penalty=0.6 for beam])
          under torch.inference_mode() in eval mode; `--strategies` greedy (num_beams=1) and
          beam4 (num_beams=4, returns the best beam). Same sources as `decode` (batch 16
          small / 8 base, 32 random tokens, EOS last, no padding). min_new_tokens masks EOS,
          so every row gets exactly 64 new tokens (checked: output is batch x (1 + 64) with
          no EOS after decoder_start). tokens/s = batch * 64 / call time (beam4 counts the
          returned tokens, not the 4x hypotheses), median of `--steps` calls after 1
          warm-up. The random model tends to repeat one token, which costs the same as any
          other output. Each (strategy) runs in its own subprocess like the rest.
On a GPU (`--device cuda`, with `--workload gpu`: bench_train.py's GPU_WORKLOADS, `big`
and `bible_gpu` too, and decode batch 128): tensors and models on the GPU, autocast('cuda'),
each timed region closed by torch.cuda.synchronize(), the matmul peak at --peak_n (8192) on
the GPU, and the GPU's peak allocated memory. Mode `train_compiled` is `train` with the
model wrapped in torch.compile (default mode; its first step, compilation included, is
reported apart). Dtype `float16` (decode_cached only) is model.to(torch.float16).
`--workload dry` (`tiny`, a few tokens) runs every mode in seconds, for a dry run of the
script. Mode train of the gpu and dry workloads trains on bench_train.py's batches of them,
the same arrays (`packed_batches`: train.py's first 8 batches of the Bible corpus, several
pairs to a row, then padding): each pair's positions and its decoder input behind its own
BOS, and per-batch bool attention masks [B * heads, L, L] (src_mask, tgt_mask and
memory_mask: a query sees its own pair's keys, causally in the decoder; a padding query sees
every key, so that no softmax row is empty), built once before the timed steps. A
non-finite loss at any step fails the row. Not matched: the peer's dropout stays 0.1
(bible_gpu's sublayer dropout is 0.2).

Dtypes: `float32`, and `bfloat16` = torch.autocast('cpu', dtype=torch.bfloat16) around
the forward (f32 params and Adam state; logits cast to f32 for the loss). bfloat16 decode
runs with torch.backends.mha.set_fastpath_enabled(False): the encoder's eval fast path
fails under CPU autocast (pytorch/pytorch#132613); float32 decode keeps the fast path.
decode_cached bfloat16 is different: model.to(torch.bfloat16) (bf16 weights, KV cache and
logits), NOT autocast: both run, and the cast was as fast on small and ~1.3-1.7x faster on
base greedy (measured 1 thread, busy machine; presumably autocast re-casting the f32
weights, incl. the 32k x 512 tied head, at every one of the 64 steps).

Every (preset, mode, dtype[, strategy]) runs in a fresh subprocess with torch.set_num_threads(
os.cpu_count()); after its workload the same process measures the matmul peak of its dtype:
2048x2048 @ 2048x2048 (f32 x f32 -> f32, or bf16 x bf16 -> bf16 with f32 accumulation
inside oneDNN/MKL; torch's CPU matmul has no bf16 -> f32 output), best of 7 after 2 warm-up
calls. Train MFU uses bench_train.py's analytic matmul FLOP count (padded shapes, 3 x fwd).
Prints tables and writes JSON to bench/results/peers_torch.json.

On a shared machine the numbers swing far more than JAX's: torch's OpenMP threads spin at
barriers, so when another process holds a core a 2-thread run can slow down several-fold
(cpu s ~ wall s instead of ~2x). Run it on an idle machine; `--threads 1` gives a steadier
(lower) figure under contention. decode_cached suffers most (generate() is thousands of tiny
ops, each ending at a barrier): beside a 2-core training run, niced, small greedy f32 took
28 s a call with 2 threads against ~1.1 s with `--threads 1`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

# Copied from bench_train.py / bench_decode.py / seq2seq.config (no seq2seq import).
MODELS = {"small": dict(vocab_size=8000, d_model=256, num_heads=4, num_encoder_layers=3,
                        num_decoder_layers=3, d_ff=1024),
          "base": dict(vocab_size=32000, d_model=512, num_heads=8, num_encoder_layers=6,
                       num_decoder_layers=6, d_ff=2048),
          "big": dict(vocab_size=32000, d_model=1024, num_heads=16, num_encoder_layers=6,
                      num_decoder_layers=6, d_ff=4096),
          # bible_gpu's run: the base model at its vocabulary (bench_train.GPU_WORKLOADS)
          "bible_gpu": dict(vocab_size=8000, d_model=512, num_heads=8, num_encoder_layers=6,
                            num_decoder_layers=6, d_ff=2048),
          "tiny": dict(vocab_size=512, d_model=64, num_heads=4, num_encoder_layers=2,
                       num_decoder_layers=2, d_ff=256)}
TRAIN_WORKLOADS = {"small": dict(batch=32, length=64), "base": dict(batch=16, length=64)}
DECODE_WORKLOADS = {"small": dict(batch=16), "base": dict(batch=8)}
GPU_DECODE_WORKLOADS = {"small": dict(batch=128), "base": dict(batch=128),
                        "big": dict(batch=128)}
DRY_DECODE_WORKLOADS = {"tiny": dict(batch=2, src_len=8, new_tokens=4)}
SRC_LEN, NEW_TOKENS = 32, 64
DROPOUT, LABEL_SMOOTHING = 0.1, 0.1
MAX_LEN = 256
PAD, BOS, EOS = 0, 1, 2
PEAK_N = 2048
WARMUP_TRAIN, WARMUP_DECODE = 2, 1
MODES = ("train", "train_compiled", "decode", "decode_cached")
DTYPES = ("float32", "bfloat16", "float16")
STRATEGIES = {"greedy": 1, "beam4": 4}  # decode_cached: name -> num_beams
BEAM_LENGTH_PENALTY = 0.6
MARIAN_MAX_POSITIONS = 256  # >= 1 + 64 decoder positions and 32 source positions

# The batches, the FLOP count and the memory reading are bench_train.py's own (stdlib-only
# at import time, so this script still runs from a venv without jax or seq2seq).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import CORPUS, DATA_DIR, FLOP_FORMULA, MIN_LEN, WORKLOAD_SETS  # noqa: E402
from bench_train import _vm_hwm_mb, datasheet_bf16_peak, packed_batches  # noqa: E402
from bench_train import random_batch  # noqa: E402
from bench_train import train_flops as _train_flops  # noqa: E402

# Where the models and tensors live (--device): cpu, or cuda on a GPU.
DEVICE = "cpu"


def train_workloads(workload: str) -> dict:
  """preset -> dict(batch, length[, min_len]) of `--workload`."""
  return TRAIN_WORKLOADS if workload == "cpu" else WORKLOAD_SETS[workload]


def decode_workload(workload: str, preset: str) -> dict:
  """dict(batch, src_len, new_tokens) of `--workload` for `preset`."""
  w = {"cpu": DECODE_WORKLOADS, "gpu": GPU_DECODE_WORKLOADS,
       "dry": DRY_DECODE_WORKLOADS}[workload][preset]
  return dict(dict(src_len=SRC_LEN, new_tokens=NEW_TOKENS), **w)


def _sync():
  """Waits for the GPU's queued work (nothing on a CPU)."""
  if DEVICE == "cuda":
    import torch
    torch.cuda.synchronize()


def _gpu_facts() -> dict:
  """The GPU's name, its peak allocated memory and its datasheet bf16 peak (cuda only)."""
  if DEVICE != "cuda":
    return {}
  import torch
  name = torch.cuda.get_device_name()
  return dict(device=name, device_peak_bytes=torch.cuda.max_memory_allocated(),
              datasheet_bf16_flops_per_s=datasheet_bf16_peak(name))


def _print_failed(r: dict) -> bool:
  """Print a table row for a run that failed; True if it did."""
  if r.get("failed"):
    print(f"{r['preset']:6s} {r['dtype']:8s} FAILED (exit {r['returncode']})"
          f"{': ' + r['error'] if 'error' in r else ''}")
  return bool(r.get("failed"))


def train_flops(cfg: dict, batch: int, src_len: int, tgt_len: int) -> float:
  """bench_train.train_flops for a dict of model sizes."""
  import types
  return _train_flops(types.SimpleNamespace(**cfg), batch, src_len, tgt_len)


def _build_model(preset: str):
  import torch
  from torch import nn
  import torch.nn.functional as F

  cfg = MODELS[preset]

  class PeerTransformer(nn.Module):
    """nn.Transformer + shared scaled embedding + sinusoidal positions + tied head."""

    def __init__(self):
      super().__init__()
      d = cfg["d_model"]
      self.d_model = d
      self.embed = nn.Embedding(cfg["vocab_size"], d)
      nn.init.normal_(self.embed.weight, std=d ** -0.5)
      pos = torch.arange(MAX_LEN, dtype=torch.float32)[:, None]
      inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
      pe = torch.zeros(MAX_LEN, d)
      pe[:, 0::2] = torch.sin(pos * inv)
      pe[:, 1::2] = torch.cos(pos * inv)
      self.register_buffer("pos", pe, persistent=False)
      self.dropout = nn.Dropout(DROPOUT)
      self.transformer = nn.Transformer(
          d_model=d, nhead=cfg["num_heads"], num_encoder_layers=cfg["num_encoder_layers"],
          num_decoder_layers=cfg["num_decoder_layers"], dim_feedforward=cfg["d_ff"],
          dropout=DROPOUT, activation="relu", layer_norm_eps=1e-6, batch_first=True,
          norm_first=False)
      # Match our model: no attention-probability dropout, no final LayerNorm (post-LN).
      for m in self.transformer.modules():
        if isinstance(m, nn.MultiheadAttention):
          m.dropout = 0.0
      self.transformer.encoder.norm = None
      self.transformer.decoder.norm = None
      self.register_buffer("causal", torch.triu(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool),
                                                1), persistent=False)

    def embed_positions(self, ids, positions=None):
      pos = self.pos[:ids.shape[1]] if positions is None else self.pos[positions]
      return self.dropout(self.embed(ids) * math.sqrt(self.d_model) + pos)

    def head(self, h):
      return F.linear(h, self.embed.weight)

    def forward(self, src, tgt_in, packed=None):
      if packed is not None:   # packed rows: `packed_inputs`' positions and masks
        src_pos, tgt_pos, src_mask, tgt_mask, memory_mask = packed
        return self.head(self.transformer(
            self.embed_positions(src, src_pos), self.embed_positions(tgt_in, tgt_pos),
            src_mask=src_mask, tgt_mask=tgt_mask, memory_mask=memory_mask))
      src_pad, tgt_pad = src == PAD, tgt_in == PAD
      t = tgt_in.shape[1]
      h = self.transformer(
          self.embed_positions(src), self.embed_positions(tgt_in),
          tgt_mask=self.causal[:t, :t], src_key_padding_mask=src_pad,
          tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True)
      return self.head(h)

  return cfg, PeerTransformer()


def packed_inputs(b: dict, heads: int) -> tuple:
  """(src, decoder input, target, the forward's `packed`) of a batch of packed rows (numpy
  int32 [B, L]: src, tgt, their segment ids and positions) on DEVICE. The decoder input is
  each pair's target behind BOS (seq2seq.losses.shift_right); a query attends to the keys
  of its own pair (and in the decoder's self-attention to those not after it), and a
  padding query to every key, so that no softmax row is empty (its output reaches no loss
  and no other query). Masks: bool [B * heads, Lq, Lk], True = masked (nn.Transformer's)."""
  import torch
  t = lambda x: torch.from_numpy(x).long().to(DEVICE)  # noqa: E731
  src, tgt, src_seg, tgt_seg = t(b["src"]), t(b["tgt"]), t(b["src_segments"]), \
      t(b["tgt_segments"])
  prev = torch.cat([torch.zeros_like(tgt_seg[:, :1]), tgt_seg[:, :-1]], 1)
  tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], 1)
  tgt_in = torch.where(tgt_seg != prev, BOS, tgt_in).masked_fill(tgt_seg == 0, PAD)

  def masked(q, k, causal=False):
    allowed = q[:, :, None] == k[:, None, :]
    if causal:
      allowed &= torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=DEVICE).tril()
    allowed |= (q == 0)[:, :, None]
    return (~allowed).repeat_interleave(heads, 0)

  return src, tgt_in, tgt, (t(b["src_positions"]), t(b["tgt_positions"]),
                            masked(src_seg, src_seg), masked(tgt_seg, tgt_seg, causal=True),
                            masked(tgt_seg, src_seg))


def _autocast(dtype: str):
  import contextlib
  import torch
  if dtype in ("bfloat16", "float16"):
    return torch.autocast(DEVICE, dtype=getattr(torch, dtype))
  return contextlib.nullcontext()


def matmul_peak(dtype: str, n: int = PEAK_N, repeats: int = 7) -> dict:
  """FLOP/s of an n^3 torch matmul in `dtype`, best of `repeats` after 2 warm-up calls."""
  import torch
  g = torch.Generator().manual_seed(0)
  tdt = getattr(torch, dtype)
  a = torch.randn(n, n, generator=g).to(device=DEVICE, dtype=tdt)
  b = torch.randn(n, n, generator=g).to(device=DEVICE, dtype=tdt)
  with torch.inference_mode():
    a @ b
    a @ b
    _sync()
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      a @ b
      _sync()
      times.append(time.perf_counter() - t)
  best = min(times)
  return dict(n=n, dtype=dtype, best_s=best, flops_per_s=2.0 * n ** 3 / best, times_s=times)


def run_train(preset: str, dtype: str, steps: int, workload: str = "cpu",
              compiled: bool = False, peak_n: int = PEAK_N, corpus: str = CORPUS,
              data_dir: str = DATA_DIR) -> dict:
  import numpy as np
  import torch
  import torch.nn.functional as F

  cfg, model = _build_model(preset)
  w = train_workloads(workload)[preset]
  model.to(DEVICE).train()
  opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  forward = torch.compile(model) if compiled else model
  if workload == "cpu":
    rng = np.random.default_rng(0)
    local = [random_batch(rng, w["batch"], w["length"], cfg["vocab_size"],
                          w.get("min_len", MIN_LEN)) for _ in range(4)]
    data = dict(source="random tokens, one pair per row")
    batches = []
    for b in local:
      src = torch.from_numpy(b["src"]).long().to(DEVICE)
      tgt = torch.from_numpy(b["tgt"]).long().to(DEVICE)
      tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], 1)
      batches.append((src, tgt_in, tgt, None))
  else:   # bench_train.py's: train.py's packed rows
    local, data = packed_batches(workload, preset, corpus, data_dir)
    batches = [packed_inputs(b, cfg["num_heads"]) for b in local]
  tgt_tokens = [int((b["tgt"] != PAD).sum()) for b in local]
  pad_frac = 1.0 - sum(tgt_tokens) / (len(local) * w["batch"] * w["length"])

  def step(i):
    src, tgt_in, tgt, packed = batches[i % len(batches)]
    t, c = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    with _autocast(dtype):
      logits = forward(src, tgt_in, packed)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                           ignore_index=PAD, label_smoothing=LABEL_SMOOTHING)
    loss.backward()
    opt.step()
    loss = float(loss)
    return time.perf_counter() - t, time.process_time() - c, loss

  first = step(0)
  warm = [step(i) for i in range(1, WARMUP_TRAIN)]
  runs = [step(WARMUP_TRAIN + i) for i in range(steps)]
  first_s = first[0]
  bad = [i + 1 for i, r in enumerate([first, *warm, *runs]) if not math.isfinite(r[2])]
  step_s = statistics.median(r[0] for r in runs)
  idx = [(WARMUP_TRAIN + i) % len(batches) for i in range(steps)]
  tok_per_step = statistics.mean(tgt_tokens[i] for i in idx)
  peak_rss_mb = _vm_hwm_mb()
  gpu = _gpu_facts()
  peak = matmul_peak(dtype, n=peak_n)
  flops = train_flops(cfg, w["batch"], w["length"], w["length"])
  sheet = gpu.get("datasheet_bf16_flops_per_s")
  return dict(
      **gpu, mfu_datasheet=flops / step_s / sheet if sheet else None, workload=workload,
      mode="train_compiled" if compiled else "train", preset=preset, dtype=dtype,
      batch=w["batch"], length=w["length"],
      vocab=cfg["vocab_size"], params=sum(p.numel() for p in model.parameters()),
      pad_fraction=pad_frac, target_tokens_per_step=tok_per_step, first_step_s=first_s,
      step_s=step_s, steps_s=[r[0] for r in runs], best_step_s=min(r[0] for r in runs),
      cpu_s_per_step=statistics.median(r[1] for r in runs), cpu_steps_s=[r[1] for r in runs],
      tokens_per_s=tok_per_step / step_s, train_flops_per_step=flops,
      model_flops_per_s=flops / step_s, matmul_peak_flops_per_s=peak["flops_per_s"],
      matmul_peak=peak, mfu=flops / step_s / peak["flops_per_s"], peak_rss_mb=peak_rss_mb,
      data=data, losses=[r[2] for r in [first, *warm, *runs]], final_loss=runs[-1][2],
      **(dict(error=f"non-finite loss at step {bad[0]} of {WARMUP_TRAIN + steps}")
         if bad else {}))


def run_decode(preset: str, dtype: str, steps: int, workload: str = "cpu",
               peak_n: int = PEAK_N) -> dict:
  import numpy as np
  import torch

  cfg, model = _build_model(preset)
  w = decode_workload(workload, preset)
  src_len, new_tokens = w["src_len"], w["new_tokens"]
  model.to(DEVICE).eval()
  rng = np.random.default_rng(0)
  src_np = rng.integers(3, cfg["vocab_size"], (w["batch"], src_len)).astype(np.int32)
  src_np[:, -1] = EOS
  src = torch.from_numpy(src_np).long().to(DEVICE)
  tr = model.transformer
  # The encoder's inference fast path (torch._transformer_encoder_layer_fwd) fails under
  # CPU bf16 autocast ("expected scalar type Float but found BFloat16", pytorch/pytorch
  # #132613); a user has to switch it off, so bfloat16 decode runs the regular path.
  fastpath = dtype == "float32"
  torch.backends.mha.set_fastpath_enabled(fastpath)

  def greedy():
    src_pad = src == PAD
    memory = tr.encoder(model.embed_positions(src), src_key_padding_mask=src_pad)
    ys = torch.full((src.shape[0], 1), BOS, dtype=torch.long, device=DEVICE)
    for _ in range(new_tokens):
      t = ys.shape[1]
      h = tr.decoder(model.embed_positions(ys), memory, tgt_mask=model.causal[:t, :t],
                     memory_key_padding_mask=src_pad, tgt_is_causal=True)
      nxt = model.head(h[:, -1]).argmax(-1, keepdim=True)
      ys = torch.cat([ys, nxt], 1)
    return ys[:, 1:]

  def call():
    t, c = time.perf_counter(), time.process_time()
    with torch.inference_mode(), _autocast(dtype):
      out = greedy()
    _sync()
    return time.perf_counter() - t, time.process_time() - c, out

  first_s, _, out = call()
  assert out.shape == (w["batch"], new_tokens), out.shape
  for _ in range(1, WARMUP_DECODE):
    call()
  runs = [call()[:2] for _ in range(steps)]
  run_s = statistics.median(r[0] for r in runs)
  peak_rss_mb = _vm_hwm_mb()
  gpu = _gpu_facts()
  peak = matmul_peak(dtype, n=peak_n)
  return dict(
      **gpu, workload=workload,
      mode="decode", preset=preset, dtype=dtype, batch=w["batch"], src_len=src_len,
      new_tokens=new_tokens, vocab=cfg["vocab_size"], strategy="greedy", kv_cache=False,
      mha_fastpath=fastpath,
      first_call_s=first_s, run_s=run_s, runs_s=[r[0] for r in runs],
      best_run_s=min(r[0] for r in runs), cpu_s=statistics.median(r[1] for r in runs),
      cpu_runs_s=[r[1] for r in runs],
      tokens_per_s=w["batch"] * new_tokens / run_s,
      matmul_peak_flops_per_s=peak["flops_per_s"], matmul_peak=peak,
      peak_rss_mb=peak_rss_mb)


def _build_marian(preset: str):
  """Randomly initialised MarianMTModel sized like MODELS[preset] (no download)."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from transformers import MarianConfig, MarianMTModel
  cfg = MODELS[preset]
  config = MarianConfig(
      vocab_size=cfg["vocab_size"], d_model=cfg["d_model"],
      encoder_layers=cfg["num_encoder_layers"], decoder_layers=cfg["num_decoder_layers"],
      encoder_attention_heads=cfg["num_heads"], decoder_attention_heads=cfg["num_heads"],
      encoder_ffn_dim=cfg["d_ff"], decoder_ffn_dim=cfg["d_ff"], activation_function="relu",
      max_position_embeddings=MARIAN_MAX_POSITIONS, scale_embedding=True,
      share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
      dropout=DROPOUT, attention_dropout=0.0, activation_dropout=0.0,
      pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS,
      forced_eos_token_id=None)
  model = MarianMTModel(config).eval()
  assert model.lm_head.weight is model.model.shared.weight, "head not tied"
  return cfg, model


def run_decode_cached(preset: str, dtype: str, steps: int, strategy: str,
                      workload: str = "cpu", peak_n: int = PEAK_N) -> dict:
  import numpy as np
  import torch
  import transformers

  cfg, model = _build_marian(preset)
  if dtype in ("bfloat16", "float16"):
    model = model.to(getattr(torch, dtype))
  model = model.to(DEVICE)
  w = decode_workload(workload, preset)
  src_len, new_tokens = w["src_len"], w["new_tokens"]
  num_beams = STRATEGIES[strategy]
  rng = np.random.default_rng(0)
  src_np = rng.integers(3, cfg["vocab_size"], (w["batch"], src_len)).astype(np.int32)
  src_np[:, -1] = EOS
  src = torch.from_numpy(src_np).long().to(DEVICE)
  mask = torch.ones_like(src)
  kw = dict(use_cache=True, do_sample=False, num_beams=num_beams, min_new_tokens=new_tokens,
            max_new_tokens=new_tokens, early_stopping=False)
  if num_beams > 1:
    kw["length_penalty"] = BEAM_LENGTH_PENALTY

  def call():
    t, c = time.perf_counter(), time.process_time()
    with torch.inference_mode():
      out = model.generate(input_ids=src, attention_mask=mask, **kw)
    _sync()
    return time.perf_counter() - t, time.process_time() - c, out

  first_s, _, out = call()
  assert out.shape == (w["batch"], 1 + new_tokens), out.shape
  assert bool((out[:, 0] == BOS).all()), out[:, 0]
  assert not bool((out[:, 1:] == EOS).any()), "a row stopped early"
  for _ in range(1, WARMUP_DECODE):
    call()
  runs = []
  for _ in range(steps):
    run_s, cpu_s, out = call()
    assert out.shape == (w["batch"], 1 + new_tokens), out.shape
    runs.append((run_s, cpu_s))
  run_s = statistics.median(r[0] for r in runs)
  peak_rss_mb = _vm_hwm_mb()
  gpu = _gpu_facts()
  peak = matmul_peak(dtype, n=peak_n)
  return dict(
      **gpu, workload=workload,
      mode="decode_cached", preset=preset, dtype=dtype, batch=w["batch"], src_len=src_len,
      new_tokens=new_tokens, vocab=cfg["vocab_size"], strategy=strategy, num_beams=num_beams,
      length_penalty=kw.get("length_penalty"), kv_cache=True,
      peer="transformers.MarianMTModel (random init)", transformers=transformers.__version__,
      attn_implementation=model.config._attn_implementation,
      bf16_method=f"model.to(torch.{dtype})" if dtype != "float32" else None,
      token_ids=dict(pad=PAD, eos=EOS, decoder_start=BOS),
      params=sum(p.numel() for p in model.parameters()),
      first_call_s=first_s, run_s=run_s, runs_s=[r[0] for r in runs],
      best_run_s=min(r[0] for r in runs), cpu_s=statistics.median(r[1] for r in runs),
      cpu_runs_s=[r[1] for r in runs],
      tokens_per_s=w["batch"] * new_tokens / run_s,
      matmul_peak_flops_per_s=peak["flops_per_s"], matmul_peak=peak,
      peak_rss_mb=peak_rss_mb)


def _child(spec: str, steps: int, threads: int, workload: str = "cpu",
           peak_n: int = PEAK_N, corpus: str = CORPUS, data_dir: str = DATA_DIR) -> dict:
  import warnings
  import torch
  warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  preset, mode, dtype, *rest = spec.split(",")
  if mode == "decode_cached":
    r = run_decode_cached(preset, dtype, steps, rest[0], workload, peak_n)
  elif mode in ("train", "train_compiled"):
    r = run_train(preset, dtype, steps, workload, mode == "train_compiled", peak_n, corpus,
                  data_dir)
  else:
    r = run_decode(preset, dtype, steps, workload, peak_n)
  r.update(torch=torch.__version__, num_threads=torch.get_num_threads(), torch_device=DEVICE)
  return r


def _transformers_version():
  from importlib import metadata
  try:
    return metadata.version("transformers")
  except metadata.PackageNotFoundError:
    return None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--strategies", default=",".join(STRATEGIES),
                  help="decode_cached strategies (greedy = num_beams 1, beam4 = num_beams 4)")
  ap.add_argument("--steps", type=int, default=3,
                  help="timed train steps (after 2 warm-up) / timed decode calls (after 1)")
  ap.add_argument("--threads", type=int, default=os.cpu_count(),
                  help="torch.set_num_threads (default: all CPUs)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "peers_torch.json"))
  ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                  help="where models and tensors live (cuda: the first GPU)")
  ap.add_argument("--workload", default="cpu", choices=("cpu", "gpu", "dry"),
                  help="batch shapes: cpu (bench_train/bench_decode's), gpu, dry (tiny)")
  ap.add_argument("--peak_n", type=int, default=PEAK_N, help="matmul peak's n (n^3)")
  ap.add_argument("--corpus", default=CORPUS, help="gpu and dry train workloads: "
                  "bench_train.py's --corpus (the same batches)")
  ap.add_argument("--data_dir", default=DATA_DIR, help="bench_train.py's --data_dir (its "
                  "batches are read from there; built, with seq2seq, where missing)")
  ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  global DEVICE
  DEVICE = args.device

  if args._child:  # preset,mode,dtype[,strategy]: measure and print one JSON line
    r = _child(args._child, args.steps, args.threads, args.workload, args.peak_n, args.corpus,
               args.data_dir)
    print("RESULT " + json.dumps(r), flush=True)
    return 1 if "error" in r else 0

  presets, modes, dtypes, strategies = (s.split(",") for s in (
      args.presets, args.modes, args.dtypes, args.strategies))
  for name, vals, ok in (("preset", presets, MODELS), ("mode", modes, MODES),
                         ("dtype", dtypes, DTYPES),
                         ("strategy", strategies, STRATEGIES)):
    for v in vals:
      if v not in ok:
        sys.exit(f"unknown {name} {v!r}; choose from {', '.join(ok)}")
  for preset in presets:
    if not any(m.startswith("train") for m in modes):
      break
    if preset not in train_workloads(args.workload):
      sys.exit(f"preset {preset!r} has no {args.workload} train workload; choose from "
               f"{', '.join(train_workloads(args.workload))}")
  for preset in presets:
    if any(m.startswith("decode") for m in modes):
      try:
        decode_workload(args.workload, preset)
      except KeyError:
        sys.exit(f"preset {preset!r} has no {args.workload} decode workload")
  load_before = os.getloadavg()
  rows = []
  specs = [(preset, mode, dtype, strategy)
           for preset in presets for mode in modes for dtype in dtypes
           for strategy in (strategies if mode == "decode_cached" else ["greedy"])]
  for preset, mode, dtype, strategy in specs:
    spec = f"{preset},{mode},{dtype}" + (f",{strategy}" if mode == "decode_cached" else "")
    label = f"{mode}/{strategy}" if mode == "decode_cached" else mode
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_child", spec,
         "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device,
         "--workload", args.workload, "--peak_n", str(args.peak_n), "--corpus", args.corpus,
         "--data_dir", args.data_dir],
        stdout=subprocess.PIPE, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    r = json.loads(line[len("RESULT "):]) if line else dict(
        preset=preset, mode=mode, dtype=dtype,
        **(dict(strategy=strategy) if mode == "decode_cached" else {}))
    r["wall_s"] = time.perf_counter() - t
    rows.append(r)
    if proc.returncode != 0 or line is None:
      r.update(failed=True, returncode=proc.returncode)
      print(f"  {preset} {label} {dtype}: FAILED (exit {proc.returncode})"
            f"{': ' + r['error'] if 'error' in r else ''}", file=sys.stderr)
      continue
    extra = (f"step {r['step_s']:.3f}s (cpu {r['cpu_s_per_step']:.2f}s)  MFU "
             f"{100 * r['mfu']:.1f}%" if mode.startswith("train") else
             f"call {r['run_s']:.3f}s (cpu {r['cpu_s']:.2f}s)")
    print(f"  {preset:5s} {label:6s} {dtype:8s} {r['tokens_per_s']:7.0f} tok/s  {extra}  "
          f"peak {r['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s  peak RSS "
          f"{r['peak_rss_mb']:.0f} MB  ({r['wall_s']:.0f}s)", file=sys.stderr, flush=True)

  import torch  # only for the header / metadata
  first = next((r for r in rows if not r.get("failed") and "new_tokens" in r), {})
  SRC_LEN, NEW_TOKENS = first.get("src_len", "?"), first.get("new_tokens", "?")  # noqa: N806
  ok = [r for r in rows if not r.get("failed")]
  print(f"\nPyTorch peer: torch {torch.__version__}, {platform.processor() or platform.machine()},"
        f" {os.cpu_count()} CPUs (set_num_threads({args.threads})), load average "
        f"{load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after")
  train = [r for r in rows if r["mode"].startswith("train")]
  if train:
    head = (f"{'preset':6s} {'mode':14s} {'dtype':8s} {'batch':>7s} {'tok/s':>7s} "
            f"{'step s':>7s} {'GFLOP/s':>8s} {'peak GF/s':>9s} {'MFU':>6s} {'1st step s':>10s} "
            f"{'peak RSS MB':>11s}")
    print(f"\nTrain step (nn.Transformer, Adam): target tokens/s (non-pad), median of "
          f"{args.steps} timed steps after {WARMUP_TRAIN} warm-up; bfloat16 = "
          f"torch.autocast('{args.device}', bfloat16); train_compiled: torch.compile(model)\n"
          f"MFU = model FLOP/s / {args.peak_n}^3 matmul peak of the "
          f"same dtype, same process; FLOPs/step = {FLOP_FORMULA}\n{head}\n{'-' * len(head)}")
    for r in train:
      if _print_failed(r):
        continue
      print(f"{r['preset']:6s} {r['mode']:14s} {r['dtype']:8s} {r['batch']:3d}x{r['length']:<3d} "
            f"{r['tokens_per_s']:7.0f} {r['step_s']:7.3f} {r['model_flops_per_s'] / 1e9:8.1f} "
            f"{r['matmul_peak_flops_per_s'] / 1e9:9.1f} {100 * r['mfu']:5.1f}% "
            f"{r['first_step_s']:10.2f} {r['peak_rss_mb']:11.0f}")
  dec = [r for r in rows if r["mode"] == "decode"]
  if dec:
    head = (f"{'preset':6s} {'dtype':8s} {'batch':>5s} {'tok/s':>7s} {'call s':>7s} "
            f"{'cpu s':>7s} {'peak GF/s':>9s} {'peak RSS MB':>11s}")
    print(f"\nGreedy decode, UNCACHED peer (nn.Transformer has no KV cache: model.decoder "
          f"reruns on the whole prefix every step),\nsrc_len {SRC_LEN}, exactly {NEW_TOKENS} new "
          f"tokens per row, inference_mode; tokens/s = batch * {NEW_TOKENS} / call time, median "
          f"of {args.steps} calls after {WARMUP_DECODE} warm-up\n{head}\n{'-' * len(head)}")
    for r in dec:
      if _print_failed(r):
        continue
      print(f"{r['preset']:6s} {r['dtype']:8s} {r['batch']:5d} {r['tokens_per_s']:7.0f} "
            f"{r['run_s']:7.3f} {r['cpu_s']:7.2f} {r['matmul_peak_flops_per_s'] / 1e9:9.1f} "
            f"{r['peak_rss_mb']:11.0f}")
  cached = [r for r in rows if r["mode"] == "decode_cached"]
  if cached:
    tf = next((r["transformers"] for r in cached if not r.get("failed")), "?")
    head = (f"{'preset':6s} {'dtype':8s} {'strategy':8s} {'batch':>5s} {'tok/s':>7s} "
            f"{'call s':>7s} {'cpu s':>7s} {'1st call s':>10s} {'peak GF/s':>9s} "
            f"{'peak RSS MB':>11s}")
    print(f"\nCACHED decode peer: transformers {tf} MarianMTModel (random init) "
          f"model.generate(use_cache=True, greedy | num_beams=4 length_penalty="
          f"{BEAM_LENGTH_PENALTY}),\nsrc_len {SRC_LEN}, exactly {NEW_TOKENS} new tokens per row "
          f"(min_new_tokens = max_new_tokens), inference_mode; bfloat16 = model.to(bfloat16);"
          f"\ntokens/s = batch * {NEW_TOKENS} / call time, median of {args.steps} calls after "
          f"{WARMUP_DECODE} warm-up\n{head}\n{'-' * len(head)}")
    for r in cached:
      if r.get("failed"):
        print(f"{r['preset']:6s} {r['dtype']:8s} {r['strategy']:8s} FAILED (exit "
              f"{r['returncode']})")
        continue
      print(f"{r['preset']:6s} {r['dtype']:8s} {r['strategy']:8s} {r['batch']:5d} "
            f"{r['tokens_per_s']:7.0f} {r['run_s']:7.3f} {r['cpu_s']:7.2f} "
            f"{r['first_call_s']:10.2f} {r['matmul_peak_flops_per_s'] / 1e9:9.1f} "
            f"{r['peak_rss_mb']:11.0f}")
  if ok and train:
    pads = [r["pad_fraction"] for r in ok if r["mode"].startswith("train")]
    if pads:
      print(f"padding: {100 * statistics.mean(pads):.1f}% of target positions")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              torch=torch.__version__, cpu_count=os.cpu_count(), machine=platform.machine(),
              torch_device=args.device, workload=args.workload,
              gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
              load_avg_before=load_before, load_avg_after=os.getloadavg(),
              args={k: v for k, v in vars(args).items() if k != "_child"},
              flop_formula=FLOP_FORMULA, decode="greedy, no KV cache (full prefix recompute)",
              decode_cached=("transformers MarianMTModel (random init) generate(use_cache=True),"
                             " greedy / beam4 (length_penalty 0.6); bfloat16 = model.to(bfloat16)"),
              transformers=_transformers_version())
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=2)
  print(f"wrote {args.out}")
  return 1 if len(ok) < len(rows) else 0


if __name__ == "__main__":
  sys.exit(main())
