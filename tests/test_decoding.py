"""Decoding with the Transformer: the cached loop against the full model recomputed step by
step, in every strategy, phase, head variant and dtype."""
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import decoding as dec
from seq2seq import search
from seq2seq.kernels import cpu
from seq2seq.search import Beam, Greedy, Sample
from seq2seq.errors import UserError
from seq2seq.layout import stack_layers, unroll_layers
from seq2seq.model import Transformer

PAD, BOS = 0, 1
V = 40
CFG = seq2seq.get_config("tiny", vocab_size=V).replace(dropout_rate=0.0, max_len=64)
SRC_LENS = (7, 4, 5)   # non-pad tokens; the batch is right-padded to 7
SRC_END = 3            # every source ends with this token (the model does not care which)


def _sources():
  rng = np.random.default_rng(0)
  src = np.zeros((len(SRC_LENS), max(SRC_LENS)), np.int32)
  for b, n in enumerate(SRC_LENS):
    src[b, :n - 1] = rng.integers(4, V, n - 1)
    src[b, n - 1] = SRC_END
  return src


def _random_params(seed, cfg=CFG):
  """Random weights of the right shapes, without compiling `init` (compiles dominate the
  run time of this file): LayerNorm scales 1, everything else small normal noise; drawn
  per layer, then stacked as `cfg` stores them (the same model whatever the layout)."""
  x = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(Transformer(cfg.replace(scan_layers=False)).init, jax.random.key(0),
                          x, x)
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    if path[-1].key == "scale":
      return np.ones(leaf.shape, np.float32)
    std = cfg.d_model ** -0.5 if path[-1].key == "embedding" else 0.15
    return rng.normal(0.0, std, leaf.shape).astype(np.float32)
  params = jax.tree_util.tree_map_with_path(fill, shapes)
  return stack_layers(params) if cfg.scan_layers else params


@pytest.fixture(scope="module")
def params():
  return _random_params(0)


@pytest.fixture(scope="module")
def ref(params):
  """Greedy by hand: at every step the full model (`model.apply(params, src, tgt_in)`,
  encoder included) is recomputed on the prefix and the argmax over non-pad tokens is
  appended, in a Python loop. The prefix sits in a fixed-width buffer padded with PAD so
  that one compilation serves every step: the model's causal and padding masks hide the
  padding from position t (tests/test_model.py checks those masks).

  Nothing but PAD is masked, so the reference does not depend on the EOS id: EOS is chosen
  afterwards among the generated tokens so that rows end at different steps.
  """
  src = _sources()
  L = max(SRC_LENS) + dec.EXTRA_LEN
  apply = jax.jit(Transformer(CFG).apply)
  tgt_in = np.zeros((src.shape[0], L), np.int32)
  tgt_in[:, 0] = BOS
  toks, logits = [], []
  for t in range(L):
    lg = np.asarray(apply(params, src, tgt_in))[:, t]
    nxt = np.where(np.arange(V) == PAD, -np.inf, lg).argmax(-1)
    toks.append(nxt)
    logits.append(lg)
    if t + 1 < L:
      tgt_in[:, t + 1] = nxt
  toks, logits = np.stack(toks, 1), np.stack(logits, 1)
  limits = np.array(SRC_LENS) + dec.EXTRA_LEN

  def ends(tok):  # each row's length if `tok` were EOS (None: runs to its limit)
    hits = [np.flatnonzero(toks[b, :limits[b]] == tok) for b in range(len(SRC_LENS))]
    return [int(h[0]) + 1 if h.size else None for h in hits]

  def interest(tok):
    e = ends(tok)
    return (len({x for x in e if x is not None and x > 1}) + (None in e), -tok)

  eos = max(sorted({int(t) for t in np.unique(toks)} - {PAD, BOS}), key=interest)
  lengths = [e if e is not None else int(limits[b]) for b, e in enumerate(ends(eos))]
  return dict(src=src, eos=eos, toks=toks, logits=logits, lengths=lengths)


def _greedy(params, src, eos, **kw):
  return dec.decode(CFG, params, src, Greedy(), bos_id=BOS, eos_id=eos, return_logits=True,
                    **kw)


