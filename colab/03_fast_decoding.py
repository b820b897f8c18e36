# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/seq2seq/blob/main/colab/03_fast_decoding.ipynb)
#
# # seq2seq · 3. Fast decoding: the KV cache and beam search
#
# A decoder generates one token at a time, and each new token attends to every earlier
# one. Recomputing the keys and values of the whole prefix at every step makes the work
# per token grow with the output; caching them makes it (nearly) constant. This notebook
# walks through the cache, times cached against uncached decoding as the output grows,
# shows that the cross-attention keys and values are computed once per source, and looks
# at beam search's n-best lists and its length penalty.
#
# **Runtime:** CPU (the timings below are CPU timings; on a GPU or TPU runtime the same code runs there
# and the gap is similar in kind). Run after notebook 1 in the same folder (locally), it
# uses the model notebook 1 trained. On Colab every notebook opens in a fresh runtime of
# its own, so this one first trains that model itself (about 3 minutes on CPU).
#
# **Run it locally:** in a checkout of the project, `pip install -e '.[notebooks]'` (the
# project with JupyterLab), then `jupyter lab colab/`; the install cell below then has
# nothing to do.

# %%
# Install the project (this cell is written by colab/make_notebooks.py, the same in every
# notebook). Nothing to do when `seq2seq` is importable (a local run, or this runtime
# installed it already). Otherwise pip installs, with the JAX of a GPU or TPU runtime:
#   1. $SEQ2SEQ_SRC (a checkout or a wheel), if set;
#   2. a wheel seq2seq-*.whl uploaded next to this notebook (on Colab: the Files panel),
#      built in a checkout with `pip wheel --no-deps -w dist .`;
#   3. the checkout this notebook is in (a folder above it holding pyproject.toml);
#   4. REPO_URL.
REPO_URL = "https://github.com/your-org/seq2seq"  # the project's repository (or your fork's)

import importlib, importlib.metadata, importlib.util, os, pathlib, re, shutil, subprocess, sys, tempfile

class InstallStopped(Exception):
  """Stops "Run all" with a one-line message instead of a traceback."""
  def _render_traceback_(self):  # how IPython shows it
    return [f"{type(self).__name__}: {self}"]

def _uploaded_wheel(folder):
  """The newest seq2seq-*.whl in `folder`, under a name pip accepts (a browser saves a
  second upload as "name (1).whl", which pip refuses)."""
  wheels = sorted(pathlib.Path(folder).glob("seq2seq-*.whl"), key=lambda p: p.stat().st_mtime)
  if not wheels:
    return None
  name = re.sub(r" \(\d+\)(?=\.whl$)", "", wheels[-1].name)
  if name == wheels[-1].name:
    return str(wheels[-1])
  return shutil.copy(wheels[-1], pathlib.Path(tempfile.mkdtemp()) / name)

def _checkout(folder):
  folder = pathlib.Path(folder)
  if (folder / "pyproject.toml").is_file() and (folder / "seq2seq").is_dir():
    return str(folder)

def _source():
  """What to pip-install: a wheel or checkout found here, else None."""
  here, given = pathlib.Path.cwd(), os.environ.get("SEQ2SEQ_SRC")
  if given:
    return given
  return _uploaded_wheel(here) or next(filter(None, map(_checkout, (here, *here.parents))), None)

JAX_WHEELS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
              "jax-cuda13-pjrt", "libtpu")

def _installed_versions(names):
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions

