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
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/your-org/seq2seq/blob/main/colab/02_anatomy.ipynb)
#
# # seq2seq · 2. Anatomy of the Transformer: encoder, decoder, loss, decoding
#
# The trained model of notebook 1, opened up in the order the data flows through it
# (section 3 of *Attention Is All You Need*): a batch of two source sentences →
# embeddings and positional encoding → the encoder (self-attention with a padding mask,
# multi-head attention, Add & Norm, the feed-forward network) → the decoder (the shifted
# target, the causal mask, cross-attention to the encoder output) → the tied output
# head → the label-smoothed loss → how a decoder picks the next token. Every hand
# computation is checked against the library with an `assert`. The model runs its
# reference kernels (`kernels="reference"`): plain JAX, the paper's formulas as written.
#
# **Runtime:** CPU (everything here is small); GPU and TPU work too. Run after notebook 1
# in the same folder (locally), it uses the model notebook 1 trained. On Colab every
# notebook opens in a fresh runtime of its own, so this one first trains that model itself
# (about 3 minutes on CPU).
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
# CPU). `pieces` turns token ids into their SentencePiece pieces ("▁" starts a word) and
# `heatmap` draws a labelled matrix: the two helpers of the plots below.

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
# Plain JAX, as the paper writes it, one module per layer: training traced each stack's
# layer once and kept its parameters stacked (`scan_layers`); `unroll_layers` gives each
# layer its own, to look at one at a time.
mc = cfg.model.replace(kernels="reference", scan_layers=False)
params = unroll_layers(params)
model = Transformer(mc)
variables = {"params": params}
BOS, EOS, V = tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size
print(f"{seq2seq.count_params(params):,} parameters; d_model {mc.d_model}, {mc.num_heads} heads, "
      f"{mc.num_encoder_layers}+{mc.num_decoder_layers} layers, d_ff {mc.d_ff}, vocabulary {V}")

def pieces(ids):
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

# %% [markdown]
# ## 1. A batch of two sentences
#
# Sentences of different lengths share a batch by padding: each row is right-padded with
# id 0 (PAD) to the longest. The target is the reference translation ending in EOS; the
# decoder reads it shifted one position right behind BOS (`shift_right`; the paper's
# "output embeddings are offset by one position", section 3.1). This is teacher forcing:
# one forward pass predicts every target position at once.
# `capture_intermediates` records what the model's modules return, so the sections below
# can compare their hand computations with what the model computed.

# %%
from num2words import num2words
from seq2seq.losses import shift_right

NUMBERS = (2_024, 342_817)
SRC = [num2words(n) for n in NUMBERS]
REF = [num2words(n, lang="fr") for n in NUMBERS]

def pad_batch(rows):
  """Lists of token ids as one [len(rows), longest] array, right-padded with 0 (PAD)."""
  out = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for r, ids in enumerate(rows):
    out[r, :len(ids)] = ids
  return jnp.asarray(out)

src = pad_batch([tokenizer.encode(s) + [EOS] for s in SRC])     # [2, S]
tgt = pad_batch([tokenizer.encode(s) + [EOS] for s in REF])     # [2, T]
tgt_in = shift_right(tgt, BOS)                                  # [2, T]: BOS + target[:-1]
S, T = src.shape[1], tgt.shape[1]
src_len = [int(n) for n in (src != 0).sum(1)]                   # real tokens per row
for r in range(2):
  print(f"{SRC[r]!r} -> {REF[r]!r}")
  print("  source        ", pieces(src[r]))
  print("  decoder input ", pieces(tgt_in[r]))
  print("  target        ", pieces(tgt[r]))

CAPTURED = ("__call__", "encode", "project_qkv", "project_q", "attend", "cross_kv")
logits, state = model.apply(variables, src, tgt_in, mutable=["intermediates"],
                            capture_intermediates=lambda module, method: method in CAPTURED)
inter = state["intermediates"]
enc, dec = inter["encoder"], inter["decoder"]
print(f"\nsrc {src.shape}, tgt_in {tgt_in.shape} -> logits {logits.shape}: one score per "
      f"vocabulary entry, at every target position")

