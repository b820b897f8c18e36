"""What keeps a fused attention kernel from killing a run: no call on the accelerator path
gets a query with no allowed key, only a GPU that can run it reaches cuDNN, the probe tries
each form at its own lengths and batch with padding rows, large logits and its backward,
and checks every real row; a train step that still fails on cuDNN is redone on XLA's
attention (tests/test_attention_net.py: the rest of the net). cuDNN is emulated on any
machine by an implementation made to fail as the real one was seen to (NaN gradients for
queries with no allowed key at lengths of 64 mod 128, on an H100), or, for the net, in the
run's programs but not in the probe's (`failing_outside_the_probe`)."""
import ast
import functools
import hashlib
import json
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import config as config_lib, kernels, model as model_lib, steps, train_lib
from seq2seq.config import Config, DataConfig, TrainConfig
from seq2seq.data import testing as data_testing
from seq2seq.kernels import accelerator as acc


def _xla(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _nan_where(bad_BxQ, x_BxQxHxD):
  return jnp.where(bad_BxQ[:, :, None, None], jnp.nan, x_BxQxHxD).astype(x_BxQxHxD.dtype)


def _failing_cudnn(fails):
  """XLA's attention whose dq is NaN for the query rows `fails(q, mask)` -> [B, Q] names."""
  @jax.custom_vjp
  def attend(q, k, v, mask):
    return _xla(q, k, v, mask)

  def fwd(q, k, v, mask):
    y, vjp = jax.vjp(lambda q, k, v: _xla(q, k, v, mask), q, k, v)
    return y, (vjp, fails(q, mask))

  def bwd(res, g):
    vjp, bad_BxQ = res
    dq, dk, dv = vjp(g)
    return _nan_where(bad_BxQ, dq), dk, dv, None
  attend.defvjp(fwd, bwd)
  return attend


def in_probe() -> bool:
  """Whether the accelerator's probe is the caller: the stand-ins for a failure the probe
  cannot see (the run's program fails where the probe's small one passes) fail elsewhere."""
  frame = sys._getframe()
  while frame is not None:
    if frame.f_code.co_name == "_probe" and frame.f_code.co_filename == acc.__file__:
      return True
    frame = frame.f_back
  return False


def _as_seen_on_h100(q, mask):
  """The reported failure: queries with no allowed key (a padding position), when the
  key length is 64 mod 128."""
  empty_BxQ = ~jnp.any(jnp.broadcast_to(mask, (q.shape[0], 1, q.shape[1], mask.shape[-1])),
                       axis=-1)[:, 0]
  return empty_BxQ & (mask.shape[-1] % 128 == 64)


@pytest.fixture
def fake_cudnn(monkeypatch):
  """Makes `fails` the rows cuDNN's dq gets wrong, and lets cuDNN take any input."""
  monkeypatch.setattr(acc, "_VERDICTS", {})
  monkeypatch.setattr(acc, "_verdicts_file", lambda: None)   # none kept between tests
  monkeypatch.setattr(acc, "unqualified", lambda q, mask=None: None)
  monkeypatch.delenv(acc.ENV, raising=False)

  def install(fails):
    monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _failing_cudnn(fails))
  return install


def _packed_batch(B=4, L=64, seed=0):
  """A batch as the packing pipeline makes them: rows of 1-3 examples, then padding; the
  last row empty (an evaluation batch's tail)."""
  rng = np.random.default_rng(seed)
  b = {k: np.zeros((B, L), np.int32) for k in ("src", "tgt", "src_segments", "tgt_segments",
                                               "src_positions", "tgt_positions")}
  for r in range(B - 1):
    for side in ("src", "tgt"):
      at = 0
      for seg in range(1, rng.integers(1, 4) + 1):
        n = int(rng.integers(3, 18))
        b[side][r, at:at + n] = rng.integers(4, 29, n)
        b[f"{side}_segments"][r, at:at + n] = seg
        b[f"{side}_positions"][r, at:at + n] = np.arange(n)
        at += n
  return {k: jnp.asarray(v) for k, v in b.items()}


def _cfg(dtype="bfloat16"):
  mc = seq2seq.get_config("tiny", vocab_size=29).replace(
      dropout_rate=0.0, kernels="accelerator", dtype=dtype, d_model=32, num_heads=2,
      d_ff=64, max_len=64, num_encoder_layers=1, num_decoder_layers=1)
  return Config(model=mc, train=TrainConfig(warmup_steps=5, batch_size=4, seq_len=64))


