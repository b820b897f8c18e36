"""Writes the Colab notebooks of this folder from the cells below, without outputs.

    python colab/make_notebooks.py          # rewrite colab/*.ipynb
    python colab/make_notebooks.py --check  # exit 1 if a notebook differs from this file
    python colab/make_notebooks.py --repo https://github.com/you/seq2seq  # for a fork

The repository URL (the install cell's REPO_URL and the "Open in Colab" badges) has one
source of truth: `[project.urls] Repository` in pyproject.toml, still a placeholder.

The notebooks are generated so that they can be reviewed (and diffed) as Python. Edit the
cells here, run the script, and commit both. tests/test_notebooks.py checks that the
committed notebooks match this script and executes them top to bottom.

Every notebook opens with an "Open in Colab" badge, a one-cell install of the project and
the runtime it suits. Cells only call the library (`seq2seq`); they never copy it.
Environment variables (set by the test; a user needs none of them):
  SEQ2SEQ_NOTEBOOK_SMOKE=1      small setting: fewer training steps, shorter sweeps
  SEQ2SEQ_NOTEBOOK_WORKDIR=DIR  where runs and data go (default: runs/notebooks)
  SEQ2SEQ_SRC=DIR               install the project from this checkout
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parent / "pyproject.toml"
# The cells hold these markers; `build` puts the repository's URLs in their place.
REPO_MARK, COLAB_MARK = "@REPO_URL@", "@COLAB_URL@"
# While pyproject.toml's URL is the placeholder, the install cell refuses to pip-install it.
PLACEHOLDER_OWNER = "/your-org/"


def repository_url(pyproject: Path = PYPROJECT) -> str:
  """`[project.urls] Repository` of pyproject.toml."""
  text = pyproject.read_text(encoding="utf-8")
  try:
    import tomllib
  except ModuleNotFoundError:  # Python 3.10: read the one key by hand
    m = re.search(r'^\[project\.urls\][^\[]*?^Repository\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not m:
      raise SystemExit(f"{pyproject}: no [project.urls] Repository")
    return m.group(1)
  return tomllib.loads(text)["project"]["urls"]["Repository"]


def colab_url(repo_url: str) -> str:
  """Where Colab opens the notebooks of a GitHub repository's main branch."""
  m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(?:\.git)?/?", repo_url)
  if not m:
    raise SystemExit(f"{repo_url!r}: not a GitHub repository URL (https://github.com/OWNER/NAME), "
                     f"which Colab's badge needs")
  return f"https://colab.research.google.com/github/{m.group(1)}/blob/main/colab/"


def md(text: str):
  return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(*parts: str):
  """A code cell; each part is dedented on its own (shared snippets + the cell's own code)."""
  return nbformat.v4.new_code_cell("\n\n".join(textwrap.dedent(p).strip() for p in parts))


def header(name: str, title: str, intro: str, runtime: str) -> list:
  badge = (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
           f"({COLAB_MARK}{name}.ipynb)")
  return [
      md(f"{badge}\n\n# {title}\n\n{textwrap.dedent(intro).strip()}\n\n"
         f"**Runtime:** {textwrap.dedent(runtime).strip()}\n\n{textwrap.dedent(LOCAL).strip()}"),
      code(INSTALL),
      code(SETUP),
  ]


# --- cells shared by every notebook -----------------------------------------------------

LOCAL = """
**Run it locally:** in a checkout of the project, `pip install -e '.[notebooks]'` (the
project with JupyterLab), then `jupyter lab colab/`; the install cell below then has
nothing to do.
"""

INSTALL = '''
# Install the project (one cell). Nothing to do when `seq2seq` is already importable (a
# local run, or this runtime installed it already); otherwise pip installs it from a local
# checkout if there is one ($SEQ2SEQ_SRC, ./seq2seq, or a folder above this notebook
# holding pyproject.toml), else from REPO_URL, with the JAX of a GPU or TPU runtime.
REPO_URL = "@REPO_URL@"  # the project's repository (or your fork's)

import importlib, importlib.metadata, importlib.util, os, pathlib, shutil, subprocess, sys

class InstallStopped(Exception):
  """Stops "Run all" with a one-line message instead of a traceback."""
  def _render_traceback_(self):  # how IPython shows it
    return [f"{type(self).__name__}: {self}"]

def _local_checkout():
  here = pathlib.Path.cwd()
  for p in (os.environ.get("SEQ2SEQ_SRC"), here, here / "seq2seq", *here.parents):
    if p and (pathlib.Path(p) / "pyproject.toml").is_file() and (pathlib.Path(p) / "seq2seq").is_dir():
      return str(p)

def _installed_versions(names):
  versions = {}
  for name in names:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions

if importlib.util.find_spec("seq2seq") is None:
  source = _local_checkout()
  if source is None and "@PLACEHOLDER_OWNER@" in REPO_URL:  # no repository to install from
    raise InstallStopped(
        f"seq2seq is not installed and REPO_URL ({REPO_URL}) is a placeholder: set REPO_URL "
        f"above to your fork's URL, or upload the project's folder as ./seq2seq, then run this "
        f"cell again (locally: pip install -e '.[notebooks]' in the checkout).")
  packages = [source or f"git+{REPO_URL}"]
  if shutil.which("nvidia-smi"):                                   # GPU runtime
    packages.append("jax[cuda12]")
  elif os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"):  # TPU runtime
    packages.append("jax[tpu]")
  # Packages this runtime has imported already: if pip replaces one, Python keeps the old.
  imported = _installed_versions(m for m in ("jax", "jaxlib", "ml_dtypes", "numpy") if m in sys.modules)
  print("pip install", *packages, "...")
  pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages],
                       capture_output=True, text=True)
  if pip.returncode != 0:
    sys.stderr.write(pip.stdout + pip.stderr)
    raise InstallStopped(f"pip could not install {packages[0]} (exit code {pip.returncode}, "
                         f"its messages are above): fix REPO_URL or the network, then run this "
                         f"cell again.")
  importlib.invalidate_caches()
  replaced = [m for m, v in imported.items() if _installed_versions([m])[m] != v]
  if replaced:
    raise InstallStopped(f"pip replaced {', '.join(replaced)}, which this runtime had already "
                         f"imported: restart the runtime (Runtime → Restart session), then "
                         f"run all (this cell will find seq2seq installed).")
  print("installed seq2seq")
'''.replace("@PLACEHOLDER_OWNER@", PLACEHOLDER_OWNER)

SETUP = '''
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
'''

RECIPE = '''
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
'''