if importlib.util.find_spec("seq2seq") is None:
  source = _source()
  if source is None and "/your-org/" in REPO_URL:  # no repository to install from
    raise InstallStopped(
        f"seq2seq is not installed, no seq2seq-*.whl is next to this notebook and REPO_URL "
        f"({REPO_URL}) is a placeholder: upload the wheel (in a checkout: pip wheel --no-deps -w dist .) "
        f"or set REPO_URL to your fork's URL, then run this cell again.")
  packages = [source or f"git+{REPO_URL}"]
  # The runtime's JAX stays as it is: pip may not replace jax, jaxlib or the GPU or TPU
  # plugin they came with (a jax replaced under its plugin is a broken accelerator).
  present = {n: v for n, v in _installed_versions(JAX_WHEELS).items() if v}
  if "jax" not in present:
    if shutil.which("nvidia-smi"):                                   # GPU runtime
      packages.append("jax[cuda12]")
    elif os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"):  # TPU runtime
      packages.append("jax[tpu]")
  keep = pathlib.Path(tempfile.mkdtemp()) / "runtime-jax.txt"
  keep.write_text("".join(f"{n}=={v}\n" for n, v in present.items()))
  # Packages this runtime has imported already: if pip replaces one, Python keeps the old.
  imported = _installed_versions(m for m in ("jax", "jaxlib", "ml_dtypes", "numpy") if m in sys.modules)
  print("pip install", *packages, "..." + (f" (keeping jax {present['jax']})" if "jax" in present else ""))
  constraints = " ".join(filter(None, (os.environ.get("PIP_CONSTRAINT"), str(keep))))
  pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages],
                       capture_output=True, text=True,
                       env={**os.environ, "PIP_CONSTRAINT": constraints})
  if pip.returncode != 0:
    sys.stderr.write(pip.stdout + pip.stderr)
    kept = f" with this runtime's jax {present['jax']}" if "jax" in present else ""
    raise InstallStopped(f"pip could not install {packages[0]}{kept} (exit code "
                         f"{pip.returncode}, its messages are above): fix the wheel, REPO_URL "
                         f"or the network, then run this cell again.")
  importlib.invalidate_caches()
  replaced = [m for m, v in imported.items() if _installed_versions([m])[m] != v]
  if replaced:
    raise InstallStopped(f"pip replaced {', '.join(replaced)}, which this runtime had already "
                         f"imported: restart the runtime (Runtime → Restart session), then "
                         f"run all (this cell will find seq2seq installed).")
  print("installed seq2seq")

# %%
import os
from pathlib import Path

import absl.logging
absl.logging.set_verbosity(absl.logging.ERROR)  # TFDS / Orbax chatter

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import seq2seq

# SEQ2SEQ_NOTEBOOK_SMOKE=1 is the test suite's quick setting (fewer steps, shorter sweeps).
SMOKE = os.environ.get("SEQ2SEQ_NOTEBOOK_SMOKE", "0") not in ("", "0")
ROOT = Path(os.environ.get("SEQ2SEQ_NOTEBOOK_WORKDIR", "runs/notebooks")).absolute()
WORKDIR = ROOT / "quickstart"  # notebook 1 trains here; notebooks 2 and 3 reuse its model
print(f"seq2seq {seq2seq.__version__}, JAX {jax.__version__}: {jax.device_count()} "
      f"{jax.devices()[0].platform.upper()} device(s); runs in {ROOT}" + (" [smoke]" if SMOKE else ""))

# %% [markdown]
# ## The trained model
#
# `recipe()` is notebook 1's run (the default of `python train.py`). `load_workdir`
# restores the model it trained (config, parameters, vocabulary) from its workdir; when
# there is none, as in a fresh Colab runtime, the cell trains it first (about 3 minutes on
# CPU). `Transformer(cfg.model)` is the Flax module; its methods (`encode`,
# `decode_step`, ...) are applied to these parameters below. The model runs the default
# kernels (`kernels="auto"`: on a CPU, the project's fast CPU path).

# %%
from seq2seq import train_lib
from seq2seq.load import load_workdir
from seq2seq.config import get_experiment, override
from seq2seq.errors import UserError
from seq2seq.layout import unroll_layers
from seq2seq.model import Transformer

def recipe():
  """The run of `python train.py` (the "numbers" experiment), data under ROOT."""
  cfg = override(get_experiment("numbers"), [f"data.data_dir={ROOT / 'tensorflow_datasets'}"])
  if SMOKE:  # a few steps only: enough for the pictures, not for a good model
    cfg = override(cfg, ["train.steps=60", "train.log_every=10", "train.eval_every=1000",
                         "train.checkpoint_every=30", "train.cooldown_steps=20"])
  return cfg

def log_line(step, m):
  print(f"step {step:4d}: loss {m['loss']:.3f}, learning rate {m['learning_rate']:.2e}", flush=True)

try:
  cfg, params, tokenizer = load_workdir(WORKDIR)  # the model notebook 1 trained
except UserError:                                 # none yet: train it here (a few minutes)
  print(train_lib.summary(train_lib.train(recipe(), str(WORKDIR), progress=False,
                                          on_log=log_line)))
  cfg, params, tokenizer = load_workdir(WORKDIR)
# Decode steps run one module per layer (training kept each stack's layers stacked).
model = Transformer(cfg.model.replace(scan_layers=False))
variables = {"params": unroll_layers(params)}
BOS, EOS = tokenizer.bos_id, tokenizer.eos_id
print(f"{seq2seq.count_params(params):,} parameters; d_model {cfg.model.d_model}, "
      f"{cfg.model.num_heads} heads, {cfg.model.num_encoder_layers}+{cfg.model.num_decoder_layers} "
      f"layers, vocabulary {tokenizer.vocab_size}")