# %% [markdown]
# ## 2. Embeddings and positional encoding
#
# Before the first layer, each token becomes its embedding (a row of the matrix *E*,
# multiplied by √d_model, section 3.4) plus the positional encoding of its position
# (section 3.5): attention itself ignores order, so position enters here and only here.
#
# $$PE_{(pos,2i)} = \sin(pos/10000^{2i/d_{model}}),\qquad PE_{(pos,2i+1)} = \cos(pos/10000^{2i/d_{model}})$$
#
# Low dimensions oscillate fast, high ones slowly; the dot product of two encodings
# depends mostly on the distance between the positions. One matrix *E* serves the
# source, the target and (section 8) the output.

# %%
from seq2seq.layers import Embed, add_positions, sinusoidal_positions

emb = Embed(mc).apply({"params": params["embed"]}, src)          # E[src] · √d_model  [2, S, D]
assert np.allclose(emb, params["embed"]["embedding"][src] * np.sqrt(mc.d_model), atol=1e-5)
pe = sinusoidal_positions(mc.max_len, mc.d_model)                  # [max_len, D]
x = emb + pe[:S]                                                   # the first layer's input
assert np.allclose(x, add_positions(emb, mc.max_len), atol=1e-6)
assert np.allclose(x, enc["dropout"]["__call__"][0], atol=1e-5)    # what the encoder read
rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a))))
print(f"x = E[src]·√d_model + PE: {emb.shape}; root mean square of an entry: embedding "
      f"{rms(emb[1, :src_len[1]]):.2f}, positional encoding {rms(pe[:S]):.2f}")

fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
heatmap(axes[0], pe, None, None, f"PE: sinusoidal_positions({mc.max_len}, {mc.d_model})",
        "dimension", "position", cmap="RdBu")
for i in (0, 6, 12, 20):
  axes[1].plot(pe[:, i], label=f"dimension {i}")
axes[1].set(title="A few dimensions along the positions", xlabel="position", ylabel="PE")
axes[1].legend(fontsize=8)
heatmap(axes[2], pe @ pe.T, None, None, "PE · PEᵀ: similarity of two positions",
        "position", "position")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. Encoder self-attention, with a padding mask
#
# The first encoder layer's self-attention: queries, keys and values all come from *x*.
# For each head,
#
# $$\mathrm{Attention}(Q,K,V)=\mathrm{softmax}\Big(\frac{QK^\top}{\sqrt{d_k}}\Big)V,
# \qquad Q = xW^Q,\; K = xW^K,\; V = xW^V.$$
#
# The short sentence is padded, and `encoder_mask` (True = may attend) keeps padding out:
# a real query reads real keys only, so the pad keys get weight exactly 0 and the short
# sentence encodes as if it were alone; a pad query reads nothing. Below: the five steps
# by hand, in the head-major layout [batch, heads, length, d_k], then the same from the
# library's `attention_weights`, `dot_product_attention` and `MultiHeadAttention`.

# %%
from seq2seq.attention import attention_weights, dot_product_attention
from seq2seq.layers import MultiHeadAttention
from seq2seq.model import encoder_mask

p = params["encoder"]["layers_0"]["self_attn"]
print({name: {k: w.shape for k, w in dense.items()} for name, dense in p.items()})
mask = encoder_mask(src)                                           # [2, 1, S, S]
q = jnp.einsum("bsd,dhk->bhsk", x, p["query"]["kernel"]) + p["query"]["bias"][:, None]
k = jnp.einsum("bsd,dhk->bhsk", x, p["key"]["kernel"])   # no key bias: softmax would ignore it
v = jnp.einsum("bsd,dhk->bhsk", x, p["value"]["kernel"]) + p["value"]["bias"][:, None]
d_k = q.shape[-1]
scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d_k)        # 1. scores  [2, H, S, S]
masked = jnp.where(mask, scores, -jnp.inf)                         # 2. mask
weights = jnp.nan_to_num(jax.nn.softmax(masked, axis=-1))          # 3. softmax (a pad query: 0)
heads = jnp.einsum("bhqk,bhkd->bhqd", weights, v)                  # 4. weights · V  [2, H, S, d_k]
out = jnp.einsum("bhqd,hdo->bqo", heads, p["out"]["kernel"]) + p["out"]["bias"]  # 5. W^O

