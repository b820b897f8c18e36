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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/seq2seq/blob/main/colab/01_quickstart.ipynb)
#
# # seq2seq · 1. Quickstart: train, plot, translate, checkpoint
#
# The encoder-decoder Transformer of *Attention Is All You Need* (Vaswani et al., 2017),
# trained in a few minutes on the project's embedded task: English number phrases →
# French ("three hundred and forty-two" → "trois cent quarante-deux"). Everything below
# calls the project's own functions, exactly what `python train.py` and
# `python decode.py` run.
#
# **Runtime:** CPU is enough (about 3 minutes of training on 2 cores). A GPU or TPU runtime also works
# (*Runtime → Change runtime type*): JAX finds the devices by itself and the training
# step shards each batch over all of them.
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
# ## 1. The run and its data
#
# `get_experiment("numbers")` is the default run of `python train.py`: a small model
# (d_model 64, 4 heads, 2+2 layers) and the paper's recipe (Adam, warm-up then inverse
# square-root learning rate, label smoothing ε = 0.1), plus three changes that keep this
# short run stable, none of them the paper's: gradient clipping, Adam β2 = 0.99 (the
# paper: 0.98) and a learning-rate cooldown over the last 100 steps (section 3). We only
# move its data under `ROOT`.

# %%
from seq2seq.config import get_experiment, override

def recipe():
  """The run of `python train.py` (the "numbers" experiment), data under ROOT."""
  cfg = override(get_experiment("numbers"), [f"data.data_dir={ROOT / 'tensorflow_datasets'}"])
  if SMOKE:  # a few steps only: enough for the pictures, not for a good model
    cfg = override(cfg, ["train.steps=60", "train.log_every=10", "train.eval_every=1000",
                         "train.checkpoint_every=30", "train.cooldown_steps=20"])
  return cfg

def log_line(step, m):
  """train()'s `on_log`: a line every `log_every` steps, a notebook's progress report (the
  terminal's progress bar, tqdm, would leave hundreds of fragments in a cell's output)."""
  print(f"step {step:4d}: loss {m['loss']:.3f}, learning rate {m['learning_rate']:.2e}, "
        f"{m['tokens_per_sec']:,.0f} tokens/s", flush=True)

cfg = recipe()
print("model:", cfg.model)
print("data: ", {k: getattr(cfg.data, k) for k in ("dataset", "vocab_size", "max_src_len",
                                                    "max_tgt_len")})
print("train:", {k: getattr(cfg.train, k) for k in (
    "steps", "batch_size", "seq_len", "warmup_steps", "learning_rate_scale", "cooldown_steps",
    "label_smoothing", "clip_grad_norm", "adam_b2")})

# %% [markdown]
# `load_dataset` builds the embedded dataset (TFDS, generated offline with `num2words`,
# about 30 s the first time), trains a SentencePiece vocabulary on it and tokenizes the
# splits; everything is cached, so `train` below finds it ready. The validation and test
# numbers never occur in training.
#
# **Which vocabulary size?** Three appear, and the model uses only the last one.
# `model.vocab_size` above (32000, the default of `TransformerConfig`: the paper's base
# model) is a placeholder, because the vocabulary does not exist yet: `train` replaces it
# with the size of the vocabulary it loads, and saves that config in the workdir.
# `data.vocab_size` (8000) is the size asked of SentencePiece, lowered to 1024 for this
# task, and only an upper bound: with so few distinct words in number phrases,
# SentencePiece stops at a few hundred pieces: 4 special ones (PAD, BOS, EOS, UNK),
# 256 byte pieces (byte fallback, so any text can be encoded) and about a hundred pieces of
# words. That learned size is the model's: one embedding row (and one output logit) per
# piece.

# %%
from seq2seq.data import load_dataset
from seq2seq.data.dataset import NUMBERS_MAX_VOCAB

ds = load_dataset(cfg, str(WORKDIR))
tokenizer = ds.tokenizer
print({split: ds.num_examples(split) for split in ds.splits}, "pairs")
V = tokenizer.vocab_size
n_bytes = sum(tokenizer.id_to_piece(i).startswith("<0x") for i in range(V))
print(f"vocabulary: model.vocab_size {cfg.model.vocab_size} (placeholder); data.vocab_size "
      f"{cfg.data.vocab_size} asked, at most {NUMBERS_MAX_VOCAB} here; learned: {V} pieces = "
      f"4 special + {n_bytes} bytes + {V - 4 - n_bytes} word pieces -> the model's vocab_size")
print(f"special ids: PAD {tokenizer.pad_id}, BOS {tokenizer.bos_id}, EOS {tokenizer.eos_id}; "
      f"first word pieces: {[tokenizer.id_to_piece(i) for i in range(4 + n_bytes, 4 + n_bytes + 8)]}")