# %% [markdown]
# ## 1. The cache, by hand
#
# `init_cache` allocates, for every decoder layer, keys and values of shape
# [batch, heads, max_len, d_k] (head-major: a step reads it without a transpose).
# `Transformer.decode_step` feeds one token at position
# `index`, writes its keys/values into the cache there, attends over the slots ≤ index,
# and returns the logits and the new cache. The encoder runs once, and so do the
# cross-attention projections of its output (`precompute_cross_kv`).

# %%
import time

from num2words import num2words
from seq2seq import init_cache
from seq2seq.decoding import decode
from seq2seq.losses import shift_right
from seq2seq.search import Beam, Greedy

SRC = num2words(342_817)
src = jnp.array([tokenizer.encode(SRC) + [EOS]])
L = 32
encoded = model.apply(variables, src, method=Transformer.encode)             # [1, S, D]
cross_kv = model.apply(variables, encoded, method=Transformer.precompute_cross_kv)
cache = init_cache(cfg.model, batch=1, max_len=L)
print("cache:", jax.tree_util.tree_map(lambda a: a.shape, cache))
print("cross-attention k/v, per layer:", [tuple(k.shape) for k, v in cross_kv])

@jax.jit
def step(variables, token, index, cache, cross_kv, src_valid):
  return model.apply(variables, token, index, cache, cross_kv, src_valid,
                     method=Transformer.decode_step)

out, step_logits, token = [], [], BOS
for i in range(L):                                      # greedy, one token per call
  logits, cache = step(variables, jnp.array([[token]]), i, cache, cross_kv, src != 0)
  token = int(jnp.argmax(logits[0, 0]))
  out.append(token); step_logits.append(logits[0, 0])
  if token == EOS:
    break
print(f"\n{SRC} -> {tokenizer.decode(out)}  ({len(out)} steps)")
written = np.asarray(jnp.abs(cache[0]["k"][0]).sum((0, -1)) > 0)         # over heads, d_k
print("cache slots written (layer 0):", int(written.sum()), "of", L)

# The same logits as the teacher-forced decoder on the finished output, all at once:
full = model.apply(variables, encoded, src, shift_right(jnp.array([out]), BOS),
                   method=Transformer.decode)
diff = float(jnp.abs(jnp.stack(step_logits) - full[0]).max())
print("max |cached - teacher-forced| logit difference:", diff)
assert diff < 1e-3
lib = decode(cfg.model, params, src, Greedy(), bos_id=BOS, eos_id=EOS)
assert lib.token_lists(EOS)[0] == (out[:-1] if out[-1] == EOS else out)
print("decode(..., Greedy()) gives the same tokens")


# %% [markdown]
# ## 2. Cross-attention keys and values: computed once
#
# The encoder output does not change while decoding, so neither do the keys and values
# the decoder's cross-attention projects from it: `decode_step` takes them precomputed.
# Here is what one step would cost if it projected them again, counted by XLA's cost
# analysis of the two compiled steps. The difference is the two projections,
# 2 · S · d_model · 2 d_model floating-point operations per layer and row, paid again at
# every step: it grows with the source length S.

# %%
@jax.jit
def step_recomputing_cross_kv(variables, token, index, cache, encoded, src_valid):
  cross_kv = model.apply(variables, encoded, method=Transformer.precompute_cross_kv)
  return model.apply(variables, token, index, cache, cross_kv, src_valid,
                     method=Transformer.decode_step)

def flops(fn, *args):
  cost = fn.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older JAX: a list
  return float(cost.get("flops", float("nan")))

tok0 = jnp.array([[BOS]])
once = flops(step, variables, tok0, 3, cache, cross_kv, src != 0)
again = flops(step_recomputing_cross_kv, variables, tok0, 3, cache, encoded, src != 0)
S, D, layers = src.shape[1], cfg.model.d_model, cfg.model.num_decoder_layers
print(f"one decode step, source of {S} tokens, {layers} decoder layers:")
print(f"  cross k/v precomputed: {once / 1e6:6.3f} MFLOP")
print(f"  cross k/v recomputed : {again / 1e6:6.3f} MFLOP  ({again / once:.1f}x)")
print(f"  difference {(again - once) / 1e6:.3f} MFLOP; "
      f"2·S·D·2D·layers = {2 * S * D * 2 * D * layers / 1e6:.3f} MFLOP")