assert np.allclose(weights, attention_weights(q, k, mask), atol=1e-5)
assert np.allclose(heads, dot_product_attention(q, k, v, mask), atol=1e-4)
assert np.allclose(out, MultiHeadAttention(mc).apply({"params": p}, x, x, mask), atol=1e-4)
assert np.allclose(out, enc["layers_0"]["self_attn"]["__call__"][0], atol=1e-4)
print("by hand == attention_weights == dot_product_attention == MultiHeadAttention == the model")

n0 = src_len[0]
assert (weights[0, :, :, n0:] == 0).all()                          # no query reads a pad key
alone = model.apply(variables, src[:1, :n0], method=Transformer.encode)
assert np.allclose(alone[0], inter["encode"][0][0, :n0], atol=1e-4)
print(f"sentence 0 ({n0} tokens + {S - n0} PAD): pad keys get weight 0; encoded alone, "
      f"without padding, it gives the same encoder output")

h, s0 = 0, pieces(src[0])
fig, axes = plt.subplots(1, 3, figsize=(18, 5))
heatmap(axes[0], mask[0, 0], s0, s0, "encoder_mask, sentence 0 (black: may attend)", "key",
        "query", cmap="Greys", colorbar=False)
heatmap(axes[1], jnp.where(mask[0, 0], scores[0, h], np.nan), s0, s0,
        f"1-2. scores QKᵀ/√{d_k}, masked (head {h})", "key", "", cmap="coolwarm")
heatmap(axes[2], weights[0, h], s0, s0, "3. softmax: attention weights", "key", "",
        vmin=0, vmax=1)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 4. Multi-head attention: split and concatenate
#
# A head is not a separate module: $W^Q$ is one d_model × d_model matrix viewed as
# [d_model, heads, d_k], so splitting into heads is a reshape of one matrix product (and a
# transpose to the head-major layout, `split_heads`). Each head attends on its own, with
# its own pattern; concatenating the heads is the inverse (`merge_heads` and a reshape),
# and $W^O$ is again one matrix.

# %%
from seq2seq.layers import merge_heads, split_heads

H, D = mc.num_heads, mc.d_model
q_flat = x @ p["query"]["kernel"].reshape(D, H * d_k) + p["query"]["bias"].reshape(H * d_k)
assert np.allclose(split_heads(q_flat.reshape(2, S, H, d_k), jnp.float32), q, atol=1e-5)
concat = merge_heads(heads).reshape(2, S, H * d_k)                 # Concat(head_1, ..., head_h)
assert np.allclose(concat @ p["out"]["kernel"].reshape(H * d_k, D) + p["out"]["bias"], out,
                   atol=1e-4)
print(f"x {x.shape} · W^Q [{D}, {H * d_k}] -> {q_flat.shape} -> split_heads {q.shape}; "
      f"heads {heads.shape} -> concat {concat.shape} · W^O -> {out.shape}")

s1 = pieces(src[1])
fig, axes = plt.subplots(1, H, figsize=(4.5 * H, 4.2))
for i in range(H):
  heatmap(axes[i], weights[1, i], s1, s1 if i == 0 else [], f"head {i}", "key",
          "query" if i == 0 else "", vmin=0, vmax=1, colorbar=i == H - 1)
fig.suptitle("Encoder layer 0 self-attention of sentence 1: one pattern per head")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. Add & Norm and the feed-forward network
#
# An encoder layer has two sublayers, self-attention and a position-wise feed-forward
# network $\mathrm{FFN}(x) = \max(0, xW_1 + b_1)W_2 + b_2$ (d_model → d_ff → d_model, each
# position alone). Each is wrapped as LayerNorm(x + Sublayer(x)): a residual connection,
# then layer normalisation (mean 0 and variance 1 over d_model, then a learned scale and
# bias). Dropout, off at inference, would come before the addition. Below, the whole of
# encoder layer 0 by hand.

# %%
from seq2seq.layers import AddNorm, FeedForward

def layer_norm(r, norm):
  mu, var = r.mean(-1, keepdims=True), r.var(-1, keepdims=True)
  return (r - mu) / jnp.sqrt(var + 1e-6) * norm["scale"] + norm["bias"]

pl = params["encoder"]["layers_0"]
h1 = layer_norm(x + out, pl["self_attn_norm"]["norm"])              # Add & Norm (self-attention)
pf = pl["ffn"]
hidden = jax.nn.relu(h1 @ pf["wi"]["kernel"] + pf["wi"]["bias"])    # [2, S, d_ff]
f_out = hidden @ pf["wo"]["kernel"] + pf["wo"]["bias"]              # [2, S, D]
h2 = layer_norm(h1 + f_out, pl["ffn_norm"]["norm"])                 # Add & Norm (FFN)

