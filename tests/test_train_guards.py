"""What keeps a bad checkpoint out of a workdir, in-process: the checksum of each saved
array (checked on restore), the finite check of each update, low-precision parameters,
and a vocabulary reused only for the data it was built from."""
import dataclasses
import functools
import hashlib
import json
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import seq2seq  # noqa: E402
from seq2seq import checkpoint as ckpt_lib  # noqa: E402
from seq2seq import train_lib  # noqa: E402
from seq2seq.config import Config, TrainConfig, get_experiment  # noqa: E402
from seq2seq.data import load_dataset  # noqa: E402
from seq2seq.data import testing as dtest  # noqa: E402
from seq2seq.data import vocabulary  # noqa: E402
from seq2seq.errors import UserError  # noqa: E402


# --- checksums ----------------------------------------------------------------------------

def numpy_checksum(x: np.ndarray, chunk=2 ** 14) -> str:
  """The checksum as its definition reads, in NumPy (uint64 arithmetic, masked): two sums
  over the array's bits, padded with zeros to whole chunks, each mixed with its position."""
  m = 2 ** 32 - 1
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
  bits = bits.astype(np.uint64).ravel()
  bits = np.concatenate([bits, np.zeros(max(-(-bits.size // chunk), 1) * chunk - bits.size,
                                        np.uint64)])
  index = np.arange(bits.size, dtype=np.uint64)

  def fmix(h):
    h = h & m
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)
  a = fmix(bits + index * 0x9E3779B1)
  b = fmix(bits ^ ((index * 0x85EBCA77 + 0x165667B1) & m))
  return f"{int(a.sum()) & m:08x}{int(b.sum()) & m:08x}"


def test_checksum_is_its_definition_and_sees_every_bit():
  rng = np.random.default_rng(0)
  arrays = {"f32": rng.normal(size=(3, 5, 7)).astype(np.float32),
            "bf16": rng.normal(size=(33, 9)).astype(jnp.bfloat16),
            "big": rng.normal(size=(2, 3 * 2 ** 14 + 5)).astype(np.float32),   # 7 chunks
            "step": np.int32(1234)}
  got = ckpt_lib.checksums(jax.tree_util.tree_map(jnp.asarray, arrays))
  assert got == {k: numpy_checksum(np.asarray(v)) for k, v in arrays.items()}
  flat = arrays["f32"].view(np.uint32).ravel()
  for i, bit in ((0, 0), (17, 31), (104, 5)):
    flipped = flat.copy()
    flipped[i] ^= np.uint32(1 << bit)
    x = flipped.view(np.float32).reshape(arrays["f32"].shape)
    assert ckpt_lib.checksums({"f32": jnp.asarray(x)})["f32"] != got["f32"]
  swapped = arrays["f32"].copy()          # the same values in other places
  swapped[0, 0, :2] = swapped[0, 0, 1::-1]
  assert ckpt_lib.checksums({"f32": jnp.asarray(swapped)})["f32"] != got["f32"]


def _saved(workdir, steps=(10, 20)):
  cfg = get_experiment("numbers")
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=368))
  workdir.mkdir()
  ckpt_lib.write_config(workdir, cfg)
  ckpts = ckpt_lib.Checkpoints(workdir, async_save=False)
  init = jax.jit(lambda k: train_lib.init_state(cfg, k))
  for step in steps:
    state = init(jax.random.key(step))
    ckpts.save(step, state, {"step": step})
  ckpts.close()
  return cfg


def _flip_bits(workdir, step, n=3, seed=0):
  """Flips `n` bits in the middle of the checkpoint's largest array file."""
  data = workdir / "checkpoints" / str(step) / "state" / "ocdbt.process_0" / "d"
  f = max(data.iterdir(), key=lambda p: p.stat().st_size)
  b = bytearray(f.read_bytes())
  rng = np.random.default_rng(seed)
  for pos in rng.choice(len(b) - 2000, n, replace=False) + 1000:
    b[pos] ^= 1 << int(rng.integers(8))
  f.write_bytes(bytes(b))


def test_flipped_bits_are_caught_and_the_previous_checkpoint_used(tmp_path):
  workdir = tmp_path / "w"
  cfg = _saved(workdir)
  _flip_bits(workdir, 20)
  abstract = ckpt_lib.local_abstract_state(cfg)
  reader = ckpt_lib.Checkpoints(workdir, read_only=True)          # decode.py: moves nothing
  with pytest.warns(UserWarning, match=r"skipping unreadable checkpoint .*/20: the checksum "
                                       r"of .* does not match"):
    _, meta = reader.restore(abstract)
  assert meta["step"] == 10 and reader.steps() == [10, 20]
  with pytest.warns(UserWarning, match="skipping unreadable checkpoint .*/20 .moved to "
                    ".*checkpoints_unreadable/20.: the checksum of "):
    state, meta = ckpt_lib.Checkpoints(workdir).restore(abstract)  # a resuming run
  assert meta["step"] == 10 and ckpt_lib.Checkpoints(workdir, read_only=True).steps() == [10]
  want = jax.jit(lambda k: train_lib.init_state(cfg, k))(jax.random.key(10))
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b)