def test_no_attention_call_gets_a_query_with_no_allowed_key(monkeypatch):
  """The masks the implementation receives on the model's packed, padded rows: every query
  may attend to some key, and real queries to exactly the keys the model's mask allows."""
  seen = []

  def recording(q, k, v, mask):
    if not isinstance(mask, jax.core.Tracer):   # the eager call below, not init's trace
      seen.append(np.asarray(mask))
    return _xla(q, k, v, mask)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "xla", recording)
  monkeypatch.setenv(acc.ENV, "xla")
  cfg, batch = _cfg("float32"), _packed_batch()
  cfg = cfg.replace(model=cfg.model.replace(scan_layers=False))   # each call's own mask
  params = jax.jit(model_lib.Transformer(cfg.model).init)(jax.random.key(0), batch["src"],
                                                          batch["tgt"])
  seen.clear()
  model_lib.Transformer(cfg.model).apply(
      params, batch["src"], batch["tgt"], batch["src_segments"], batch["tgt_segments"],
      batch["src_positions"], batch["tgt_positions"])
  enc = np.asarray(model_lib.encoder_mask(batch["src"], batch["src_segments"]))
  assert (~enc.any(-1)).sum() > 64, "the batch has padding queries"
  assert len(seen) == 1 + 2 and all(m.any(-1).all() for m in seen)
  real = enc.any(-1, keepdims=True)
  np.testing.assert_array_equal(np.broadcast_to(seen[0], enc.shape) & real, enc)


def test_the_fake_fails_as_reported_and_the_model_never_meets_it(fake_cudnn):
  """Called as the model called it before (a query row with no allowed key, length 64),
  the emulated cuDNN gives NaN gradients; the model's train step on packed rows of 64
  through the accelerator path, cuDNN chosen, has a finite loss and gradients equal to
  XLA's attention's."""
  fake_cudnn(_as_seen_on_h100)
  cfg, batch = _cfg(), _packed_batch()
  mask = model_lib.encoder_mask(batch["src"], batch["src_segments"])
  q = jnp.ones((4, 64, 2, 16), jnp.bfloat16)
  dq = jax.grad(lambda q: acc.IMPLEMENTATIONS["cudnn"](q, q, q, mask).astype(
      jnp.float32).sum())(q)
  assert np.isnan(np.asarray(dq, np.float32)).any()

  params = jax.jit(model_lib.Transformer(cfg.model).init)(jax.random.key(0), batch["src"],
                                                          batch["tgt"])
  from seq2seq.steps import loss_and_metrics
  grad = jax.jit(jax.grad(lambda p: loss_and_metrics(cfg, p, batch, 1, train=True)[0]))
  g_cudnn = grad(params["params"])
  assert all(v["train"]["ok"] for v in acc.verdicts()), acc.verdicts()
  leaves = jax.tree_util.tree_leaves(g_cudnn)
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(acc.ENV, "xla")
    g_xla = jax.jit(jax.grad(lambda p: loss_and_metrics(cfg, p, batch, 1, train=True)[0]))(
        params["params"])
  for a, b in zip(leaves, jax.tree_util.tree_leaves(g_xla)):
    np.testing.assert_array_equal(a, b)


def test_the_probe_tries_each_form_at_its_own_lengths_with_padding_rows(fake_cudnn):
  """A cuDNN that fails only at lengths of 64 mod 128 is refused at 64 and 192 and taken at
  16 (one probe per length, not per parity); the probe's masks hold padding
  queries (opened), packed examples and an empty row, as the model's do."""
  fake_cudnn(lambda q, mask: jnp.broadcast_to(mask.shape[-1] % 128 == 64, q.shape[:2]))
  for length, ok in ((16, True), (64, False), (192, False)):
    x = jnp.ones((8, length, 2, 16), jnp.bfloat16)
    mask = jnp.ones((8, 1, length, length), bool)
    assert acc.choose(x, x, mask)[1] == ("cudnn" if ok else "xla"), length
  assert len(acc.verdicts()) == 3
  rng = np.random.default_rng(0)
  m = acc._probe_mask(3, 64, 64, rng)
  empty = ~m.any(-1)[:, 0]                                   # [rows, Q]
  assert empty[:2].any(1).all() and empty[:2].sum(1).max() < 64 and empty[2].all()
  assert len(np.unique(m[0, 0], axis=0)) >= 3                # two examples and padding
  assert not m[1, 0][np.triu_indices(64, 1)].any()           # the causal row
  q, k, v, ms, g, real_q, real_k = acc._probe_inputs(("bfloat16", 2, 16, 64, 64, "B"), 8)
  assert q.shape == (8, 64, 2, 16) and q.dtype == jnp.bfloat16 and ms.shape == (8, 1, 64, 64)
  assert np.asarray(ms).any(-1).all()                        # opened
  assert (~real_q).any() and real_q.any(1)[:-1].all() and not real_q[-1].any()