ffn = FeedForward(mc)
assert np.allclose(f_out, ffn.apply({"params": pf}, h1), atol=1e-4)
assert np.allclose(h2, AddNorm(mc).apply({"params": pl["ffn_norm"]}, h1,
                                         lambda z: ffn.apply({"params": pf}, z)), atol=1e-4)
assert np.allclose(h2, enc["layers_0"]["__call__"][0], atol=1e-4)  # encoder layer 0's output
n1 = src_len[1]
print(f"encoder layer 0 by hand == the model's; {float((hidden[1, :n1] == 0).mean()):.0%} of "
      f"the FFN's hidden units are 0 after the ReLU (sentence 1)")

fig, axes = plt.subplots(1, 2, figsize=(16, 4), gridspec_kw={"width_ratios": [3, 1]})
heatmap(axes[0], hidden[1, :n1], None, s1[:n1], f"FFN hidden units, max(0, xW₁ + b₁), d_ff = "
        f"{mc.d_ff} (sentence 1)", "hidden unit", "position", cmap="magma")
residual = (h1 + f_out)[1, :n1]
axes[1].plot(residual.std(-1), range(n1), "o-", label="x + FFN(x)")
axes[1].plot(h2[1, :n1].std(-1), range(n1), "s-", label="LayerNorm(x + FFN(x))")
axes[1].set(title="std over d_model", xlabel="std", ylim=(n1 - 0.5, -0.5))
axes[1].set_yticks(range(n1), s1[:n1], fontsize=8); axes[1].legend(fontsize=8)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 6. The decoder: masked self-attention
#
# The decoder's first sublayer is self-attention over the decoder input, masked so that
# position *t* reads positions ≤ *t* only: with teacher forcing the whole target is there,
# and the causal mask keeps each prediction from reading the token it must predict.
# `decoder_self_mask` is the causal mask and the padding mask together (black: may
# attend). The check below changes the decoder input at one position: the logits before
# it do not move.

# %%
from seq2seq.attention import causal_mask, padding_mask
from seq2seq.model import decoder_self_mask

self_mask = decoder_self_mask(tgt_in)                               # [2, 1, T, T]
valid = tgt_in != 0
assert np.array_equal(self_mask, causal_mask(T) & padding_mask(valid, valid))
t_change = 3
changed = tgt_in.at[1, t_change].set(EOS)
logits_changed = model.apply(variables, src, changed)
assert np.allclose(logits_changed[1, :t_change], logits[1, :t_change], atol=1e-5)
assert not np.allclose(logits_changed[1, t_change:], logits[1, t_change:], atol=1e-3)
print(f"decoder input changed at position {t_change}: logits before it unchanged, from it on "
      f"changed")