# %% [markdown]
# ## 3. Cached against uncached, as the output grows
#
# `decode` runs the whole loop in one jitted `lax.while_loop`. With
# `full_recompute=True` the same loop instead re-runs the teacher-forced decoder over the
# whole output buffer at every step (the benchmark's baseline, `bench/bench_decode.py`):
# per token, its work grows with the length, while the cached step's stays nearly flat.
# `min_len` forbids EOS so every row writes exactly *n* tokens. Speed does not depend on
# what the weights learned, and the sinusoidal position table is a formula, so we let
# this model write up to 256 tokens (nonsense beyond its training lengths). The first call
# of each shape compiles; we time the calls after it.

# %%
LENGTHS = (8, 32) if SMOKE else (16, 32, 64, 128, 256)
REPEATS = 1 if SMOKE else 3
BATCH = 8
long_cfg = cfg.model.replace(max_len=max(LENGTHS))       # positions are computed, not learned
batch_src = np.repeat(np.asarray(src), BATCH, axis=0)

def decode_seconds(n, full_recompute):
  run = lambda: decode(long_cfg, params, batch_src, Greedy(), bos_id=BOS, eos_id=EOS,
                       max_len=n, min_len=n, full_recompute=full_recompute)
  assert (run().lengths == n).all()                      # compile (and check), then time
  times = []
  for _ in range(REPEATS):
    t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
  return min(times)

timing = {mode: [decode_seconds(n, mode == "uncached") for n in LENGTHS]
          for mode in ("cached", "uncached")}
per_token = {mode: 1e3 * np.array(s) / np.array(LENGTHS) for mode, s in timing.items()}
print(f"{'tokens':>6} {'cached ms/token':>16} {'uncached ms/token':>18} {'speed-up':>9}")
for i, n in enumerate(LENGTHS):
  print(f"{n:6d} {per_token['cached'][i]:16.3f} {per_token['uncached'][i]:18.3f} "
        f"{per_token['uncached'][i] / per_token['cached'][i]:8.1f}x")

fig, axes = plt.subplots(1, 2, figsize=(13, 4))
for mode, style, label in (("cached", "o-", "cached (KV cache)"),
                           ("uncached", "s-", "uncached (full recompute)")):
  axes[0].plot(LENGTHS, per_token[mode], style, label=label)
axes[0].set(title=f"Decode time per token, batch {BATCH} (greedy)", xlabel="output length (tokens)",
            ylabel="ms per token (log scale)", yscale="log")
axes[0].legend()
axes[1].plot(LENGTHS, per_token["uncached"] / per_token["cached"], "o-", color="C2")
axes[1].set(title="Speed-up of the KV cache", xlabel="output length (tokens)",
            ylabel="uncached time / cached time")
for ax in axes:
  ax.set_xscale("log", base=2)
  ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
  ax.minorticks_off()
  ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 4. Beam search: n-best lists and their scores
#
# Beam search keeps the `size` best partial translations at every step instead of one.
# `Beam(size, alpha, n_best)` returns the `n_best` best finished hypotheses, ranked by
# log p(y|x) / lp(y) with the GNMT length penalty lp = ((5 + |y|) / 6)^α; the paper used a
# beam of 4 and α = 0.6. `translate_nbest` returns every hypothesis with its score.

# %%
from seq2seq.translate import translate_nbest

numbers = [17, 1_999, 80_081, 342_817] + ([] if SMOKE else [70_070, 999_999])
sentences = [num2words(n) for n in numbers]
nbest = translate_nbest(params, cfg.model, tokenizer, sentences, Beam(size=4, alpha=0.6, n_best=4))
for n, sentence, texts, scores in zip(numbers, sentences, nbest.texts, nbest.scores):
  ref = num2words(n, lang="fr")
  print(f"{sentence}   (reference: {ref})")
  for rank, (text, score) in enumerate(zip(texts, scores)):
    print(f"   {rank + 1}. {score:8.4f}  {'✓' if text == ref else ' '} {text}")

# %% [markdown]
# ## 5. The length penalty
#
# A log-probability only falls as a hypothesis grows, so ranking by log p alone (α = 0)
# favours short outputs; dividing by lp = ((5 + |y|) / 6)^α compensates, the more the
# larger α. Where the best hypothesis leads by nats, as on the numbers above, α changes
# nothing; on inputs the model never saw, hypotheses are close and α decides. Below, the
# 4-best list of a beam search with α = 0 (its scores are the plain log-probabilities) is
# re-ranked for α from 0 to 2. The lines of two hypotheses, of log-probabilities
# $\log p_1 > \log p_2$ and lengths $|y_1| < |y_2|$, cross at
#
# $$\alpha^* = \ln\frac{\log p_1}{\log p_2} \Big/ \ln\frac{5 + |y_1|}{5 + |y_2|}:$$
#
# below α* the shorter one ranks first, above it the longer. The cell picks the source
# whose winner changes closest to the paper's α = 0.6 and checks that the re-ranked winner
# changes exactly at α*.