@functools.lru_cache(maxsize=None)
def _corpus(root):
  pairs = data_testing.sentence_pairs(120, seed=3)
  return data_testing.write_tsv(f"{root}/train.tsv", pairs)


def _train(tmp_path, name, steps=4, **train):
  from seq2seq import train_lib
  cfg = _cfg()
  cfg = cfg.replace(
      data=DataConfig(dataset="parallel_text", train_files=_corpus(str(tmp_path)),
                      data_dir=str(tmp_path / "tfds"), vocab_size=300, max_src_len=32,
                      max_tgt_len=32),
      train=cfg.train.replace(steps=steps, log_every=2, checkpoint_every=steps,
                              eval_every=1000, num_eval_examples=4, eval_batch_size=4,
                              **train))
  result = train_lib.train(cfg, tmp_path / name, progress=False)
  from seq2seq.load import load_workdir
  return result, load_workdir(tmp_path / name)[1]


@pytest.mark.slow   # two training runs (~15-25 s on 2 cores)
def test_a_step_non_finite_on_cudnn_is_redone_on_xla(fake_cudnn, tmp_path, capsys):
  """A cuDNN whose probe passes but whose gradients are NaN in the run's train step: the
  run says so in one line, moves to XLA's attention, redoes the step and ends with the
  parameters of a run on XLA's attention from the start. Nothing names cuDNN but the NaN,
  and the probe at the run's form passes: the move is not stored."""
  fake_cudnn(lambda q, mask: jnp.broadcast_to(not in_probe(), q.shape[:2]))
  netted, params = _train(tmp_path, "netted")
  said = capsys.readouterr().err
  assert said.count("non-finite loss or gradient with cuDNN's attention") == 1, said
  assert ("moved to XLA's attention and redid the step (not kept for later runs: nothing "
          "names cuDNN, and its probe at the run's form passes)") in said
  assert not any(v["train"]["ok"] for v in acc.verdicts()), acc.verdicts()
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(acc.ENV, "xla")
    plain, want = _train(tmp_path, "xla")
  assert netted.train_metrics["loss"] == plain.train_metrics["loss"]
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_verdicts_are_kept_for_the_next_run_on_the_same_machine(fake_cudnn, tmp_path,
                                                                monkeypatch):
  """A form probed once is not probed again by a later process (the verdicts file beside
  the compile cache), a move to XLA is kept too, and another machine (device, versions)
  probes for itself."""
  monkeypatch.setattr(acc, "_verdicts_file", lambda: tmp_path / "attention_verdicts.json")
  fake_cudnn(lambda q, mask: jnp.zeros(q.shape[:2], bool))
  probes = []
  real_probe = acc._probe
  monkeypatch.setattr(acc, "_probe", lambda *a, **kw: probes.append(kw) or real_probe(*a, **kw))
  x, mask = jnp.ones((8, 32, 2, 16), jnp.bfloat16), jnp.ones((8, 1, 32, 32), bool)
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 2
  monkeypatch.setattr(acc, "_VERDICTS", {})                  # a new process
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 2
  acc.keep(acc.move_to_xla([acc._signature(x, x, mask)], "test"))   # every role
  monkeypatch.setattr(acc, "_VERDICTS", {})
  assert acc.choose(x, x, mask) == ("xla", "xla") and len(probes) == 2
  monkeypatch.setattr(acc, "_machine", lambda: "another GPU")
  monkeypatch.setattr(acc, "_VERDICTS", {})
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 4
  assert (tmp_path / "attention_verdicts.json").exists()