batch = next(ds.eval_batches("validation", 4))
for src, tgt in zip(batch["src_text"], batch["tgt_text"]):
  print(f"{src!r:72} -> {tgt!r}")
print("pieces:", [tokenizer.id_to_piece(i) for i in tokenizer.encode(batch["tgt_text"][0])])

# %% [markdown]
# Training batches are *packed*: several short pairs share a row of `seq_len` tokens, and
# segment ids (1, 2, … per pair, 0 for padding) keep them from attending to each other.

# %%
train_batch = next(ds.train_batches())
print({k: v.shape for k, v in train_batch.items()})
print("target segment ids of row 0:", train_batch["tgt_segments"][0])

# %% [markdown]
# ## 2. Train
#
# `train_lib.train(cfg, workdir)` is the whole of `python train.py`: it writes the config,
# the vocabulary, Orbax checkpoints, `metrics.jsonl` and TensorBoard events under the
# workdir, evaluates on the validation set as it goes, and on the validation and test
# sets at the end (BLEU, chrF, exact match). Run it again and it resumes from the last
# checkpoint. In a terminal it shows a progress bar; here `progress=False` turns the bar
# off and `on_log=log_line` (defined with `recipe` above) prints one line every
# `log_every` steps instead.

# %%
from seq2seq import train_lib

result = train_lib.train(cfg, str(WORKDIR), progress=False, on_log=log_line)
print(train_lib.summary(result))

# %% [markdown]
# ## 3. Loss, perplexity and learning rate
#
# The training loop logs to `<workdir>/metrics.jsonl`; `read_metrics` reads it back.
#
# **The loss as trained** is label-smoothed (ε = 0.1): the model is trained towards a
# target distribution q that puts 1 − ε = 0.9 on the reference token and spreads ε evenly
# over all the others. The logged `loss` is the cross-entropy to q *minus the entropy of
# q*, that is the KL divergence KL(q ‖ p): 0 exactly when the model's distribution p
# equals q. So it does go to 0; this run takes it to about 0.01 (left).
#
# **The NLL and the perplexity** measure something else: how much probability the model
# gives the reference tokens. Evaluation logs `nll` (their mean negative log-likelihood,
# −log p(reference), without smoothing) and `perplexity` = exp(nll) for the validation
# and test sets (middle). A model trained towards q settles near p(reference) = 0.9, so
# its NLL settles near −log 0.9 ≈ 0.105 nats and its perplexity near 1/0.9 ≈ 1.11 (the
# dashed line), even when every translation is right: that level is the price of label
# smoothing, which the paper found hurts perplexity but helps BLEU.
#
# **The learning rate** (right) follows the paper's schedule, a linear warm-up over
# `warmup_steps` then decay with 1/√step (dotted), with one change that is not the
# paper's: a linear cooldown to 0 over the last `cooldown_steps` (100 of 300). Without it
# this short run would end at 71% of its peak rate. Over 6 seeds (see the comment of
# `get_experiment` in `seq2seq/config.py`), a loss spike in the last steps then spoiled
# one seed's final model (97.5% of the test numbers right instead of 100%) and two others
# missed a round number or two; with the cooldown, all 6 got everything right.

# %%
from seq2seq import warmup_rsqrt_schedule
from seq2seq.metrics import read_metrics
from seq2seq.state import schedule

rows = read_metrics(WORKDIR)
train_rows = [r for r in rows if r["split"] == "train"]
val_rows = [r for r in rows if r["split"] == "validation"]
tc, eps = cfg.train, cfg.train.label_smoothing
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.2))
ax1.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train")
ax1.plot([r["step"] for r in val_rows], [r["loss"] for r in val_rows], "o", label="validation")
ax1.set(title=f"Loss as trained: KL(q ‖ p), label smoothing ε = {eps}", xlabel="step",
        ylabel="per target token (log scale)", yscale="log")
ax1.legend()
ax2.plot([r["step"] for r in val_rows], [r["perplexity"] for r in val_rows], "o-", color="C1",
         label="validation perplexity = exp(nll)")
ax2.axhline(1 / (1 - eps), color="gray", ls="--", label=f"1 / (1 − ε) = {1 / (1 - eps):.3f}")
ax2.set(title="Perplexity of the reference tokens (no smoothing)", xlabel="step",
        ylabel="perplexity")
ax2.legend()
steps = np.arange(1, tc.steps + 1)
paper = warmup_rsqrt_schedule(cfg.model.d_model, tc.warmup_steps, tc.learning_rate_scale)
ax3.plot(steps, paper(steps), ":", label="the paper's: warm-up, then 1/√step")
ax3.plot(steps, schedule(cfg)(steps), label="this run's: the same, then a cooldown")
ax3.plot([r["step"] for r in train_rows], [r["learning_rate"] for r in train_rows], "o", ms=4,
         label="logged by train()")