LOAD_MODEL = '''
from seq2seq import train_lib
from seq2seq.checkpoint import load_workdir
from seq2seq.errors import UserError
from seq2seq.model import Transformer

try:
  cfg, params, tokenizer = load_workdir(WORKDIR)  # the model notebook 1 trained
except UserError:                                 # none yet: train it here (a few minutes)
  print(train_lib.summary(train_lib.train(recipe(), str(WORKDIR), progress=False,
                                          on_log=log_line)))
  cfg, params, tokenizer = load_workdir(WORKDIR)
model = Transformer(cfg.model)
variables = {"params": params}
BOS, EOS = tokenizer.bos_id, tokenizer.eos_id
print(f"{seq2seq.count_params(params):,} parameters; d_model {cfg.model.d_model}, "
      f"{cfg.model.num_heads} heads, {cfg.model.num_encoder_layers}+{cfg.model.num_decoder_layers} "
      f"layers, vocabulary {tokenizer.vocab_size}")
'''

HEATMAP = '''
def pieces(ids):
  """SentencePiece pieces of token ids ("▁" starts a word)."""
  return [tokenizer.id_to_piece(int(i)) for i in ids]

def heatmap(ax, m, xlabels=None, ylabels=None, title="", xlabel="", ylabel="", cmap="viridis",
            colorbar=True, **kw):
  im = ax.imshow(np.asarray(m, np.float32), cmap=cmap, aspect="auto", **kw)
  if xlabels is not None:
    ax.set_xticks(range(len(xlabels)), xlabels, rotation=90, fontsize=8)
  if ylabels is not None:
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=8)
  ax.set_title(title); ax.set_xlabel(xlabel); ax.set_ylabel(ylabel)
  if colorbar:
    plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
  return im
'''


# --- 1. Quickstart ----------------------------------------------------------------------

QUICKSTART = header(
    "01_quickstart", "seq2seq · 1. Quickstart: train, plot, translate, checkpoint",
    """
    The encoder-decoder Transformer of *Attention Is All You Need* (Vaswani et al., 2017),
    trained in a few minutes on the project's embedded task: English number phrases →
    French ("three hundred and forty-two" → "trois cent quarante-deux"). Everything below
    calls the project's own functions, exactly what `python train.py` and
    `python decode.py` run.
    """,
    """
    CPU is enough (about 3 minutes of training on 2 cores). A GPU or TPU runtime also works
    (*Runtime → Change runtime type*): JAX finds the devices by itself and the training
    step shards each batch over all of them.
    """) + [
    md("""
    ## 1. The run and its data

    `get_experiment("numbers")` is the default run of `python train.py`: a small model
    (d_model 64, 4 heads, 2+2 layers) and the paper's recipe (Adam, warm-up then inverse
    square-root learning rate, label smoothing ε = 0.1), plus three changes that keep this
    short run stable, none of them the paper's: gradient clipping, Adam β2 = 0.99 (the
    paper: 0.98) and a learning-rate cooldown over the last 100 steps (section 3). We only
    move its data under `ROOT`.
    """),
    code(RECIPE, '''
    cfg = recipe()
    print("model:", cfg.model)
    print("data: ", {k: getattr(cfg.data, k) for k in ("dataset", "vocab_size", "max_src_len",
                                                        "max_tgt_len")})
    print("train:", {k: getattr(cfg.train, k) for k in (
        "steps", "batch_size", "seq_len", "warmup_steps", "learning_rate_scale", "cooldown_steps",
        "label_smoothing", "clip_grad_norm", "adam_b2")})
    '''),
    md("""
    `load_dataset` builds the embedded dataset (TFDS, generated offline with `num2words`,
    about 30 s the first time), trains a SentencePiece vocabulary on it and tokenizes the
    splits; everything is cached, so `train` below finds it ready. The validation and test
    numbers never occur in training.

    **Which vocabulary size?** Three appear, and the model uses only the last one.
    `model.vocab_size` above (32000, the default of `TransformerConfig`: the paper's base
    model) is a placeholder, because the vocabulary does not exist yet: `train` replaces it
    with the size of the vocabulary it loads, and saves that config in the workdir.
    `data.vocab_size` (8000) is the size asked of SentencePiece, lowered to 1024 for this
    task, and only an upper bound: with so few distinct words in number phrases,
    SentencePiece stops at a few hundred pieces: 4 special ones (PAD, BOS, EOS, UNK),
    256 byte pieces (byte fallback, so any text can be encoded) and about a hundred pieces of
    words. That learned size is the model's: one embedding row (and one output logit) per
    piece.
    """),
    code('''
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
    '''),
    md("""
    Training batches are *packed*: several short pairs share a row of `seq_len` tokens, and
    segment ids (1, 2, … per pair, 0 for padding) keep them from attending to each other.
    """),
    code('''
    train_batch = next(ds.train_batches())
    print({k: v.shape for k, v in train_batch.items()})
    print("target segment ids of row 0:", train_batch["tgt_segments"][0])
    '''),
    md("""
    ## 2. Train

    `train_lib.train(cfg, workdir)` is the whole of `python train.py`: it writes the config,
    the vocabulary, Orbax checkpoints, `metrics.jsonl` and TensorBoard events under the
    workdir, evaluates on the validation set as it goes, and on the validation and test
    sets at the end (BLEU, chrF, exact match). Run it again and it resumes from the last
    checkpoint. In a terminal it shows a progress bar; here `progress=False` turns the bar
    off and `on_log=log_line` (defined with `recipe` above) prints one line every
    `log_every` steps instead.
    """),
    code('''
    from seq2seq import train_lib

    result = train_lib.train(cfg, str(WORKDIR), progress=False, on_log=log_line)
    print(train_lib.summary(result))
    '''),
    md("""
    ## 3. Loss, perplexity and learning rate

    The training loop logs to `<workdir>/metrics.jsonl`; `read_metrics` reads it back.

    **The loss as trained** is label-smoothed (ε = 0.1): the model is trained towards a
    target distribution q that puts 1 − ε = 0.9 on the reference token and spreads ε evenly
    over all the others. The logged `loss` is the cross-entropy to q *minus the entropy of
    q*, that is the KL divergence KL(q ‖ p): 0 exactly when the model's distribution p
    equals q. So it does go to 0; this run takes it to about 0.01 (left).

    **The NLL and the perplexity** measure something else: how much probability the model
    gives the reference tokens. Evaluation logs `nll` (their mean negative log-likelihood,
    −log p(reference), without smoothing) and `perplexity` = exp(nll) for the validation
    and test sets (middle). A model trained towards q settles near p(reference) = 0.9, so
    its NLL settles near −log 0.9 ≈ 0.105 nats and its perplexity near 1/0.9 ≈ 1.11 (the
    dashed line), even when every translation is right: that level is the price of label
    smoothing, which the paper found hurts perplexity but helps BLEU.

    **The learning rate** (right) follows the paper's schedule, a linear warm-up over
    `warmup_steps` then decay with 1/√step (dotted), with one change that is not the
    paper's: a linear cooldown to 0 over the last `cooldown_steps` (100 of 300). Without it
    this short run would end at 71% of its peak rate. Over 6 seeds (see the comment of
    `get_experiment` in `seq2seq/config.py`), a loss spike in the last steps then spoiled
    one seed's final model (97.5% of the test numbers right instead of 100%) and two others
    missed a round number or two; with the cooldown, all 6 got everything right.
    """),
    code('''
    from seq2seq import warmup_rsqrt_schedule
    from seq2seq.metrics import read_metrics
    from seq2seq.train_lib import schedule

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
    '''),
    md("""
    ## 4. Translate

    `load_workdir` restores the config, the parameters and the vocabulary from the workdir
    alone (this is what `python decode.py --workdir ...` does). `translate` encodes the
    sentences, batches them and runs one jitted decoding loop with a KV cache: greedy
    search, or beam search of 4 with the paper's length penalty α = 0.6.
    """),
    code('''
    from num2words import num2words
    from seq2seq import decoding
    from seq2seq.checkpoint import load_workdir

    cfg, params, tokenizer = load_workdir(WORKDIR)
    print("the saved config's vocab_size:", cfg.model.vocab_size,
          "| embedding matrix:", params["embed"]["embedding"].shape)
    numbers = [7, 42, 1_999, 80_081, 342_817, 999_999]
    sentences = [num2words(n) for n in numbers]
    greedy = decoding.translate(params, cfg.model, tokenizer, sentences, decoding.Greedy())
    beam = decoding.translate(params, cfg.model, tokenizer, sentences, decoding.Beam(size=4, alpha=0.6))
    for n, g, b in zip(numbers, greedy, beam):
      ref = num2words(n, lang="fr")
      mark = lambda hyp: "✓" if hyp == ref else "✗"
      print(f"{n:>7,}  {num2words(n)}\\n   greedy {mark(g)} {g}\\n   beam   {mark(b)} {b}")
    '''),
    md("""
    ## 5. Save and restore a checkpoint

    `train` saved Orbax checkpoints (the whole `TrainState`: step, parameters and Adam's
    moments) every `checkpoint_every` steps, keeping the last few. Below we restore the
    newest one, save it into a second workdir with the same `Checkpoints` wrapper (with the
    config and the vocabulary, that is all a workdir needs), and restore from there: the
    parameters and translations are identical. (`python -m seq2seq.checkpoint average`
    writes such a workdir too, holding the mean of the last checkpoints, as the paper did.)
    """),
    code('''
    import shutil
    from seq2seq import checkpoint as ckpt_lib

    ckpts = ckpt_lib.Checkpoints(WORKDIR, read_only=True)
    print("checkpoints in", ckpts.directory, "at steps", ckpts.steps())
    state, meta = ckpts.restore(ckpt_lib.local_abstract_state(cfg))  # the newest readable one
    print("restored step", int(state.step), "meta", meta)

    copy_dir = ROOT / "quickstart_copy"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy = ckpt_lib.Checkpoints(copy_dir, keep=1)
    copy.save(int(state.step), state, meta)
    copy.close()                                     # waits for the asynchronous save
    ckpt_lib.write_config(copy_dir, cfg)
    shutil.copy(ckpt_lib.vocab_path(WORKDIR), ckpt_lib.vocab_path(copy_dir))
    print(sorted(p.name for p in copy_dir.iterdir()))

    cfg2, params2, tokenizer2 = load_workdir(copy_dir)
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(a, b)), params, params2))
    again = decoding.translate(params2, cfg2.model, tokenizer2, sentences, decoding.Greedy())
    print("parameters identical:", same, "| translations identical:", again == greedy)
    assert same and again == greedy
    '''),
    md("""
    ## Next

    * From a shell: `python train.py --workdir runs/default` trains the same model;
      `python decode.py --workdir runs/default "four hundred and two"` translates;
      `python train.py --help` lists every option (other datasets, presets up to the
      paper's big model, `--config.KEY=VALUE` overrides).
    * **2. Anatomy of the decoder** opens this model up, layer by layer.
    * **3. Fast decoding** measures the KV cache and looks at beam search.
    """),
]