@pytest.fixture(scope="module")
def greedy(params, ref):
  return _greedy(params, ref["src"], ref["eos"])


def _log_softmax_allowed(logits):
  x = np.where(np.arange(logits.shape[-1]) == PAD, -np.inf, logits.astype(np.float64))
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------
# The Transformer loop. Every distinct strategy/shape compiles once (~2-4 s), so the tests
# share a few decodes of one small batch.

def test_cached_greedy_equals_argmax_over_full_model(greedy, ref):
  out = greedy
  L = max(SRC_LENS) + dec.EXTRA_LEN
  assert out.tokens.shape == (3, 1, L) and out.scores.shape == (3, 1)
  assert len(set(ref["lengths"])) > 1                   # rows end at different steps
  for b, n in enumerate(ref["lengths"]):
    assert out.lengths[b, 0] == n
    np.testing.assert_array_equal(out.tokens[b, 0, :n], ref["toks"][b, :n])
    assert (out.tokens[b, 0, n:] == PAD).all()
    np.testing.assert_allclose(out.logits[b, :n], ref["logits"][b, :n], atol=1e-5, rtol=0)
    logp = _log_softmax_allowed(ref["logits"][b, :n])
    want = logp[np.arange(n), ref["toks"][b, :n]].sum()
    assert out.scores[b, 0] == pytest.approx(want, abs=1e-3)
  # Rows that never emit EOS stop at their own source length + 50.
  for b, n in enumerate(ref["lengths"]):
    if ref["eos"] not in ref["toks"][b, :n]:
      assert n == SRC_LENS[b] + dec.EXTRA_LEN


BEAM = Beam(size=3, alpha=0.6, n_best=3)
BEAM_KW = dict(bos_id=BOS, max_len=10, min_len=10)   # EOS only allowed at the limit


@pytest.fixture(scope="module")
def beam(params, ref):
  return dec.decode(CFG, params, ref["src"], BEAM, eos_id=ref["eos"], **BEAM_KW)


@pytest.mark.slow   # compiles a decode loop per length and strategy
def test_batch_of_different_lengths_decodes_as_each_alone(params, ref, greedy, beam):
  alone_src = ref["src"][1:2, :SRC_LENS[1]]             # unpadded, so a shorter buffer
  alone = _greedy(params, alone_src, ref["eos"])
  n = SRC_LENS[1] + dec.EXTRA_LEN
  assert alone.tokens.shape == (1, 1, n)
  np.testing.assert_array_equal(alone.tokens, greedy.tokens[1:2, :, :n])
  assert (greedy.tokens[1, :, n:] == PAD).all()
  np.testing.assert_array_equal(alone.lengths, greedy.lengths[1:2])
  np.testing.assert_allclose(alone.scores, greedy.scores[1:2], atol=1e-4)
  alone = dec.decode(CFG, params, alone_src, BEAM, eos_id=ref["eos"], **BEAM_KW)
  np.testing.assert_array_equal(alone.tokens, beam.tokens[1:2])
  np.testing.assert_array_equal(alone.lengths, beam.lengths[1:2])
  np.testing.assert_allclose(alone.scores, beam.scores[1:2], atol=1e-4)


def test_cached_beam_equals_full_recompute_beam(params, ref, beam):
  """EOS is forbidden until the limit so beams are reordered (and the cache gathered) at
  every step; the uncached baseline keeps no cache, so any reordering slip shows."""
  full = dec.decode(CFG, params, ref["src"], BEAM, eos_id=ref["eos"], full_recompute=True,
                    **BEAM_KW)
  assert beam.tokens.shape == (3, 3, 10)
  np.testing.assert_array_equal(beam.tokens, full.tokens)
  np.testing.assert_allclose(beam.scores, full.scores, atol=1e-4)
  assert (beam.lengths == 10).all()
  for b in range(3):   # hypotheses ended by EOS first, then ones cut at the limit; best first
    ended = beam.tokens[b, :, -1] == ref["eos"]
    assert not (ended[1:] & ~ended[:-1]).any()
    for group in (beam.scores[b][ended], beam.scores[b][~ended]):
      assert (np.diff(group) <= 0).all()
  assert all(len({tuple(h) for h in row}) == 3 for row in beam.tokens)  # distinct