pd = params["decoder"]["layers_0"]["self_attn"]
q_d, k_d, v_d = dec["layers_0"]["self_attn"]["project_qkv"][0]     # each [2, H, T, d_k]
w_d = attention_weights(q_d, k_d, self_mask)
assert (w_d[1][:, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()  # no future
y_d = MultiHeadAttention(mc).apply({"params": pd}, q_d, k_d, v_d, self_mask, method="attend")
assert np.allclose(y_d, dec["layers_0"]["self_attn"]["attend"][0], atol=1e-4)

t0, t1 = pieces(tgt_in[0]), pieces(tgt_in[1])
fig, axes = plt.subplots(1, 3, figsize=(18, 5))
for ax, m, title in ((axes[0], causal_mask(T), "causal_mask: key ≤ query"),
                     (axes[1], padding_mask(valid, valid), "padding_mask: real query and key"),
                     (axes[2], self_mask, "decoder_self_mask: both")):
  heatmap(ax, m[0, 0], t0, t0, title + " (sentence 0)", "key (decoder input)",
          "query" if ax is axes[0] else "", cmap="Greys", colorbar=False)
plt.tight_layout(); plt.show()
fig, axes = plt.subplots(1, H, figsize=(4.5 * H, 4.2))
for i in range(H):
  heatmap(axes[i], w_d[1, i], t1, t1 if i == 0 else [], f"head {i}", "key",
          "query" if i == 0 else "", vmin=0, vmax=1, colorbar=i == H - 1)
fig.suptitle("Decoder layer 0 masked self-attention of sentence 1 (nothing above the diagonal)")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 7. Cross-attention: where the encoder output goes
#
# The decoder's second sublayer is the only place the source enters the decoder: its
# queries come from the decoder, its keys and values from the encoder output (after the
# last encoder layer), projected by each decoder layer's own $W^K$, $W^V$. The encoder
# output does not change while decoding, so these keys and values are projected once per
# source (`Decoder.cross_kv`). `cross_mask` hides the source padding. The weights form a
# target × source matrix, a soft alignment: in this model, the upper layer's heads look
# at the English words that each French word translates.

# %%
from seq2seq.model import cross_mask

encoded = inter["encode"][0]                                        # encoder output [2, S, D]
xmask = cross_mask(tgt_in, src)                                     # [2, 1, T, S]
cross = []
for layer in range(mc.num_decoder_layers):
  pc = params["decoder"][f"layers_{layer}"]["cross_attn"]
  k_c = jnp.einsum("bsd,dhk->bhsk", encoded, pc["key"]["kernel"])   # from the encoder output
  v_c = jnp.einsum("bsd,dhk->bhsk", encoded, pc["value"]["kernel"]) + pc["value"]["bias"][:, None]
  assert np.allclose(k_c, dec["cross_kv"][0][layer][0], atol=1e-4)
  assert np.allclose(v_c, dec["cross_kv"][0][layer][1], atol=1e-4)
  q_c = dec[f"layers_{layer}"]["cross_attn"]["project_q"][0]        # from the decoder [2, H, T, d_k]
  y_c = MultiHeadAttention(mc).apply({"params": pc}, q_c, k_c, v_c, xmask, method="attend")
  assert np.allclose(y_c, dec[f"layers_{layer}"]["cross_attn"]["attend"][0], atol=1e-4)
  cross.append(attention_weights(q_c, k_c, xmask))                  # [2, H, T, S]
assert all((w[0, :, :, n0:] == 0).all() for w in cross)             # source padding: weight 0
print(f"encoder output {encoded.shape} -> keys and values {k_c.shape} per decoder layer; "
      f"queries {q_c.shape} -> weights {cross[0].shape}")

last, g1 = mc.num_decoder_layers - 1, pieces(tgt[1])
fig, axes = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [2, 1]})
heatmap(axes[0], cross[last][1].mean(0), s1, g1, f"Sentence 1, decoder layer {last}, "
        f"mean of {H} heads", "source (English)", "target being predicted (French)", vmin=0)
m0 = int((tgt[0] != 0).sum())                                     # sentence 0's real targets
heatmap(axes[1], cross[last][0].mean(0)[:m0], s0, pieces(tgt[0])[:m0],
        "Sentence 0: the PAD columns get 0", "source (English)", "", vmin=0)
plt.tight_layout(); plt.show()

fig, axes = plt.subplots(mc.num_decoder_layers, H, figsize=(4 * H, 3.6 * mc.num_decoder_layers))
for layer in range(mc.num_decoder_layers):
  for i in range(H):
    heatmap(axes[layer, i], cross[layer][1, i], s1 if layer == last else [],
            g1 if i == 0 else [], f"layer {layer}, head {i}", vmin=0, vmax=1, colorbar=False)
fig.suptitle("Cross-attention of every decoder layer and head, sentence 1 "
             "(rows: target, columns: source)")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 8. The output head: shared weights and softmax
#
# After a third sublayer (the FFN, with Add & Norm as in the encoder), the decoder output
# is turned into one score per vocabulary entry. As in the paper (section 3.4), there is
# no separate output matrix: the logits are the decoder output times $E^\top$, the same
# embedding matrix the tokens were looked up in (there multiplied by √d_model). A softmax
# turns the logits into p, the distribution of the next token. Greedy choice below:
# the most probable token.

# %%
final = dec["__call__"][0][0]                                       # decoder output [2, T, D]
E = params["embed"]["embedding"]                                    # [V, D]
assert np.allclose(final @ E.T, logits, atol=1e-3)
print("top-level parameters:", list(params), "(no separate output projection)")
print(f"decoder output {final.shape} · Eᵀ {E.T.shape} -> logits {logits.shape}")