# --- the step -----------------------------------------------------------------------------

def _tiny(param_dtype="float32", **train):
  mc = seq2seq.get_config("tiny", vocab_size=29).replace(dropout_rate=0.0,
                                                          param_dtype=param_dtype)
  # adam_eps well above rounding noise: Adam's first step with eps≈0 is lr·sign(g), which
  # flips for a gradient near 0 between two differently compiled programs.
  return Config(model=mc, train=TrainConfig(warmup_steps=5, adam_eps=1e-4, **train))


def _batch():
  rng = np.random.default_rng(0)
  return {"src": jnp.asarray(rng.integers(3, 29, (4, 7)), jnp.int32),
          "tgt": jnp.asarray(rng.integers(3, 29, (4, 6)), jnp.int32).at[1, 4:].set(0)}


@pytest.mark.slow   # compiles two train steps (~30 s on 2 busy cores)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_parameters_train_with_float32_adam(dtype):
  """Parameters stay in param_dtype; Adam's moments and the update are float32 (the update
  is cast when added). Checked against optax's Adam on float32 copies."""
  cfg = _tiny(dtype)
  batch = _batch()
  state = jax.jit(lambda k: train_lib.init_state(cfg, k))(jax.random.key(0))
  assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype(dtype)}
  assert {x.dtype for x in jax.tree_util.tree_leaves(state.opt_state)
          if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype("float32")}
  step = jax.jit(lambda s, b: train_lib.train_step(s, b, cfg=cfg, bos_id=1))
  new, m = step(state, batch)
  assert int(m["first_bad_update"]) == train_lib._NO_STEP

  loss = lambda p: train_lib.loss_and_metrics(cfg, p, batch, 1, train=True)[0]  # noqa: E731
  grads = jax.tree_util.tree_map(lambda g: g.astype(np.float32) / m["tokens"],
                                 jax.jit(jax.grad(loss))(state.params))
  f32 = jax.tree_util.tree_map(lambda p: p.astype(np.float32), state.params)
  opt = train_lib.optimizer(cfg)
  upd, _ = jax.jit(lambda g, p: opt.update(g, opt.init(p), p))(grads, f32)
  for got, p, u in zip(*(jax.tree_util.tree_leaves(t) for t in (new.params, f32, upd))):
    want = np.asarray((p + u).astype(dtype), np.float32)
    ulp = np.abs(want) * float(jnp.finfo(dtype).eps) + 1e-6
    assert got.dtype == jnp.dtype(dtype)
    assert np.all(np.abs(np.asarray(got, np.float32) - want) <= ulp)

  losses = _losses(cfg, new)
  reference = _float32_losses()   # float32 parameters from the same start
  assert np.isfinite(losses).all() and losses[-1] < reference[0] - 0.5, (losses, reference)
  # Trains as far as float32 does: on this one batch float32 rests on a plateau (2.14) that
  # the rounding of low-precision parameters may leave early, not stay above.
  assert losses[-1] < reference[-1] + 0.05, (losses, reference)


@functools.lru_cache(maxsize=None)
def _float32_losses():
  return _losses(_tiny(), None)


def _losses(cfg, state, steps=30):
  """The losses of `steps` more steps on one batch (from a new state if `state` is None)."""
  batch = _batch()
  step = jax.jit(lambda s, b: train_lib.train_step(s, b, cfg=cfg, bos_id=1))
  if state is None:
    state = jax.jit(lambda k: train_lib.init_state(cfg, k))(jax.random.key(0))
    state, _ = step(state, batch)
  losses = []
  for _ in range(steps):
    state, m = step(state, batch)
    losses.append(float(m["loss_sum"]) / float(m["tokens"]))
  return losses


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # 1e40 as float32
def test_an_update_that_makes_parameters_non_finite_is_flagged():
  """The loss and gradients of step 1 are finite, the parameters after it are not (a
  learning rate past what validation lets through): flagged, so that no checkpoint of them
  is written."""
  cfg = _tiny()
  object.__setattr__(cfg.train, "learning_rate_scale", 1e40)   # past validation
  step = jax.jit(lambda s, b: train_lib.train_step(s, b, cfg=cfg, bos_id=1))
  state = jax.jit(lambda k: train_lib.init_state(cfg, k))(jax.random.key(0))
  new, m = step(state, _batch())
  assert np.isfinite(float(m["loss_sum"])) and np.isfinite(float(m["grad_norm"]))
  assert not all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(new.params))
  assert int(m["first_bad_step"]) == train_lib._NO_STEP   # not the loss ...
  assert int(m["first_bad_update"]) == 1                  # ... the update