# --- what the net watches, when it moves and what it stores -------------------------------

def _verdicts_kept(tmp_path, monkeypatch):
  """The verdicts file in `tmp_path`; its contents (a function)."""
  path = tmp_path / "attention_verdicts.json"
  monkeypatch.setattr(acc, "_verdicts_file", lambda: path)
  return lambda: json.loads(path.read_text())


def _diverging(monkeypatch):
  """A learning rate that makes the parameters non-finite at step 1, so step 2's loss is
  non-finite whatever attention runs (the bound on learning rates lifted for it)."""
  monkeypatch.setattr(config_lib, "MAX_PEAK_LEARNING_RATE", float("inf"))
  return dict(learning_rate_scale=1e40)


def test_only_differentiated_calls_are_probed_backward_and_init_chooses_nothing(
    fake_cudnn, monkeypatch):
  """A model's init probes nothing; a plain forward call (decoding, evaluation) probes its
  form's forward alone; a differentiated call of the form adds its backward."""
  fake_cudnn(lambda q, mask: jnp.zeros(q.shape[:2], bool))
  probes = []
  real_probe = acc._probe
  monkeypatch.setattr(acc, "_probe", lambda key, batch, train: probes.append(
      (key[3], train)) or real_probe(key, batch, train))
  from seq2seq.state import init_state
  jax.eval_shape(lambda: init_state(_cfg(), jax.random.key(0)))
  assert probes == [] and acc.verdicts() == []
  x, mask = jnp.ones((4, 2, 16, 16), jnp.bfloat16), jnp.ones((4, 1, 16, 16), bool)
  f = lambda x: acc.attention(x, x, x, mask).astype(jnp.float32).sum()   # [B, H, L, D]
  jax.jit(f)(x)
  assert probes == [(16, False)]
  jax.jit(jax.grad(f))(x)
  assert probes == [(16, False), (16, True)]


def test_a_non_finite_step_with_nothing_trained_on_cudnn_redoes_nothing(
    fake_cudnn, tmp_path, capsys, monkeypatch):
  """cuDNN refused for the run's differentiated calls (its backward NaN at the run's
  lengths), forward taken: a non-finite step (a diverging learning rate) is not blamed on
  cuDNN: no line, no new trainer (nothing recompiled), and the run stops as any diverging
  run does."""
  fake_cudnn(lambda q, mask: jnp.broadcast_to(mask.shape[-1] > 8, q.shape[:2]))
  made = []

  class Counted(steps.Trainer):
    def __init__(self, *a, **kw):
      made.append(1)
      super().__init__(*a, **kw)
  monkeypatch.setattr(steps, "Trainer", Counted)   # the net's new trainers
  with pytest.raises(train_lib.NonFiniteLoss):
    _train(tmp_path, "w", **_diverging(monkeypatch))
  said = capsys.readouterr().err
  assert "cuDNN" not in said and made == [], said
  assert any(v["forward"]["ok"] for v in acc.verdicts())
  assert not any(v["train"]["ok"] for v in acc.verdicts()), acc.verdicts()


def test_a_step_non_finite_on_xla_too_leaves_the_verdicts_as_they_were(
    fake_cudnn, tmp_path, capsys, monkeypatch):
  """cuDNN passes everything and the run diverges: the step redone on XLA's attention is
  non-finite too, so cuDNN was not the cause: the stored verdicts are those the probes
  gave, in this process too, and the line says so."""
  fake_cudnn(lambda q, mask: jnp.zeros(q.shape[:2], bool))
  stored = _verdicts_kept(tmp_path, monkeypatch)
  with pytest.raises(train_lib.NonFiniteLoss):
    _train(tmp_path, "w", **_diverging(monkeypatch))
  (machine,) = stored().values()
  assert machine and all(v["train"][0] and v["forward"][0] for v in machine.values()), machine
  assert all(v["train"]["ok"] for v in acc.verdicts()), acc.verdicts()
  said = capsys.readouterr().err
  lines = [line for line in said.splitlines() if "cuDNN" in line]
  assert len(lines) == 1 and re.fullmatch(
      r"step 2: non-finite loss or gradient with cuDNN's attention \(query x key lengths "
      r"64x64\): non-finite with XLA's attention too .*not cuDNN's doing \(its verdicts "
      r"kept\)", lines[0]), said