probs = jax.nn.softmax(logits, -1)                                  # p  [2, T, V]
pred = jnp.argmax(logits, -1)
print(f"\nsentence 1:\n{'t':>2}  {'decoder input':14} {'target':14} {'most probable':14} p(target)")
for t in range(T):
  print(f"{t:2d}  {t1[t]:14} {g1[t]:14} {pieces([pred[1, t]])[0]:14} {probs[1, t, tgt[1, t]]:.3f}")

# %% [markdown]
# ## 9. The loss: label smoothing
#
# Training (section 5.4) does not push p towards the one-hot reference but towards a
# smoothed target q: 1 − ε on the reference token and ε spread evenly over the V − 1
# others (ε = 0.1). The loss is the cross-entropy to q minus the entropy of q, i.e.
# KL(q ‖ p), which is 0 exactly when p = q. Left: p and q at one position, on the ten most
# probable tokens (log scale). Right: all V tokens, best first, on a log scale: q is flat at
# ε/(V − 1) off the reference, and so, roughly, is a well-trained p.

# %%
from seq2seq.losses import cross_entropy

eps, t = cfg.train.label_smoothing, 1
ref = int(tgt[1, t])
q_t = np.full(V, eps / (V - 1)); q_t[ref] = 1 - eps                 # the smoothed target q
p_t = np.asarray(probs[1, t], np.float64)
kl = float(np.sum(q_t * (np.log(q_t) - np.log(p_t))))                 # KL(q ‖ p), by hand
one = cross_entropy(logits[1:2, t:t + 1], tgt[1:2, t:t + 1], label_smoothing=eps)[0]
assert np.isclose(kl, float(one), rtol=1e-3, atol=1e-5)
print(f"position {t} (reference {pieces([ref])[0]!r}): p(reference) {p_t[ref]:.3f}, "
      f"q(reference) {1 - eps}; KL(q ‖ p) = {kl:.4f} = cross_entropy(..., label_smoothing={eps})")

order = np.argsort(-p_t)
fig, axes = plt.subplots(1, 2, figsize=(16, 4))
top = order[:10]
axes[0].bar(np.arange(10) - 0.2, p_t[top], 0.4, label="p: the model")
axes[0].bar(np.arange(10) + 0.2, q_t[top], 0.4, label="q: the smoothed target")
axes[0].set_xticks(range(10), pieces(top), rotation=45)
axes[0].set(title=f"Sentence 1, position {t}: the 10 most probable tokens",
            ylabel="probability (log scale)", yscale="log")
axes[0].legend()
axes[1].plot(p_t[order], label="p: the model")
axes[1].plot(q_t[order], label=f"q: 1 − ε on the reference, ε/(V − 1) = {eps / (V - 1):.1e} else")
axes[1].set(title=f"All {V} tokens, most probable first", xlabel="rank under p",
            ylabel="probability (log scale)", yscale="log")
axes[1].legend()
plt.tight_layout(); plt.show()

loss_sum, n = cross_entropy(logits, tgt)
nll = float(loss_sum / n)
kl_sum, _ = cross_entropy(logits, tgt, label_smoothing=eps)
print(f"both sentences, {int(n)} target tokens: loss as trained KL(q ‖ p) {float(kl_sum / n):.4f}; "
      f"NLL −log p(reference) {nll:.4f} nats, perplexity exp(NLL) {np.exp(nll):.3f}")

# %% [markdown]
# A model trained towards q puts about 1 − ε = 0.9 on the reference token, not 1: its NLL
# settles near −log 0.9 ≈ 0.105 nats and its perplexity near 1/0.9 ≈ 1.11, even when
# every translation is right, while the loss it was trained on goes to 0. The paper:
# label smoothing "hurts perplexity, as the model learns to be more unsure, but improves
# accuracy and BLEU score".

# %% [markdown]
# ## 10. Choosing the next token: greedy, temperature, top-k, top-p
#
# How the decoding strategies choose from one next-token distribution. On real numbers
# this model is sure of itself, so we ask it things it never saw and take the step where
# the runner-up comes closest to the best token (`decode(..., return_logits=True)` returns
# the logits of every step). Greedy takes the argmax; sampling draws from
# softmax(logits / temperature), optionally kept to the *k* most likely tokens (top-k) or
# to the smallest set holding probability *p* (top-p, nucleus). The filtered distributions
# come from `filter_logits`, the function the sampler uses. Gray: all the other tokens
# together.