@pytest.mark.slow   # beam search with and without a cache, over three phases (~5 s)
def test_cached_beam_over_three_cache_phases_equals_full_recompute(params, ref):
  """40 steps: the cache grows 16 -> 24 -> 40 slots (`cache_phases`) as beams reorder it."""
  kw = dict(BEAM_KW, max_len=40, min_len=40)
  assert search.cache_phases(40) == [16, 24, 40]
  cached = dec.decode(CFG, params, ref["src"], BEAM, eos_id=ref["eos"], **kw)
  full = dec.decode(CFG, params, ref["src"], BEAM, eos_id=ref["eos"], full_recompute=True, **kw)
  np.testing.assert_array_equal(cached.tokens, full.tokens)
  np.testing.assert_allclose(cached.scores, full.scores, atol=1e-4)


def test_params_are_an_argument_not_a_constant(params, ref, greedy):
  src, eos, a = ref["src"], ref["eos"], greedy
  jitted = dec.decode_jit_for(CFG)
  before = jitted._cache_size()
  other = _random_params(1)
  b = _greedy(other, src, eos)
  c = _greedy(params["params"], src[::-1].copy(), eos)        # bare params tree, new data
  assert jitted._cache_size() == before                       # no recompilation
  assert not np.array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(c.tokens, a.tokens[::-1])