ax3.axvline(tc.warmup_steps, color="gray", ls="--", label=f"end of warm-up ({tc.warmup_steps})")
ax3.axvline(tc.steps - tc.cooldown_steps, color="gray", ls="-.",
            label=f"start of the cooldown (last {tc.cooldown_steps} steps)")
ax3.set(title="Learning rate", xlabel="step", ylabel="learning rate")
ax3.legend(fontsize=8)
plt.tight_layout(); plt.show()
for r in val_rows:
  print(f"validation @ {r['step']:4d}: loss {r['loss']:.4f}, nll {r['nll']:.4f}, perplexity "
        f"{r['perplexity']:.3f}; exact match {r['exact_match']:.3f}, BLEU {r['bleu']:.1f} "
        f"({int(r['examples'])} examples)")

# %% [markdown]
# ## 4. Translate
#
# `load_workdir` restores the config, the parameters and the vocabulary from the workdir
# alone (this is what `python decode.py --workdir ...` does). `translate` encodes the
# sentences, batches them and runs one jitted decoding loop with a KV cache: greedy
# search, or beam search of 4 with the paper's length penalty α = 0.6.

# %%
from num2words import num2words
from seq2seq.load import load_workdir
from seq2seq.search import Beam, Greedy
from seq2seq.translate import translate

cfg, params, tokenizer = load_workdir(WORKDIR)
print("the saved config's vocab_size:", cfg.model.vocab_size,
      "| embedding matrix:", params["embed"]["embedding"].shape)
numbers = [7, 42, 1_999, 80_081, 342_817, 999_999]
sentences = [num2words(n) for n in numbers]
greedy = translate(params, cfg.model, tokenizer, sentences, Greedy())
beam = translate(params, cfg.model, tokenizer, sentences, Beam(size=4, alpha=0.6))
for n, g, b in zip(numbers, greedy, beam):
  ref = num2words(n, lang="fr")
  mark = lambda hyp: "✓" if hyp == ref else "✗"
  print(f"{n:>7,}  {num2words(n)}\n   greedy {mark(g)} {g}\n   beam   {mark(b)} {b}")

# %% [markdown]
# ## 5. Save and restore a checkpoint
#
# `train` saved Orbax checkpoints (the whole `TrainState`: step, parameters and Adam's
# moments) every `checkpoint_every` steps, keeping the last few. Below we restore the
# newest one, save it into a second workdir with the same `Checkpoints` wrapper (with the
# config and the vocabulary, that is all a workdir needs; `Workdir` knows where each file
# lives), and restore from there: the parameters and translations are identical. (`python -m seq2seq.checkpoint average`
# writes such a workdir too, holding the mean of the last checkpoints, as the paper did.)

# %%
import shutil
from seq2seq import checkpoint as ckpt_lib
from seq2seq.workdir import Workdir

ckpts = ckpt_lib.Checkpoints(WORKDIR, read_only=True)
print("checkpoints in", ckpts.directory, "at steps", ckpts.steps())
state, meta = ckpts.restore(ckpt_lib.local_abstract_state(cfg))  # the newest readable one
print("restored step", int(state.step), "meta", meta)

copy_dir = ROOT / "quickstart_copy"
shutil.rmtree(copy_dir, ignore_errors=True)
copy = ckpt_lib.Checkpoints(copy_dir, keep=1)
copy.save(int(state.step), state, meta)
copy.close()                                     # waits for the asynchronous save
Workdir(copy_dir).write_config(cfg)
shutil.copy(Workdir(WORKDIR).vocab, Workdir(copy_dir).vocab)
print(sorted(p.name for p in copy_dir.iterdir()))

cfg2, params2, tokenizer2 = load_workdir(copy_dir)
same = jax.tree_util.tree_all(jax.tree_util.tree_map(
    lambda a, b: bool(np.array_equal(a, b)), params, params2))
again = translate(params2, cfg2.model, tokenizer2, sentences, Greedy())
print("parameters identical:", same, "| translations identical:", again == greedy)
assert same and again == greedy

# %% [markdown]
# ## Next
#
# * From a shell: `python train.py --workdir runs/default` trains the same model;
#   `python decode.py --workdir runs/default "four hundred and two"` translates;
#   `python train.py --help` lists every option (other datasets, presets up to the
#   paper's big model, `--config.KEY=VALUE` overrides).
# * **2. Anatomy of the Transformer** opens this model up, encoder to loss, in the
#   order the data flows.
# * **3. Fast decoding** measures the KV cache and looks at beam search.