# %%
from seq2seq.decoding import decode
from seq2seq.search import Greedy, Sample, filter_logits
from seq2seq.translate import encode_sources

odd = ["forty-forty", "one million", "a hundred", "one thousand million", "three point five",
       "nineteen eighty-four", "twelve hundred", "minus five"]
odd_src = pad_batch(encode_sources(tokenizer, odd, mc.max_len)[0])
res = decode(mc, params, odd_src, Greedy(), bos_id=BOS, eos_id=EOS, return_logits=True)
p_all = np.asarray(jax.nn.softmax(res.logits, -1))                 # [B, L, V]
runner_up = -np.sort(-p_all, -1)[..., 1]                           # [B, L]
runner_up[np.arange(p_all.shape[1])[None] >= res.lengths[:, :1]] = 0  # after the end
b, t = np.unravel_index(np.argmax(runner_up), runner_up.shape)
row = jnp.asarray(res.logits[b, t])[None]                          # [1, V]
print(f"{odd[b]!r} -> {tokenizer.decode(res.token_lists(EOS)[b])!r}; step {t}, after "
      f"{pieces(res.tokens[b, 0, :t])}")

shown = np.argsort(-np.asarray(row[0]))[:12]                       # the 12 most likely tokens
cases = [("greedy (argmax)", None), ("temperature 0.5", Sample(temperature=0.5)),
         ("temperature 1 (the model)", Sample()), ("temperature 2", Sample(temperature=2.0)),
         ("top-k, k = 3", Sample(top_k=3)), ("top-p, p = 0.6", Sample(top_p=0.6))]
fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharey=True)
for ax, (name, strategy) in zip(axes.flat, cases):
  if strategy is None:
    dist = np.asarray(jax.nn.one_hot(jnp.argmax(row[0]), V))
    kept = 1
  else:
    filtered = filter_logits(row, strategy)[0]
    dist = np.asarray(jax.nn.softmax(filtered))
    kept = int(jnp.isfinite(filtered).sum())
  rest = max(float(1 - dist[shown].sum()), 0.0)                     # the other V - 12 tokens
  ax.bar(range(12), dist[shown], color="C0")
  ax.bar([12], [rest], color="gray")
  ax.set_xticks(range(13), pieces(shown) + [f"other {V - 12}"], rotation=60, fontsize=8)
  ax.set(title=f"{name}\n{kept} of {V} tokens can be drawn, {rest:.0%} on the others",
         ylabel="probability of being chosen")
fig.suptitle(f"Source {odd[b]!r}, step {t}: the next-token distribution, six ways")
plt.tight_layout(); plt.show()

steps = jnp.asarray(res.logits[b, :int(res.lengths[b, 0])])       # this output's steps
for name, strategy in cases[4:]:
  sizes = jnp.isfinite(filter_logits(steps, strategy)).sum(-1)
  print(f"{name}: tokens kept at each step of the output: {np.asarray(sizes).tolist()}")

# %% [markdown]
# Temperature 1 draws from the model's whole distribution, tail included (gray: most of
# those tokens are nonsense here, bytes or English pieces). Temperature 0.5 sharpens the
# distribution towards greedy, temperature 2 flattens it. Top-k and top-p cut the tail
# off and share its probability among the tokens they keep; top-k keeps k tokens at
# every step, top-p as many as it takes to reach p: one where the model is sure.
#
# **Sampling whole translations.** `decode` runs a strategy over a batch: here eight
# copies of one source, each row drawing its own tokens. The score is the
# log-probability of the output under the model; greedy's output is the most probable
# token at each step, not necessarily the most probable sentence.

# %%
SAMPLES = 8
strategy = Sample(temperature=1.5, top_k=5)
res = decode(mc, params, jnp.repeat(odd_src[b:b + 1], SAMPLES, axis=0), strategy, bos_id=BOS,
             eos_id=EOS, rng=0)
samples = [tokenizer.decode(ids) for ids in res.token_lists(EOS)]
print(f"{odd[b]!r}, {strategy}:")
for text, score in sorted(zip(samples, res.scores[:, 0]), key=lambda s: -s[1]):
  print(f"   {score:8.3f}  {text}")
print(f"{len(set(samples))} different translations in {SAMPLES} samples")
assert len(set(samples)) > 1