def _failing_in_the_run(how: str):
  """XLA's attention that fails in the run's programs (not in the probe's) as cuDNN's was
  seen to in JAX's issues: its forward or backward raising while traced, or its backward
  compiling to a call the compiler refuses (a kernel it does not have)."""
  def run_s(x):
    return not in_probe()

  @jax.custom_vjp
  def attend(q, k, v, mask):
    if run_s(q) and how == "forward raises while traced":
      raise ValueError("cuDNN: no engine for this graph")
    return _xla(q, k, v, mask)

  def fwd(q, k, v, mask):
    return attend(q, k, v, mask), jax.vjp(lambda q, k, v: _xla(q, k, v, mask), q, k, v)[1]

  def bwd(vjp, g):
    dq, dk, dv = vjp(g)
    if run_s(g) and how == "backward raises while traced":
      raise NotImplementedError("cuDNN's backward: unsupported strides")
    if run_s(g) and how == "backward fails to compile":
      dq = jax.ffi.ffi_call("__cudnn$fmhaBackwardEmulated",
                            jax.ShapeDtypeStruct(dq.shape, dq.dtype))(dq)
    return dq, dk, dv, None
  attend.defvjp(fwd, bwd)
  return attend


@pytest.mark.parametrize("how, why", [
    pytest.param("forward raises while traced",
                 r"ValueError: cuDNN: no engine for this graph, while traced",
                 marks=pytest.mark.slow, id="forward-raises"),
    pytest.param("backward raises while traced",
                 r"NotImplementedError: cuDNN's backward: unsupported strides",
                 marks=pytest.mark.slow, id="backward-raises"),
    pytest.param("backward fails to compile", r"JaxRuntimeError: NOT_FOUND: No FFI handler .*",
                 id="backward-fails-to-compile")])
def test_a_train_step_failing_on_cudnn_goes_on_with_xla(fake_cudnn, tmp_path, capsys,
                                                        monkeypatch, how, why):
  """A cuDNN whose probe passes but which fails in the run's train step: the run goes on
  with XLA's attention, says so in one line, and stores the move (a cuDNN call raised, or
  the compiler's error names it) once the redone step has run."""
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _failing_in_the_run(how))
  stored = _verdicts_kept(tmp_path, monkeypatch)
  with warnings.catch_warnings(record=True):   # the evaluation's calls fall back (forward)
    warnings.simplefilter("always")
    result, _ = _train(tmp_path, "w")
  said = capsys.readouterr().err
  lines = [line for line in said.splitlines() if "cuDNN" in line]
  assert len(lines) == 1 and re.fullmatch(
      rf"step 1: cuDNN's attention failed \({why}; query x key lengths [\dx, ]+\): moved to "
      r"XLA's attention and redid the step \(kept for later runs(: [\dx, ]+)?\)", lines[0]), said
  assert result.step == 4 and np.isfinite(result.train_metrics["loss"])
  (machine,) = stored().values()
  moved = [v for v in machine.values() if not v["train"][0]]
  assert moved and all("failed (step 1)" in v["train"][1] for v in moved), machine


def test_verdicts_of_another_probe_are_probed_again(fake_cudnn, tmp_path, monkeypatch):
  """A stored verdict holds for the probe that gave it: a new PROBE_VERSION probes again."""
  _verdicts_kept(tmp_path, monkeypatch)
  fake_cudnn(lambda q, mask: jnp.zeros(q.shape[:2], bool))
  probes = []
  real_probe = acc._probe
  monkeypatch.setattr(acc, "_probe", lambda *a, **kw: probes.append(1) or real_probe(*a, **kw))
  x, mask = jnp.ones((8, 32, 2, 16), jnp.bfloat16), jnp.ones((8, 1, 32, 32), bool)
  monkeypatch.setattr(acc, "PROBE_VERSION", 1, raising=False)
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 2
  monkeypatch.setattr(acc, "_VERDICTS", {})                  # a new process, same probe
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 2
  monkeypatch.setattr(acc, "PROBE_VERSION", 2, raising=False)
  monkeypatch.setattr(acc, "_VERDICTS", {})                  # a new process, a new probe
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 4


# --- the probe: each real row, large logits, the run's batch; tied to its version ----------