@pytest.mark.parametrize("dots", [pytest.param("xla", marks=pytest.mark.slow), "ynnpack"])
def test_f32_loop_decodes_the_same_with_either_dot_library(params, ref, greedy, beam, dots,
                                                           monkeypatch):
  """The f32 loop's dots go to XLA's own emitter (no AVX-512) or to YNNPACK (AVX-512);
  on an accelerator neither option applies."""
  monkeypatch.setattr(cpu, "F32_DOTS", dots)
  on_cpu = jax.default_backend() == "cpu"
  assert cpu.decode_compiler_options(CFG) == (cpu.XLA_DOTS if dots == "xla" and on_cpu else {})
  g = _greedy(params, ref["src"], ref["eos"])
  b = dec.decode(CFG, params, ref["src"], BEAM, eos_id=ref["eos"], **BEAM_KW)
  np.testing.assert_array_equal(g.tokens, greedy.tokens)
  np.testing.assert_allclose(g.logits, greedy.logits, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(b.tokens, beam.tokens)
  np.testing.assert_allclose(b.scores, beam.scores, atol=1e-5, rtol=0)
  if jax.default_backend() == "cpu":
    hlo = dec.decode_jit_for(CFG).lower(
        params, jnp.asarray(ref["src"]), jax.random.key(0), cfg=CFG, strategy=Greedy(),
        max_len=16, per_row_limit=False, bos_id=BOS, eos_id=ref["eos"], pad_id=PAD,
        min_len=0, full_recompute=False, return_logits=False).compile().as_text()
    assert ("__ynn_fusion" in hlo) == (dots == "ynnpack")


@pytest.mark.parametrize("kw, msg", [
    (dict(src=np.full((1, 65), 5)), "source length 65 exceeds"),
    (dict(bos_id=0), "must differ"),
    (dict(bos_id=2, eos_id=3, pad_id=1), "pad_id must be 0"),
    (dict(eos_id=V), "eos_id must be a token id"),
    (dict(max_len=65), "max_len must be in"),
    (dict(strategy=Beam(), return_logits=True), "return_logits"),
    (dict(strategy="beam"), "strategy must be"),
    (dict(strategy=Beam(size=V + 1)), rf"beam size {V + 1} is larger than the vocabulary \({V} "),
])
def test_bad_decode_arguments_are_user_errors(params, kw, msg):
  args = dict(src=np.full((1, 4), 5), strategy=Greedy(), bos_id=BOS, eos_id=2)
  args.update(kw)
  with pytest.raises(UserError, match=msg) as e:
    dec.decode(CFG, params, args.pop("src"), args.pop("strategy"), **args)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("variant", [dict(tie_output=False), dict(share_embeddings=False)])
def test_decode_head_of_every_variant_matches_teacher_forcing(ref, variant):
  """The loop's head (`head_DxV`: laid out [D, V] once per call) gives the logits of
  `Transformer.output_head` for an untied projection with its bias and for a tied target
  embedding that the source does not share."""
  cfg = CFG.replace(**variant)
  params = _random_params(2, cfg)
  if "logits_dense" in params["params"]:   # a visible bias: zero would hide a missing add
    params["params"]["logits_dense"]["bias"] += 0.5 * np.arange(V, dtype=np.float32) / V
  out = dec.decode(cfg, params, ref["src"], Greedy(), bos_id=BOS, eos_id=ref["eos"],
                   max_len=6, min_len=6, return_logits=True)
  tgt_in = np.concatenate([np.full((3, 1), BOS), np.asarray(out.tokens[:, 0, :-1])], 1)
  want = np.asarray(Transformer(cfg).apply(params, ref["src"], tgt_in.astype(np.int32)))
  np.testing.assert_allclose(out.logits, want, atol=1e-5, rtol=0)


@pytest.mark.slow   # ~10 s of compiling: the full suite runs it
def test_bf16_decode_matches_the_bf16_model_teacher_forced(params, ref):
  """dtype=bfloat16: the loop runs on bf16 copies of the matrices (`decode_params`, the
  embedding tables excepted: they are only looked up). That is exactly what the bf16 model
  computes from the f32 params in training, so greedy tokens == argmax of the teacher-forced
  bf16 model on the decoded prefix; passing the copies in gives the same result; and bf16
  differs from f32 (so the cast really happened)."""
  cfg = CFG.replace(dtype="bfloat16")
  out = dec.decode(cfg, params, ref["src"], Greedy(), bos_id=BOS, eos_id=ref["eos"],
                   max_len=8)
  tgt_in = np.concatenate([np.full((3, 1), BOS), np.asarray(out.tokens[:, 0, :-1])], 1)
  logits = np.array(Transformer(cfg).apply(params, ref["src"], tgt_in.astype(np.int32)))
  logits[..., PAD] = -np.inf
  for b in range(3):
    n = int(out.lengths[b, 0])
    assert n >= 2
    np.testing.assert_array_equal(out.tokens[b, 0, :n], logits[b, :n].argmax(-1))
  f32 = Transformer(CFG).apply(params, ref["src"], tgt_in.astype(np.int32))
  assert float(jnp.abs(f32 - logits.clip(-1e9)).max()) > 1e-4
  cast = dec.decode_params(cfg, params)
  again = dec.decode(cfg, cast, ref["src"], Greedy(), bos_id=BOS, eos_id=ref["eos"],
                     max_len=8)
  np.testing.assert_array_equal(again.tokens, out.tokens)
  np.testing.assert_array_equal(again.scores, out.scores)


def test_decode_params_casts_the_matrices_but_not_embeddings_or_vectors(params):
  """The cpu table's (a CPU decodes a few rows at a time, bound by reading the weights);
  the accelerator table leaves the params as they are."""
  cfg = CFG.replace(dtype="bfloat16", kernels="cpu")
  unrolled = unroll_layers(params)
  assert dec.decode_params(cfg.replace(kernels="accelerator"), unrolled) is unrolled
  for a, b in zip(*(jax.tree_util.tree_leaves(dec.decode_params(
      cfg.replace(kernels="accelerator"), p)) for p in (params, unrolled))):
    np.testing.assert_array_equal(a, b)   # stacked layers come unrolled
  cast = dec.decode_params(cfg, params)
  leaves = jax.tree_util.tree_leaves_with_path(cast)
  assert len(leaves) == len(jax.tree_util.tree_leaves(unrolled))
  kinds = set()
  for path, x in leaves:
    name = path[-1].key
    want = jnp.float32 if x.ndim < 2 or name == "embedding" else jnp.bfloat16
    assert x.dtype == want, (jax.tree_util.keystr(path), x.dtype)
    kinds.add((name, x.dtype == jnp.bfloat16))
  assert {("embedding", False), ("kernel", True), ("bias", False)} <= kinds
  assert dec.decode_params(CFG, unrolled) is unrolled    # float32: nothing to do
  assert dec.decode_params(cfg, cast) is cast            # already cast: nothing to do