# --- 2. Anatomy of the decoder ----------------------------------------------------------

ANATOMY = header(
    "02_anatomy", "seq2seq · 2. Anatomy of the decoder",
    """
    The paper's story, told on real tensors of a trained model with the project's own
    functions: teacher forcing, the causal mask, scaled dot-product attention step by step,
    multiple heads, cross-attention (and the word alignment it learns), the feed-forward
    network, Add & Norm, the tied output head, decoding choices, positions, and the
    learning-rate schedule. Each hand computation is checked against the library.
    """,
    """
    CPU (everything here is small); GPU and TPU work too. Run after notebook 1 in the same
    folder (locally), it uses the model notebook 1 trained. On Colab every notebook opens in
    a fresh runtime of its own, so this one first trains that model itself (about 3 minutes
    on CPU).
    """) + [
    md("""
    ## The trained model

    `recipe()` is notebook 1's run (the default of `python train.py`). `load_workdir`
    restores the model it trained (config, parameters, vocabulary) from its workdir; when
    there is none, as in a fresh Colab runtime, the cell trains it first (about 3 minutes on
    CPU, one line per 25 steps). `pieces` turns token ids into their SentencePiece pieces
    and `heatmap` draws a labelled matrix: the two helpers of the plots below.
    """),
    code(RECIPE, LOAD_MODEL, HEATMAP),
    md("""
    ## 1. Teacher forcing: the right-shifted target

    During training the decoder sees the whole target at once, shifted one position to the
    right behind BOS (`shift_right`), and must predict the target itself at every position:
    position *t* reads target tokens < *t* only. One forward pass gives all predictions.
    """),
    code('''
    from num2words import num2words
    from seq2seq.losses import cross_entropy, shift_right

    NUMBER = 342_817
    SRC, REF = num2words(NUMBER), num2words(NUMBER, lang="fr")
    src = jnp.array([tokenizer.encode(SRC) + [EOS]])        # [1, S]
    tgt = jnp.array([tokenizer.encode(REF) + [EOS]])        # [1, T]
    tgt_in = shift_right(tgt, BOS)                          # [1, T]: BOS + target[:-1]
    src_pieces, tgt_pieces, in_pieces = pieces(src[0]), pieces(tgt[0]), pieces(tgt_in[0])
    print(SRC, "->", REF)

    # One forward pass; `capture_intermediates` records what every module (and method)
    # returned, so the sections below can look inside without changing the model.
    logits, state = model.apply(variables, src, tgt_in, mutable=["intermediates"],
                                capture_intermediates=lambda module, method: True)
    inter = state["intermediates"]
    dec = inter["decoder"]
    pred = jnp.argmax(logits, -1)[0]
    loss_sum, n = cross_entropy(logits, tgt)
    print(f"\\n{'t':>2}  {'decoder input':14} {'target':14} {'predicted':14} p(target)")
    probs = jax.nn.softmax(logits[0], -1)
    for t in range(tgt.shape[1]):
      print(f"{t:2d}  {in_pieces[t]:14} {tgt_pieces[t]:14} {pieces([pred[t]])[0]:14} "
            f"{probs[t, tgt[0, t]]:.3f}")
    nll = float(loss_sum / n)
    kl_sum, _ = cross_entropy(logits, tgt, label_smoothing=cfg.train.label_smoothing)
    print(f"NLL, the cross-entropy of the targets (no smoothing): {nll:.4f} nats per token, "
          f"perplexity exp(NLL) = {np.exp(nll):.3f}")
    print(f"loss as trained, label-smoothed (ε = {cfg.train.label_smoothing}): "
          f"{float(kl_sum / n):.4f} per token")
    '''),
    md("""
    The probabilities of the right tokens stop near 0.9, and the two numbers at the bottom
    differ about tenfold. Both come from label smoothing (ε = 0.1). The model was trained
    towards a target q that puts 0.9 on the right token and spreads 0.1 over the rest of
    the vocabulary, so p(target) ≈ 0.9 is what it learned, not a failure: the NLL,
    −log p(target) averaged over the tokens, is about −log 0.9 ≈ 0.105 nats, a perplexity
    of about 1/0.9 ≈ 1.11. The loss it was trained on (notebook 1's training curve) is
    `cross_entropy(..., label_smoothing=ε)`: the cross-entropy to q minus the entropy of q,
    i.e. the KL divergence KL(q ‖ p), which is 0 when p = q and is near 0 here. Evaluation
    logs both for the validation and test sets: `loss` (the smoothed one) and `nll`, with
    `perplexity` = exp(nll).
    """),
    md("""
    ## 2. The causal mask, and padding

    What keeps position *t* from reading the answer: a boolean mask, True (black below)
    where query *q* may attend to key *k*, i.e. *k ≤ q*. In a batch, rows are padded with
    id 0 to a common length; here our row gets 3 pad tokens. `padding_mask(valid, valid)` is
    True only where the query *and* the key are real tokens: it removes the padding columns
    (no query reads a pad token) and the padding rows (a pad token reads nothing).
    `decoder_self_mask` is both masks together.

    Why the padding *rows* as well? A row of the mask decides only what its own query
    position reads, so it changes nothing for the real tokens. It leaves the pad positions
    attending to nothing (all-zero weights, never NaN: see `attention_weights`) rather than
    to real tokens, and whatever they output is ignored anyway: the loss gives padding
    targets weight 0. (In the decoder, trailing padding lies in every real token's future,
    so the causal mask alone already hides those columns from the real rows; hiding padding
    keys matters in the encoder and in cross-attention, which have no causal mask.)
    """),
    code('''
    from seq2seq.attention import causal_mask, padding_mask
    from seq2seq.model import decoder_self_mask

    T = tgt_in.shape[1]
    padded = jnp.pad(tgt_in, ((0, 0), (0, 3)))             # the same row with 3 pad tokens
    valid = padded != 0                                     # [1, T + 3]: real tokens
    both = decoder_self_mask(padded)
    assert np.array_equal(both, causal_mask(T + 3) & padding_mask(valid, valid))
    pad_pieces = pieces(padded[0])
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for ax, m, title in ((axes[0], causal_mask(T + 3), "causal_mask: key ≤ query"),
                         (axes[1], padding_mask(valid, valid), "padding_mask: real query, real key"),
                         (axes[2], both, "decoder_self_mask: both")):
      heatmap(ax, m[0, 0], pad_pieces, pad_pieces, title, "key (decoder input)",
              "query (decoder input)" if ax is axes[0] else "", cmap="Greys", colorbar=False)
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 3. Scaled dot-product attention, step by step

    The first decoder layer's masked self-attention, on this sentence. Its input *x* is the
    target embedding × √d_model plus the sinusoidal positions. For each head,

    $$\\mathrm{Attention}(Q,K,V)=\\mathrm{softmax}\\Big(\\frac{QK^\\top}{\\sqrt{d_k}}\\Big)V,
    \\qquad Q = xW^Q,\\; K = xW^K,\\; V = xW^V,$$

    then the heads are concatenated and projected by *W^O*. Below by hand, then the same
    with the library's `attention_weights`, `dot_product_attention` and `MultiHeadAttention`.
    """),
    code('''
    from seq2seq.attention import attention_weights, dot_product_attention
    from seq2seq.layers import Embed, MultiHeadAttention, add_positions

    mc = cfg.model
    x = add_positions(Embed(mc.vocab_size, mc.d_model).apply({"params": params["embed"]}, tgt_in),
                      mc.max_len)                                   # [1, T, D]
    assert np.allclose(x, dec["dropout"]["__call__"][0], atol=1e-5)  # what the decoder saw
    p = params["decoder"]["layers_0"]["self_attn"]
    print({k: {n: v.shape for n, v in w.items()} for k, w in p.items()})

    q = jnp.einsum("btd,dhk->bthk", x, p["query"]["kernel"]) + p["query"]["bias"]  # [1, T, H, Dk]
    k = jnp.einsum("btd,dhk->bthk", x, p["key"]["kernel"])    # (no key bias: softmax ignores it)
    v = jnp.einsum("btd,dhk->bthk", x, p["value"]["kernel"]) + p["value"]["bias"]
    d_k = q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d_k)     # 1. scores   [1, H, T, T]
    mask = causal_mask(T)
    masked = jnp.where(mask, scores, -jnp.inf)                      # 2. mask
    weights = jax.nn.softmax(masked, axis=-1)                       # 3. softmax over keys
    heads = jnp.einsum("bhqk,bkhd->bqhd", weights, v)               # 4. weighted sum of values
    out = jnp.einsum("bqhd,hdo->bqo", heads, p["out"]["kernel"]) + p["out"]["bias"]  # 5. W^O

    assert np.allclose(weights, attention_weights(q, k, mask), atol=1e-5)
    assert np.allclose(heads, dot_product_attention(q, k, v, mask), atol=1e-4)
    assert np.allclose(out, MultiHeadAttention(mc).apply({"params": p}, x, x, mask), atol=1e-4)
    assert np.allclose(out, dec["layers_0"]["self_attn"]["attend"][0], atol=1e-4)
    print("hand computation == attention_weights == dot_product_attention == MultiHeadAttention")

    h = 0
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    heatmap(axes[0], scores[0, h], in_pieces, in_pieces, f"1. scores QKᵀ/√{d_k} (head {h})",
            "key", "query", cmap="coolwarm")
    heatmap(axes[1], jnp.where(mask[0, 0], scores[0, h], np.nan), in_pieces, in_pieces,
            "2. masked (future keys removed)", "key", "query", cmap="coolwarm")
    heatmap(axes[2], weights[0, h], in_pieces, in_pieces, "3. softmax: attention weights",
            "key", "query", vmin=0, vmax=1)
    plt.tight_layout(); plt.show()
    '''),
    md("""
    Steps 4 and 5: each query's output is the weighted average of the value vectors, and
    the output projection maps the concatenated heads back to d_model.
    """),
    code('''
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    heatmap(axes[0], heads[0, :, h], None, in_pieces, f"4. weights · V (head {h}): [T, d_k]",
            "value dimension", "query", cmap="coolwarm")
    heatmap(axes[1], out[0], None, in_pieces, "5. concat(heads) · Wᴼ: [T, d_model]",
            "model dimension", "query", cmap="coolwarm")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 4. Multiple heads: split and concatenate

    A head is not a separate module: the query kernel is one d_model × d_model matrix
    viewed as [d_model, heads, d_k], so "splitting into heads" is a reshape of one matrix
    product. Each head attends on its own (its own weights below); concatenating the heads
    is the inverse reshape, and *W^O* is again one matrix.
    """),
    code('''
    H, D = mc.num_heads, mc.d_model
    q_flat = x @ p["query"]["kernel"].reshape(D, H * d_k) + p["query"]["bias"].reshape(H * d_k)
    assert np.allclose(q_flat.reshape(1, T, H, d_k), q, atol=1e-5)   # split = reshape
    concat = heads.reshape(1, T, H * d_k)                            # concatenate = reshape
    assert np.allclose(concat @ p["out"]["kernel"].reshape(H * d_k, D) + p["out"]["bias"], out, atol=1e-4)
    print(f"x {x.shape} · W^Q {D}x{H * d_k} -> {q_flat.shape} -> split {q.shape}; "
          f"heads {heads.shape} -> concat {concat.shape} · W^O -> {out.shape}")

    fig, axes = plt.subplots(1, H, figsize=(4.5 * H, 4))
    for i in range(H):
      heatmap(axes[i], weights[0, i], in_pieces, in_pieces if i == 0 else [], f"head {i}",
              "key", "query" if i == 0 else "", vmin=0, vmax=1, colorbar=i == H - 1)
    fig.suptitle("Decoder layer 0, masked self-attention: one pattern per head")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 5. Cross-attention: where the decoder looks in the source

    In the second sublayer the queries come from the decoder, the keys and values from the
    encoder output (projected once per source, `precompute_cross_kv`). The weights form a
    target × source matrix: a soft word alignment. We recompute them from the projections
    the forward pass recorded; in the upper layers, each French word looks at the English
    words it translates.
    """),
    code('''
    from seq2seq.model import cross_mask

    xmask = cross_mask(tgt_in, src)
    cross = []
    for layer in range(mc.num_decoder_layers):
      ca = dec[f"layers_{layer}"]["cross_attn"]
      q_c = ca["project_q"][0]                                  # queries [1, T, H, Dk]
      k_c, v_c = dec["cross_kv"][0][layer]                      # keys, values [1, H, S, Dk]
      w_c = attention_weights(q_c, k_c, xmask, kv_layout="BHKD")          # [1, H, T, S]
      y_c = jnp.einsum("bqhd,hdo->bqo",                                  # check: same output
                       dot_product_attention(q_c, k_c, v_c, xmask, kv_layout="BHKD"),
                       params["decoder"][f"layers_{layer}"]["cross_attn"]["out"]["kernel"])
      assert np.allclose(y_c + params["decoder"][f"layers_{layer}"]["cross_attn"]["out"]["bias"],
                         ca["attend"][0], atol=1e-4)
      cross.append(w_c[0])

    last = mc.num_decoder_layers - 1
    fig, ax = plt.subplots(figsize=(9, 7))
    heatmap(ax, cross[last].mean(0), src_pieces, tgt_pieces,
            f"Cross-attention, decoder layer {last}, mean of {H} heads",
            "source (English)", "target being predicted (French)", vmin=0)
    plt.tight_layout(); plt.show()

    fig, axes = plt.subplots(mc.num_decoder_layers, H, figsize=(4 * H, 3.6 * mc.num_decoder_layers))
    for layer in range(mc.num_decoder_layers):
      for i in range(H):
        heatmap(axes[layer, i], cross[layer][i], src_pieces if layer == last else [],
                tgt_pieces if i == 0 else [], f"layer {layer}, head {i}", "", "",
                vmin=0, vmax=1, colorbar=False)
    fig.suptitle("Cross-attention of every layer and head (rows: target, columns: source)")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 6. The position-wise feed-forward network

    $\\mathrm{FFN}(x) = \\max(0, xW_1 + b_1)W_2 + b_2$, applied to every position alone,
    widening d_model to d_ff in between. After the ReLU many hidden units are exactly 0.
    """),
    code('''
    from seq2seq.layers import FeedForward

    pf = params["decoder"]["layers_0"]["ffn"]
    f_in = dec["layers_0"]["cross_attn_norm"]["__call__"][0]      # the FFN's input  [1, T, D]
    hidden = jax.nn.relu(f_in @ pf["wi"]["kernel"] + pf["wi"]["bias"])   # [1, T, d_ff]
    f_out = hidden @ pf["wo"]["kernel"] + pf["wo"]["bias"]               # [1, T, D]
    assert np.allclose(f_out, FeedForward(mc).apply({"params": pf}, f_in), atol=1e-4)
    print(f"{f_in.shape} -> hidden {hidden.shape} -> {f_out.shape}; "
          f"{float((hidden == 0).mean()):.0%} of hidden units are 0 after the ReLU")
    fig, ax = plt.subplots(figsize=(14, 4))
    heatmap(ax, hidden[0], None, in_pieces, f"FFN hidden activations, decoder layer 0 (d_ff = {mc.d_ff})",
            "hidden unit", "position (decoder input)", cmap="magma")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 7. Add & Norm

    Every sublayer is wrapped as LayerNorm(x + Sublayer(x)) (the paper's post-LN; dropout
    is off at inference). LayerNorm brings each position back to mean 0 and variance 1,
    then applies a learned scale and bias.
    """),
    code('''
    from seq2seq.layers import AddNorm

    pn = params["decoder"]["layers_0"]["ffn_norm"]["norm"]
    r = f_in + f_out                                          # the residual connection
    mu, var = r.mean(-1, keepdims=True), r.var(-1, keepdims=True)
    normed = (r - mu) / jnp.sqrt(var + 1e-6)
    y = normed * pn["scale"] + pn["bias"]
    ffn = FeedForward(mc)                                     # the sublayer, as a function
    lib = AddNorm(mc).apply({"params": params["decoder"]["layers_0"]["ffn_norm"]}, f_in,
                            lambda z: ffn.apply({"params": pf}, z))
    assert np.allclose(y, lib, atol=1e-4)
    assert np.allclose(y, dec["layers_0"]["__call__"][0][0], atol=1e-4)  # = the layer's output
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.5))
    pos = np.arange(T)
    axes[0].bar(pos - 0.2, r[0].mean(-1), 0.4, label="x + FFN(x)")
    axes[0].bar(pos + 0.2, normed[0].mean(-1), 0.4, label="after normalisation")
    axes[0].set(title="Mean over d_model, per position", xlabel="position", ylabel="mean")
    axes[1].bar(pos - 0.2, r[0].std(-1), 0.4, label="x + FFN(x)")
    axes[1].bar(pos + 0.2, normed[0].std(-1), 0.4, label="after normalisation")
    axes[1].set(title="Standard deviation over d_model, per position", xlabel="position",
                ylabel="std")
    for a in axes:
      a.set_xticks(pos, in_pieces, rotation=90, fontsize=8); a.legend()
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 8. The output head: weight tying and softmax

    The last decoder states are turned into one score per vocabulary entry. With
    `tie_output` (the paper's choice) there is no separate output matrix: the logits are the
    states times the transposed *embedding* matrix (the one the inputs were looked up in,
    there multiplied by √d_model). A softmax turns the logits into next-token probabilities.
    """),
    code('''
    final = dec["__call__"][0][0]                            # decoder output [1, T, D]
    E = params["embed"]["embedding"]                         # [V, D], shared by src, tgt and output
    manual_logits = final @ E.T                              # [1, T, V]
    assert np.allclose(manual_logits, logits, atol=1e-3)
    print("tie_output:", mc.tie_output, "| top-level parameters:", list(params),
          "(no separate output projection)")
    print(f"states {final.shape} · Eᵀ {E.T.shape} -> logits {manual_logits.shape}")

    t = 0
    p_t = jax.nn.softmax(logits[0, t])
    top = np.argsort(-np.asarray(p_t))[:10]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.bar(range(10), p_t[top], color=["C3" if i == tgt[0, t] else "C0" for i in top])
    ax.set_xticks(range(10), pieces(top), rotation=45)
    ax.set(title=f"p(next token) at position {t} (input {in_pieces[t]!r}; red: the reference)",
           xlabel="token", ylabel="probability")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 9. Greedy, temperature, top-k, top-p on one distribution

    How the decoding strategies choose from one next-token distribution. On real numbers
    this model is sure of itself (≈ 0.9 on one token: label smoothing keeps the rest
    spread thin over the vocabulary), so we ask it things it never saw and take the step
    where the runner-up comes closest to the best token. `decode(..., return_logits=True)`
    returns the logits of every step. Greedy takes the argmax; sampling draws from
    softmax(logits / temperature), optionally kept to the *k* most likely tokens (top-k)
    or to the smallest set holding probability *p* (top-p, nucleus). The filtered
    distributions come from `decoding.filter_logits`, the function the sampler uses. Each
    panel shows the 12 most likely tokens and, in gray, all the other tokens of the
    vocabulary together.
    """),
    code('''
    from seq2seq import decoding

    odd = ["forty-forty", "one million", "a hundred", "one thousand million", "three point five",
           "nineteen eighty-four", "twelve hundred", "minus five"]
    ids, _ = decoding.encode_sources(tokenizer, odd, mc.max_len)
    odd_src = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, s in enumerate(ids):
      odd_src[r, :len(s)] = s
    res = decoding.decode(cfg.model, params, odd_src, decoding.Greedy(), bos_id=BOS, eos_id=EOS,
                          return_logits=True)
    p_all = np.asarray(jax.nn.softmax(res.logits, -1))                 # [B, L, V]
    runner_up = -np.sort(-p_all, -1)[..., 1]                           # [B, L]
    runner_up[np.arange(p_all.shape[1])[None] >= res.lengths[:, :1]] = 0  # after the end
    b, t = np.unravel_index(np.argmax(runner_up), runner_up.shape)
    row = jnp.asarray(res.logits[b, t])[None]                          # [1, V]
    prefix = pieces(res.tokens[b, 0, :t])
    print(f"{odd[b]!r} -> {tokenizer.decode(res.token_lists(EOS)[b])!r}; step {t}, after {prefix}")

    V = row.shape[-1]
    shown = np.argsort(-np.asarray(row[0]))[:12]                       # the 12 most likely tokens
    cases = [("greedy (argmax)", None), ("temperature 0.5", decoding.Sample(temperature=0.5)),
             ("temperature 1 (the model)", decoding.Sample()),
             ("temperature 2", decoding.Sample(temperature=2.0)),
             ("top-k, k = 3", decoding.Sample(top_k=3)), ("top-p, p = 0.6", decoding.Sample(top_p=0.6))]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharey=True)
    for ax, (name, strategy) in zip(axes.flat, cases):
      if strategy is None:
        dist = np.asarray(jax.nn.one_hot(jnp.argmax(row[0]), V))
      else:
        filtered = decoding.filter_logits(row, strategy)[0]
        dist = np.asarray(jax.nn.softmax(filtered))
      kept = int((dist > 0).sum()) if strategy is None else int(jnp.isfinite(filtered).sum())
      rest = max(float(1 - dist[shown].sum()), 0.0)                     # the other V - 12 tokens
      ax.bar(range(12), dist[shown], color="C0")
      ax.bar([12], [rest], color="gray")
      ax.set_xticks(range(13), pieces(shown) + [f"other {V - 12}"], rotation=60, fontsize=8)
      ax.set(title=f"{name}\\n{kept} of {V} tokens can be drawn, {rest:.0%} on the others",
             xlabel="token", ylabel="probability of being chosen")
    fig.suptitle(f"Source {odd[b]!r}, step {t}: the next-token distribution, six ways")
    plt.tight_layout(); plt.show()

    # top-k keeps k tokens at every step; top-p as many as it takes to reach p
    steps = res.logits[b, :int(res.lengths[b, 0])]                     # this output's steps
    for name, strategy in cases[4:]:
      sizes = jnp.isfinite(decoding.filter_logits(jnp.asarray(steps), strategy)).sum(-1)
      print(f"{name}: tokens kept at each step of the output: {np.asarray(sizes).tolist()}")
    '''),
    md("""
    Plain sampling at temperature 1 draws from the model's whole distribution, tail
    included: the gray bar is the chance of drawing one of the many tokens that are not in
    the picture at all, most of them nonsense here (bytes, English pieces). Temperature 0.5
    sharpens the distribution towards greedy; temperature 2 flattens it, so the tail gets
    more. Top-k and top-p cut the tail off (nothing gray) and share the probability among
    the tokens they keep, which therefore grow. At a step like this one, with two
    candidates clearly ahead, they keep almost the same: top-p the two, top-k also a third
    that had next to no probability. They differ elsewhere, as printed: top-k keeps k
    tokens at every step, top-p as many as it takes to reach p, just one where the model
    is sure.

    Sampling whole translations: `decoding.decode` runs a strategy over a batch (here four
    copies of that source, so each row draws its own translation; the score is the
    log-probability of the output under the model). Greedy gave the one printed above.
    """),
    code('''
    batch_src = jnp.repeat(jnp.asarray(odd_src[b:b + 1]), 4, axis=0)
    strategy = decoding.Sample(temperature=1.5, top_k=5)
    res = decoding.decode(cfg.model, params, batch_src, strategy, bos_id=BOS, eos_id=EOS, rng=0)
    print(strategy)
    for ids, score in zip(res.token_lists(EOS), res.scores[:, 0]):
      print(f"   {score:8.3f}  {tokenizer.decode(ids)}")
    '''),
    md("""
    ## 10. Sinusoidal positions

    Attention itself ignores order, so each position gets a fixed vector added to its
    embedding: $PE_{(pos,2i)} = \\sin(pos/10000^{2i/d})$, $PE_{(pos,2i+1)} = \\cos(\\cdot)$.
    Low dimensions oscillate fast, high ones slowly; the dot product of two positions
    depends mainly on their distance.
    """),
    code('''
    from seq2seq.layers import sinusoidal_positions

    pe = sinusoidal_positions(mc.max_len, mc.d_model)        # [max_len, d_model]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    heatmap(axes[0], pe, None, None, f"sinusoidal_positions({mc.max_len}, {mc.d_model})",
            "dimension", "position", cmap="RdBu")
    for i in (0, 6, 12, 20):
      axes[1].plot(pe[:, i], label=f"dimension {i}")
    axes[1].set(title="A few dimensions along the positions", xlabel="position", ylabel="value")
    axes[1].legend(fontsize=8)
    heatmap(axes[2], pe @ pe.T, None, None, "PE · PEᵀ: similarity of two positions",
            "position", "position", cmap="viridis")
    plt.tight_layout(); plt.show()
    '''),
    md("""
    ## 11. The learning-rate schedule

    $lr = scale \\cdot d_{model}^{-0.5} \\cdot \\min(step^{-0.5},\\ step \\cdot warmup^{-1.5})$:
    a linear warm-up, then decay with the inverse square root of the step. Left: the paper's
    base model. Right: this notebook's run, with the rates the training loop logged on top.
    The run adds what the paper does not have: a linear cooldown over its last
    `cooldown_steps` (100 of 300), which lands it at a low rate instead of 71% of the peak;
    without it, late loss spikes spoiled some seeds' final model.
    """),
    code('''
    from seq2seq import warmup_rsqrt_schedule
    from seq2seq.metrics import read_metrics
    from seq2seq.train_lib import schedule

    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    steps = np.arange(1, 100_001)
    axes[0].plot(steps, warmup_rsqrt_schedule(512, 4000)(steps))
    axes[0].axvline(4000, color="gray", ls="--", label="warmup_steps = 4000")
    axes[0].set(title="Paper, base model: d_model 512, warm-up 4000", xlabel="step",
                ylabel="learning rate")
    axes[0].legend()
    t_cfg = cfg.train
    steps = np.arange(1, t_cfg.steps + 1)
    paper = warmup_rsqrt_schedule(mc.d_model, t_cfg.warmup_steps, t_cfg.learning_rate_scale)
    axes[1].plot(steps, paper(steps), ls=":", label="warm-up + rsqrt only (the paper's)")
    axes[1].plot(steps, schedule(cfg)(steps), label="train_lib.schedule(cfg), with the cooldown")
    logged = [r for r in read_metrics(WORKDIR) if r["split"] == "train"]
    axes[1].plot([r["step"] for r in logged], [r["learning_rate"] for r in logged], "o",
                 ms=4, label="logged by train()")
    axes[1].axvline(t_cfg.warmup_steps, color="gray", ls="--",
                    label=f"warmup_steps = {t_cfg.warmup_steps}")
    axes[1].set(title=f"This run: d_model {mc.d_model}, scale {t_cfg.learning_rate_scale}",
                xlabel="step", ylabel="learning rate")
    axes[1].legend()
    plt.tight_layout(); plt.show()
    '''),
]


# --- 3. Fast decoding -------------------------------------------------------------------

FAST = header(
    "03_fast_decoding", "seq2seq · 3. Fast decoding: the KV cache and beam search",
    """
    A decoder generates one token at a time, and each new token attends to every earlier
    one. Recomputing the keys and values of the whole prefix at every step makes the work
    per token grow with the output; caching them makes it (nearly) constant. This notebook
    walks through the cache, times cached against uncached decoding as the output grows,
    shows that the cross-attention keys and values are computed once per source, and looks
    at beam search's n-best lists and its length penalty.
    """,
    """
    CPU (the timings below are CPU timings; on a GPU or TPU runtime the same code runs there
    and the gap is similar in kind). Run after notebook 1 in the same folder (locally), it
    uses the model notebook 1 trained. On Colab every notebook opens in a fresh runtime of
    its own, so this one first trains that model itself (about 3 minutes on CPU).
    """) + [
    md("""
    ## The trained model

    `recipe()` is notebook 1's run (the default of `python train.py`). `load_workdir`
    restores the model it trained (config, parameters, vocabulary) from its workdir; when
    there is none, as in a fresh Colab runtime, the cell trains it first (about 3 minutes on
    CPU, one line per 25 steps). `Transformer(cfg.model)` is the Flax module; its methods
    (`encode`, `decode_step`, ...) are applied to these parameters below.
    """),
    code(RECIPE, LOAD_MODEL),
    md("""
    ## 1. The cache, by hand

    `init_cache` allocates, for every decoder layer, keys and values of shape
    [batch, heads, max_len, d_k] (head-major: a step reads it without a transpose).
    `Transformer.decode_step` feeds one token at position
    `index`, writes its keys/values into the cache there, attends over the slots ≤ index,
    and returns the logits and the new cache. The encoder runs once, and so do the
    cross-attention projections of its output (`precompute_cross_kv`).
    """),
    code('''
    import time

    from num2words import num2words
    from seq2seq import decoding, init_cache
    from seq2seq.losses import shift_right

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
    print(f"\\n{SRC} -> {tokenizer.decode(out)}  ({len(out)} steps)")
    written = np.asarray(jnp.abs(cache[0]["k"][0]).sum((0, -1)) > 0)         # over heads, d_k
    print("cache slots written (layer 0):", int(written.sum()), "of", L)

    # The same logits as the teacher-forced decoder on the finished output, all at once:
    full = model.apply(variables, encoded, src, shift_right(jnp.array([out]), BOS),
                       method=Transformer.decode)
    print("max |cached - teacher-forced| logit difference:",
          float(jnp.abs(jnp.stack(step_logits) - full[0]).max()))
    lib = decoding.decode(cfg.model, params, src, decoding.Greedy(), bos_id=BOS, eos_id=EOS)
    assert lib.token_lists(EOS)[0] == (out[:-1] if out[-1] == EOS else out)
    print("decoding.decode(Greedy()) gives the same tokens")
    '''),
    md("""
    ## 2. Cross-attention keys and values: computed once

    The encoder output does not change while decoding, so neither do the keys and values
    the decoder's cross-attention projects from it: `decode_step` takes them precomputed.
    Here is what one step would cost if it projected them again, counted by XLA's cost
    analysis of the two compiled steps. The difference is the two projections,
    2 · S · d_model · 2 d_model floating-point operations per layer and row, paid again at
    every step: it grows with the source length S.
    """),
    code('''
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
    '''),
    md("""
    ## 3. Cached against uncached, as the output grows

    `decoding.decode` runs the whole loop in one jitted `lax.while_loop`. With
    `full_recompute=True` the same loop instead re-runs the teacher-forced decoder over the
    whole output buffer at every step (the benchmark's baseline, `bench/bench_decode.py`):
    per token, its work grows with the length, while the cached step's stays nearly flat.
    `min_len` forbids EOS so every row writes exactly *n* tokens. Speed does not depend on
    what the weights learned, and the sinusoidal position table is a formula, so we let
    this model write up to 256 tokens (nonsense beyond its training lengths). The first call
    of each shape compiles; we time the calls after it.
    """),
    code('''
    LENGTHS = (8, 32) if SMOKE else (16, 32, 64, 128, 256)
    REPEATS = 1 if SMOKE else 3
    BATCH = 8
    long_cfg = cfg.model.replace(max_len=max(LENGTHS))       # positions are computed, not learned
    batch_src = np.repeat(np.asarray(src), BATCH, axis=0)

    def decode_seconds(n, full_recompute):
      run = lambda: decoding.decode(long_cfg, params, batch_src, decoding.Greedy(), bos_id=BOS,
                                    eos_id=EOS, max_len=n, min_len=n, full_recompute=full_recompute)
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
    '''),
    md("""
    ## 4. Beam search: n-best lists and their scores

    Beam search keeps the `size` best partial translations at every step instead of one.
    `Beam(size, alpha, n_best)` returns the `n_best` best finished hypotheses, ranked by
    log p(y|x) / lp(y) with the GNMT length penalty lp = ((5 + |y|) / 6)^α; the paper used a
    beam of 4 and α = 0.6. `translate_nbest` returns every hypothesis with its score.
    """),
    code('''
    numbers = [17, 1_999, 80_081, 342_817] + ([] if SMOKE else [70_070, 999_999])
    sentences = [num2words(n) for n in numbers]
    nbest = decoding.translate_nbest(params, cfg.model, tokenizer, sentences,
                                     decoding.Beam(size=4, alpha=0.6, n_best=4))
    for n, sentence, texts, scores in zip(numbers, sentences, nbest.texts, nbest.scores):
      ref = num2words(n, lang="fr")
      print(f"{sentence}   (reference: {ref})")
      for rank, (text, score) in enumerate(zip(texts, scores)):
        print(f"   {rank + 1}. {score:8.4f}  {'✓' if text == ref else ' '} {text}")
    '''),
    md("""
    ## 5. The length penalty

    A log-probability only falls as a hypothesis grows, so ranking by log p alone (α = 0)
    favours short outputs; dividing by lp(|y|) compensates, and the larger α, the more it
    rewards length. On real numbers this model is so sure that the winner is the same for
    any α (the gaps above are several nats). On inputs it never saw, the hypotheses are
    close and α decides. Left: the penalty. Right: the n-best list of a beam search with
    α = 0 (whose scores are the raw log-probabilities) re-ranked for α from 0 to 2; where
    the lines cross, the winner changes. Below: beam search run with several α, since the
    penalty also steers which hypotheses survive the search.
    """),
    code('''
    from seq2seq.decoding import encode_sources, length_penalty

    odd = ["a hundred", "forty-forty", "one million", "one thousand million", "three point five",
           "minus five"]
    ids, _ = encode_sources(tokenizer, odd, cfg.model.max_len)
    odd_src = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, s in enumerate(ids):
      odd_src[r, :len(s)] = s
    ALPHAS = (0.0, 0.6, 2.0)
    runs = {a: decoding.decode(cfg.model, params, odd_src, decoding.Beam(size=4, alpha=a, n_best=4),
                               bos_id=BOS, eos_id=EOS) for a in ALPHAS}
    raw = runs[0.0]                                    # α = 0: score = log p
    grid = np.linspace(0, 2, 81)

    def rescored(r):                                   # [len(grid), n_best]
      lp = np.asarray(length_penalty(raw.lengths[r][None], grid[:, None]))
      return np.where(raw.scores[r] > -np.inf, raw.scores[r] / lp, -np.inf)

    # the source whose winner changes most often with α (then: widest spread of lengths)
    r = max(range(len(odd)), key=lambda r: (len(set(rescored(r).argmax(1))), np.ptp(raw.lengths[r])))
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    lengths = np.arange(1, 41)
    for a in (0.0, 0.6, 1.0, 2.0):
      axes[0].plot(lengths, length_penalty(lengths, a), label=f"α = {a}")
    axes[0].set(title="GNMT length penalty lp = ((5 + |y|) / 6)^α", xlabel="hypothesis length |y|",
                ylabel="lp (score = log p / lp)")
    axes[0].legend()
    curves = rescored(r)
    for j in np.flatnonzero(raw.scores[r] > -np.inf):
      text = tokenizer.decode(raw.token_lists(EOS, j)[r]) or "(empty)"
      axes[1].plot(grid, curves[:, j],
                   label=f"{text} ({raw.lengths[r, j]} tokens, log p {raw.scores[r, j]:.2f})")
    axes[1].axvline(0.6, color="gray", ls="--", label="α = 0.6 (paper)")
    axes[1].set(title=f"Re-ranking the 4-best list of {odd[r]!r}", xlabel="α",
                ylabel="score = log p / lp")
    axes[1].legend(fontsize=8)
    plt.tight_layout(); plt.show()

    print(f"{'alpha':>5} {'mean length':>11}  best hypothesis per source")
    for a, res in runs.items():
      best = [tokenizer.decode(t) for t in res.token_lists(EOS)]
      print(f"{a:5.1f} {res.lengths[:, 0].mean():11.1f}  " + " | ".join(
          b if len(b) <= 30 else b[:27] + "..." for b in best))
    '''),
]


NOTEBOOKS = {"01_quickstart": QUICKSTART, "02_anatomy": ANATOMY, "03_fast_decoding": FAST}


def build(cells: list, repo_url: str) -> nbformat.NotebookNode:
  colab = colab_url(repo_url)
  cells = [dict(c, source=c.source.replace(REPO_MARK, repo_url).replace(COLAB_MARK, colab))
           for c in cells]
  nb = nbformat.v4.new_notebook(cells=[nbformat.from_dict(c) for c in cells])
  nb.metadata = {
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
      "colab": {"provenance": [], "toc_visible": True},
  }
  for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives the same file
    cell["id"] = f"cell-{i:02d}"
  return nb


def _content(nb) -> list:
  """What a notebook says (cell types and sources), whatever nbformat version wrote it."""
  return [(c.cell_type, c.source) for c in nb.cells]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="compare instead of writing")
  ap.add_argument("--repo", metavar="URL", default=None,
                  help="the repository the notebooks install from and open in Colab (a fork's, "
                       "https://github.com/OWNER/NAME); default: [project.urls] Repository of "
                       "pyproject.toml")
  args = ap.parse_args(argv)
  repo_url = (args.repo or repository_url()).rstrip("/")
  stale = []
  for name, cells in NOTEBOOKS.items():
    path = HERE / f"{name}.ipynb"
    nb = build(cells, repo_url)
    if args.check:
      if not path.exists() or _content(nbformat.read(path, as_version=4)) != _content(nb):
        stale.append(path.name)
    else:
      nbformat.write(nb, path)
      print("wrote", path)
  if stale:
    print("out of date (run python colab/make_notebooks.py):", ", ".join(stale), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