def _off_in_one_row(q, k, v, mask):
  """XLA's attention with one query row of one head 25% off: within 2% over the tensor."""
  return _xla(q, k, v, mask).at[0, 1, 0].multiply(1.25)


def _nan_on_large_logits(q, k, v, mask):
  """XLA's attention, NaN in every query row with a logit past ±40 (the H100's NaN came
  from a logsumexp past float32's exp range)."""
  logits = jnp.einsum("bqhd,bkhd->bqhk", q.astype(jnp.float32), k.astype(jnp.float32))
  large_BxQ = (jnp.abs(logits) / np.sqrt(q.shape[-1]) > 40).any(axis=(2, 3))
  return _nan_where(large_BxQ, _xla(q, k, v, mask))


@pytest.mark.parametrize("fake, forward, says", [
    (_off_in_one_row, "xla", r"cuDNN's out is off in row 0, position 1, head 0"),
    (_nan_on_large_logits, "xla", r"cuDNN gave non-finite out"),
    (_failing_cudnn(lambda q, mask: jnp.broadcast_to(q.shape[0] > 3, q.shape[:2])), "cudnn",
     r"cuDNN gave non-finite dq")])
def test_the_probe_checks_every_real_row_large_logits_and_the_run_s_batch(
    fake_cudnn, monkeypatch, fake, forward, says):
  """Three cuDNNs the probe of 3 rows of N(0, 1) logits, checked over the whole tensor,
  passed: one row of the output 25% off (the tensor 1.5% off), NaN where logits are large,
  NaN gradients at more rows than 3. The probe refuses each, saying why."""
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", fake)
  x, mask = jnp.ones((8, 64, 2, 16), jnp.bfloat16), jnp.ones((8, 1, 64, 64), bool)
  assert acc.choose(x, x, mask) == (forward, "xla")
  (v,) = acc.verdicts()
  assert re.match(says, v["forward" if forward == "xla" else "train"]["reason"]), v


def test_the_probe_passes_cudnn_within_bf16_rounding_of_xla(fake_cudnn, monkeypatch):
  """XLA's attention with its output and gradients moved by 0.4% (more than bf16's rounding
  at 1.0, under 2%) passes the probe: the rows' bounds are not XLA's own numbers."""
  @jax.custom_vjp
  def close(q, k, v, mask):
    return (_xla(q, k, v, mask) * 1.004).astype(q.dtype)
  close.defvjp(lambda q, k, v, mask: (close(q, k, v, mask), jax.vjp(
      lambda q, k, v: _xla(q, k, v, mask), q, k, v)[1]),
      lambda vjp, g: tuple(x * 1.004 for x in vjp(g)) + (None,))
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", close)
  x, mask = jnp.ones((8, 64, 2, 16), jnp.bfloat16), jnp.ones((8, 1, 64, 64), bool)
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn"), acc.verdicts()


# The probe's section of kernels/accelerator.py, hashed as Python reads it (no comments or
# docstrings), for each PROBE_VERSION since: a change to the probe without a new version
# fails below. With a new version, add its hash here.
PROBE_HASHES = {3: "adb147ce4b12e10e"}


def _probe_section_hash() -> str:
  text = Path(acc.__file__).read_text()
  start = text.index("\n# --- the probe")
  tree = ast.parse(text[start:text.index("\n# ---", start + 1)])

  def canonical(node) -> str:   # fields left empty skipped: the same across Pythons
    if isinstance(node, list):
      return "[" + ",".join(map(canonical, node)) + "]"
    if not isinstance(node, ast.AST):
      return repr(node)
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      body = body[1:]   # its docstring
    fields = [(f, body if f == "body" else getattr(node, f, None)) for f in node._fields]
    return f"{type(node).__name__}(" + " ".join(
        f"{f}={canonical(v)}" for f, v in fields if v not in (None, [])) + ")"
  return hashlib.sha256(canonical(tree).encode()).hexdigest()[:16]