@pytest.mark.parametrize("items, says", [
    (["train.learning_rate_scale=inf"], "learning_rate_scale must be a finite number, got inf"),
    (["train.learning_rate_scale=nan"], "learning_rate_scale must be a finite number, got nan"),
    (["train.learning_rate_scale=1e40"], "gives a peak learning rate of 1.02e+38"),
    (["train.learning_rate_scale=300"], "gives a peak learning rate of 3.06"),
    (["train.weight_decay=inf"], "weight_decay must be a finite number, got inf"),
])
def test_absurd_learning_rates_are_refused(items, says):
  with pytest.raises(seq2seq.ConfigError, match=says.replace("+", r"\+")):
    seq2seq.config.override(get_experiment("numbers"), items)
  peak = seq2seq.config.peak_learning_rate(get_experiment("numbers"))
  assert peak == pytest.approx(0.35 * 64 ** -0.5 * 150 ** -0.5)


# --- the vocabulary -----------------------------------------------------------------------

def _data_cfg(tmp_path, corpus, **data):
  d = dict(dataset="parallel_text", train_files=str(corpus), data_dir=str(tmp_path / "tfds"),
           vocab_size=300, max_src_len=16, max_tgt_len=16)
  d.update(data)
  return Config(data=seq2seq.DataConfig(**d), train=TrainConfig(batch_size=8, seq_len=32))


def test_a_vocabulary_is_reused_only_for_the_data_it_was_built_from(tmp_path, monkeypatch):
  right = dtest.write_corpus_dir(str(tmp_path / "right"), (("train", 120),), seed=1)
  other = dtest.write_moses(str(tmp_path / "other" / "train"),
                            [(s.upper(), t.upper()) for s, t in dtest.sentence_pairs(120, 2)])
  work = tmp_path / "w"
  # what a refused run left behind before vocabularies were recorded: built from other data
  stray = load_dataset(_data_cfg(tmp_path, other), str(tmp_path / "x"), process_index=0,
                       process_count=1).tokenizer.model_proto
  work.mkdir()
  (work / "vocab.model").write_bytes(stray)
  with pytest.warns(UserWarning, match="nothing records what it was built from; no run uses "
                                       "it: training a new one"):
    ds = load_dataset(_data_cfg(tmp_path, right), str(work), process_index=0, process_count=1)
  assert ds.tokenizer.model_proto != stray
  assert (work / "vocab.model").read_bytes() == ds.tokenizer.model_proto
  record = json.loads((work / "vocab.json").read_text())
  assert record["sha256"] == hashlib.sha256(ds.tokenizer.model_proto).hexdigest()
  # the same data and settings: reused, not trained again
  trained = []
  monkeypatch.setattr(vocabulary, "train", lambda *a, **k: trained.append(1))
  again = load_dataset(_data_cfg(tmp_path, right), str(work), process_index=0,
                       process_count=1)
  assert again.tokenizer.model_proto == ds.tokenizer.model_proto and not trained
  monkeypatch.undo()
  # other settings: trained again (no run uses it yet)
  with pytest.warns(UserWarning, match=r"built from other data or settings \(vocab_size: "
                                       r"300 -> 280\)"):
    load_dataset(_data_cfg(tmp_path, right, vocab_size=280), str(work), process_index=0,
                 process_count=1)
  # a run's vocabulary (config.json): kept whatever the record says, and said
  (work / "config.json").write_text("{}")
  before = (work / "vocab.model").read_bytes()
  with pytest.warns(UserWarning, match="kept, as the run's checkpoints depend on it"):
    kept = load_dataset(_data_cfg(tmp_path, other), str(work), process_index=0,
                        process_count=1)
  assert kept.tokenizer.model_proto == before


def test_a_refused_dataset_writes_nothing(tmp_path):
  pairs = [p for p in dtest.sentence_pairs(300) if len(p[0].split()) > 2][:60]
  corpus = dtest.write_moses(str(tmp_path / "c" / "train"), pairs)
  work = tmp_path / "w"
  work.mkdir()
  with pytest.raises(UserError, match="all 60 training pairs of shard 0 are longer"):
    load_dataset(_data_cfg(tmp_path, corpus, max_src_len=2), str(work), process_index=0,
                 process_count=1)
  assert list(work.iterdir()) == []