# %%
from seq2seq.search import length_penalty
from seq2seq.translate import encode_sources

def pad_batch(rows):
  """Lists of token ids as one [len(rows), longest] array, right-padded with 0 (PAD)."""
  out = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for r, ids in enumerate(rows):
    out[r, :len(ids)] = ids
  return jnp.asarray(out)

odd = ["a hundred", "minus five", "forty-forty", "one million", "one thousand million",
       "three point five", "twelve hundred", "eleven hundred", "twenty twenty",
       "nineteen eighty-four"]
odd_src = pad_batch(encode_sources(tokenizer, odd, cfg.model.max_len)[0])
ALPHAS = (0.0, 0.6, 2.0)
runs = {a: decode(cfg.model, params, odd_src, Beam(size=4, alpha=a, n_best=4), bos_id=BOS,
                  eos_id=EOS) for a in ALPHAS}
raw = runs[0.0]                                    # α = 0: score = log p
grid = np.linspace(0, 2, 401)

def rescored(r):                                   # [len(grid), 4]: log p / lp(|y|, α)
  lp = np.asarray(length_penalty(raw.lengths[r][None], grid[:, None]))
  return np.where(raw.scores[r] > -np.inf, raw.scores[r] / lp, -np.inf)

def first_change(r):
  """(index into grid where the re-ranked winner first changes, old winner, new) or None."""
  winner = rescored(r).argmax(1)
  k = np.flatnonzero(winner != winner[0])
  return (k[0], winner[0], winner[k[0]]) if len(k) else None

changes = {r: c for r in range(len(odd)) if (c := first_change(r)) is not None}
assert changes, "no source's winner changes for α in [0, 2]"
r = min(changes, key=lambda r: abs(grid[changes[r][0]] - 0.6))
k, i, j = changes[r]
logp, n = raw.scores[r].astype(np.float64), raw.lengths[r]
alpha_star = np.log(logp[i] / logp[j]) / np.log((5 + n[i]) / (5 + n[j]))
assert grid[k - 1] - 1e-6 <= alpha_star <= grid[k] + 1e-6   # the lines cross where the winner changes
texts = [tokenizer.decode(raw.token_lists(EOS, h)[r]) or "(empty)" for h in range(4)]
print(f"{odd[r]!r}: at α = 0 {texts[i]!r} ({n[i]} tokens, log p {logp[i]:.2f}) ranks first; "
      f"its line crosses that of {texts[j]!r} ({n[j]} tokens, log p {logp[j]:.2f}) at "
      f"α* = {alpha_star:.2f}, where the re-ranked winner changes")

fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
lengths = np.arange(1, 41)
for a in (0.0, 0.6, 1.0, 2.0):
  axes[0].plot(lengths, length_penalty(lengths, a), label=f"α = {a}")
axes[0].set(title="GNMT length penalty lp = ((5 + |y|) / 6)^α", xlabel="hypothesis length |y|",
            ylabel="lp (score = log p / lp)")
axes[0].legend()
curves = rescored(r)
for h in np.flatnonzero(raw.scores[r] > -np.inf):
  axes[1].plot(grid, curves[:, h], label=f"{texts[h]} ({n[h]} tokens, log p {logp[h]:.2f})")
axes[1].plot(alpha_star, logp[i] / length_penalty(n[i], alpha_star), "ko")
axes[1].axvline(alpha_star, color="k", ls=":", label=f"α* = {alpha_star:.2f}: the winner changes")
axes[1].axvline(0.6, color="gray", ls="--", label="α = 0.6 (paper)")
axes[1].set(title=f"Re-ranking the 4-best list of {odd[r]!r}", xlabel="α",
            ylabel="score = log p / lp")
axes[1].legend(fontsize=8)
plt.tight_layout(); plt.show()

# %% [markdown]
# Re-ranking a finished list is not all the penalty does: during the search, it also
# decides which hypotheses stay in the beam. Beam search run with each α:

# %%
print(f"{'alpha':>5} {'mean length':>11}  best hypothesis per source")
for a, res in runs.items():
  best = [tokenizer.decode(t) for t in res.token_lists(EOS)]
  print(f"{a:5.1f} {res.lengths[:, 0].mean():11.1f}  " + " | ".join(
      b if len(b) <= 24 else b[:21] + "..." for b in best))