def test_the_probe_s_code_changes_only_with_its_version():
  """The probe (its inputs, tolerances, what it runs and compares) is one section of
  accelerator.py, and its hash is the one kept for PROBE_VERSION: stored verdicts of another
  probe are never reused as this one's."""
  text = Path(acc.__file__).read_text()
  section = text[text.index("\n# --- the probe"):]
  section = section[:section.index("\n# ---", 1)]
  for name in ("_probe", "_probe_inputs", "_probe_mask", "_worst_row", "TOLERANCE"):
    assert re.search(rf"^(def {name}\(|{name} = )", section, re.M), name
  assert PROBE_HASHES.get(acc.PROBE_VERSION) == _probe_section_hash(), (
      f"the probe's code changed: raise PROBE_VERSION and keep {_probe_section_hash()!r} "
      f"for it in PROBE_HASHES")


# --- which devices reach cuDNN at all -----------------------------------------------------

@pytest.mark.parametrize("attributes, refused", [
    (("gpu", "PJRT C API\ncuda 13000", "9.0"), None),                     # H100, H200
    (("gpu", "cuda 12080", "8.0"), None),                                 # A100
    (("gpu", "cuda 12080", "8.6"), None),
    (("gpu", "cuda 12080", "12.0"), None),
    (("gpu", "cuda 12080", "7.5"), "compute capability 7.5"),             # T4 (Colab)
    (("gpu", "cuda 12080", "7.0"), "compute capability 7.0"),             # V100
    (("gpu", "PJRT C API\nrocm 60300", "gfx942"), "a GPU without CUDA"),  # MI300
    (("cpu", "cpu", None), "backend cpu"),
    (("tpu", "PJRT C API\nTPU", None), "backend tpu")])
def test_only_cuda_gpus_of_compute_capability_8_reach_cudnn(attributes, refused):
  """The gate decides on what JAX says of a device (platform, platform_version,
  compute_capability)."""
  said = acc.cudnn_refusal(*attributes)
  assert (said is None) if refused is None else said.startswith(refused), said


def test_a_refused_device_takes_xla_without_a_probe(monkeypatch):
  """This machine's device as JAX describes it is read for the gate; a T4's attributes
  take XLA's attention for every form without probing (its cuDNN graph build would crash
  the process); an H100's probe and take cuDNN where the probe passes."""
  platform, _, capability = acc._device_attributes()
  assert platform == jax.devices()[0].platform
  assert (capability is not None) == (platform == "gpu")
  monkeypatch.setattr(acc, "_VERDICTS", {})
  monkeypatch.setattr(acc, "_verdicts_file", lambda: None)
  monkeypatch.delenv(acc.ENV, raising=False)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _xla)   # a cuDNN that would pass
  probes = []
  real_probe = acc._probe
  monkeypatch.setattr(acc, "_probe", lambda *a, **kw: probes.append(a) or real_probe(*a, **kw))
  x, mask = jnp.ones((4, 32, 2, 16), jnp.bfloat16), jnp.ones((4, 1, 32, 32), bool)
  monkeypatch.setattr(acc, "_device_attributes", lambda: ("gpu", "cuda 12080", "7.5"))
  assert acc.choose(x, x, mask) == ("xla", "xla") and probes == [] and acc.verdicts() == []
  monkeypatch.setattr(acc, "_device_attributes", lambda: ("gpu", "cuda 12080", "9.0"))
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn") and len(probes) == 2


@pytest.mark.parametrize("error", [
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.",
    "DEADLINE_EXCEEDED: Barrier timed out. Id: seq2seq"])
def test_a_probe_out_of_memory_or_time_is_no_verdict(fake_cudnn, tmp_path, monkeypatch,
                                                     error):
  """A probe that ran out of memory (another process held the GPU) or time says nothing of
  cuDNN: XLA's attention in this process, nothing stored, and the next process probes
  again (here, on a cuDNN that then passes)."""
  stored = _verdicts_kept(tmp_path, monkeypatch)

  def failing(q, k, v, mask):
    raise jax.errors.JaxRuntimeError(error)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", failing)
  x, mask = jnp.ones((4, 32, 2, 16), jnp.bfloat16), jnp.ones((4, 1, 32, 32), bool)
  assert acc.choose(x, x, mask) == ("xla", "xla")
  (v,) = acc.verdicts()
  assert error.split(":")[0] in v["forward"]["reason"], v
  assert not (tmp_path / "attention_verdicts.json").exists() or not any(stored().values())
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", _xla)
  monkeypatch.setattr(acc, "_VERDICTS", {})                  # a new process
  assert acc.choose(x, x, mask) == ("cudnn", "cudnn")
