"""Decoding: the cached loop against the full model, strategies against each other, beam
search against brute force on hand-built distributions, and the validation of strategies."""
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import decoding as dec
from seq2seq.decoding import Beam, Greedy, Sample
from seq2seq.errors import UserError
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
  run time of this file): LayerNorm scales 1, everything else small normal noise."""
  x = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), x, x)
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    if path[-1].key == "scale":
      return np.ones(leaf.shape, np.float32)
    std = cfg.d_model ** -0.5 if path[-1].key == "embedding" else 0.15
    return rng.normal(0.0, std, leaf.shape).astype(np.float32)
  return jax.tree_util.tree_map_with_path(fill, shapes)


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


def test_cached_beam_over_three_cache_phases_equals_full_recompute(params, ref):
  """40 steps: the cache grows 16 -> 24 -> 40 slots (`cache_phases`) as beams reorder it."""
  kw = dict(BEAM_KW, max_len=40, min_len=40)
  assert dec.cache_phases(40) == [16, 24, 40]
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


@pytest.mark.parametrize("dots", ["xla", "ynnpack"])
def test_f32_loop_decodes_the_same_with_either_dot_library(params, ref, greedy, beam, dots,
                                                           monkeypatch):
  """The f32 loop's dots go to XLA's own emitter (no AVX-512) or to YNNPACK (AVX-512)."""
  monkeypatch.setattr(dec, "F32_DOTS", dots)
  assert dec.cpu_f32_decode_options() == (dec.XLA_DOTS if dots == "xla" else {})
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


def test_cpu_has_avx512_reads_the_flags_line(monkeypatch):
  assert dec.cpu_has_avx512("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
  assert not dec.cpu_has_avx512("flags\t\t: fpu sse2 avx2 avx512_bf16\n")     # no avx512f
  assert not dec.cpu_has_avx512("model name\t: avx512f\nflags\t\t: fpu avx2\n")
  assert not dec.cpu_has_avx512("")
  monkeypatch.setattr(dec, "F32_DOTS", "eigen")
  with pytest.raises(UserError, match="F32_DOTS must be auto, xla or ynnpack"):
    dec.cpu_f32_decode_options()


class _Chars:
  """A tokenizer stand-in: each letter a-z is one id (3 + index); BOS 1, EOS 2, PAD 0."""
  bos_id, eos_id, pad_id = 1, 2, 0

  def encode(self, s):
    return [3 + ord(ch) - ord("a") for ch in s]

  def decode(self, ids):
    return "".join(chr(ord("a") + i - 3) if 3 <= i < 29 else f"<{i}>" for i in ids)


def test_translate_keeps_input_order_and_matches_decode(params):
  tok = _Chars()
  sentences = ["hello", "a", "translation", "abc", "zz", "quick"]
  got = dec.translate(params, CFG, tok, sentences, Greedy(), batch_size=8)
  assert len(got) == len(sentences)
  assert dec.translate(params, CFG, tok, sentences[::-1], Greedy(), batch_size=8) == got[::-1]
  # The same batch by hand (sorted by length, padded to 16 columns and 8 rows).
  order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
  src = np.zeros((8, 16), np.int32)
  src[len(order):, 0] = tok.eos_id
  for r, i in enumerate(order):
    ids = tok.encode(sentences[i]) + [tok.eos_id]
    src[r, :len(ids)] = ids
  res = dec.decode(CFG, params, src, Greedy(), bos_id=tok.bos_id, eos_id=tok.eos_id)
  for r, ids in enumerate(res.token_lists(tok.eos_id)[:len(order)]):
    assert got[order[r]] == tok.decode(ids)
  with pytest.raises(UserError, match="sentence 0 has 70 tokens"):
    dec.translate(params, CFG, tok, ["a" * 69], Greedy())


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


# ---------------------------------------------------------------------------------------
# Strategies are validated data.

@pytest.mark.parametrize("make, msg", [
    (lambda: Sample(temperature=0.0), "temperature must be > 0"),
    (lambda: Sample(temperature=-1.0), "temperature must be > 0"),
    (lambda: Sample(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda: Sample(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda: Sample(top_k=-1), "top_k must be"),
    (lambda: Sample(top_k=2.5), "top_k must be"),
    (lambda: Beam(size=0), "beam size"),
    (lambda: Beam(alpha=-0.5), "alpha"),
    (lambda: Beam(size=2, n_best=3), "n_best"),
    (lambda: dec.get_strategy("beam", top_k=5), "top_k cannot be used with beam"),
    (lambda: dec.get_strategy("beam", temperature=0.5), "temperature cannot be used with beam"),
    (lambda: dec.get_strategy("greedy", top_p=0.9), "top_p cannot be used with greedy"),
    (lambda: dec.get_strategy("sample", temperature=0), "temperature must be > 0"),
    (lambda: dec.get_strategy("sample", beam_size=4), "beam_size cannot be used with sample"),
    (lambda: dec.get_strategy("nucleus"), "unknown decoding strategy"),
])
def test_bad_strategies_raise_one_line_user_errors(make, msg):
  with pytest.raises(UserError, match=msg) as e:
    make()
  assert "\n" not in str(e.value)


def test_get_strategy_builds_the_dataclasses():
  assert dec.get_strategy("greedy") == Greedy()
  assert dec.get_strategy("sample", top_k=40, temperature=0.8) == Sample(0.8, 40, 1.0)
  assert dec.get_strategy("beam", beam_size=5, alpha=1.0, n_best=2) == Beam(5, 1.0, 2)
  assert dec.get_strategy("beam") == Beam(size=4, alpha=0.6, n_best=1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    Beam().size = 3


# ---------------------------------------------------------------------------------------
# What decode.py needs: n-best translation, truncation, empty lines, flags, input lines.

def test_translate_nbest_scores_truncates_and_skips_empty_lines(params, monkeypatch):
  tok = _Chars()
  beam = Beam(size=2, alpha=0.6, n_best=2)
  done, results, decode = [], [], dec.decode
  monkeypatch.setattr(dec, "decode", lambda *a, **k: results.append(decode(*a, **k))
                      or results[-1])
  long = "a" * 80                              # 81 tokens with EOS; the model reads 64
  out = dec.translate_nbest(params, CFG, tok, ["hello", "", "abc", long], beam,
                            progress=done.append)
  (res,) = results                             # one batch of 3 sentences (4 rows)
  assert out.num_tokens == res.lengths[:3].sum() > 0
  assert out.truncated == [3]
  assert done == [1, 3]                        # the empty line first, then one batch
  assert out.texts[1] == [""] and out.scores[1] == [0.0]
  for i in (0, 2, 3):
    assert len(out.texts[i]) == 2 and out.texts[i][0] != out.texts[i][1]
    assert out.scores[i][0] >= out.scores[i][1] > -np.inf
  # Truncation keeps EOS: the cut source is the 63 first tokens + EOS, i.e. "a" * 63.
  same = dec.translate_nbest(params, CFG, tok, ["hello", "", "abc", "a" * 63], beam)
  assert same.truncated == [] and same.texts == out.texts and same.scores == out.scores
  # The best hypothesis is what translate() returns (which neither cuts nor skips).
  assert dec.translate(params, CFG, tok, ["hello", "abc", "a" * 63], beam) == \
      [out.texts[i][0] for i in (0, 2, 3)]
  with pytest.raises(UserError, match="sentence 0 has 81 tokens"):
    dec.translate_nbest(params, CFG, tok, [long], beam, truncate=False)
  # Empty lines never reach the model.
  monkeypatch.setattr(dec, "decode", lambda *a, **k: pytest.fail("decoded an empty line"))
  empty = dec.translate_nbest(params, CFG, tok, ["", ""], beam)
  assert empty == dec.Translations([[""], [""]], [[0.0], [0.0]], 0, [])
  with pytest.raises(UserError, match="max_len must be in"):
    dec.translate_nbest(params, CFG, tok, [""], beam, max_len=CFG.max_len + 1)


def test_translate_chunks_is_translate_nbest_chunk_by_chunk(params):
  """Chunk k of the lazily read sentences is translate_nbest of those sentences at
  fold_in(rng, k); indices of truncated sentences count from the first sentence."""
  tok, strategy = _Chars(), Sample(temperature=2.0)
  sentences = ["hello", "", "abc", "a" * 80, "xyz", "hi", "a" * 70]
  read = []

  def lazily():
    for s in sentences:
      read.append(s)
      yield s

  chunks = dec.translate_chunks(params, CFG, tok, lazily(), strategy, chunk_size=3, rng=5)
  offset, first = next(chunks)
  assert offset == 0 and len(read) == 3 and len(first.texts) == 3   # only one chunk read
  got = [(offset, first)] + list(chunks)
  assert [o for o, _ in got] == [0, 3, 6]
  key = jax.random.key(5)
  for k, (offset, out) in enumerate(got):
    want = dec.translate_nbest(params, CFG, tok, sentences[offset:offset + 3], strategy,
                               rng=jax.random.fold_in(key, k))
    assert out.texts == want.texts and out.scores == want.scores
    assert out.num_tokens == want.num_tokens
    assert out.truncated == [offset + i for i in want.truncated]
  assert [i for _, out in got for i in out.truncated] == [3, 6]
  # A chunk's draw does not depend on what follows it.
  again = next(dec.translate_chunks(params, CFG, tok, sentences[:3], strategy,
                                    chunk_size=3, rng=5))
  assert again[1].texts == got[0][1].texts
  with pytest.raises(UserError, match="chunk_size must be >= 1"):
    next(dec.translate_chunks(params, CFG, tok, sentences, strategy, chunk_size=0))


@pytest.mark.parametrize("flags, want", [
    (dict(), Beam(4, 0.6, 1)),
    (dict(beam_size=8, alpha=1.0, n_best=3), Beam(8, 1.0, 3)),
    (dict(beam_size=1), Greedy()),
    (dict(top_k=5), Sample(1.0, 5, 1.0)),
    (dict(temperature=0.7, top_p=0.9, beam_size=1), Sample(0.7, 0, 0.9)),
    (dict(top_k=5, beam_size=4), "cannot be used with beam search"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.9, n_best=2), "n_best cannot be used with sample"),
    (dict(beam_size=1, alpha=0.6), "alpha cannot be used with greedy"),
    (dict(n_best=5), r"n_best must be an integer in \[1, beam size 4\]"),
    (dict(beam_size=0), "beam size must be"),
])
def test_strategy_from_flags(flags, want):
  if isinstance(want, str):
    with pytest.raises(UserError, match=want) as e:
      dec.strategy_from_flags(**flags)
    assert "\n" not in str(e.value)
  else:
    assert dec.strategy_from_flags(**flags) == want


def test_read_lines(tmp_path):
  import io
  path = tmp_path / "in.txt"
  path.write_bytes(b"\xef\xbb\xbfone\r\n\ntwo\xe2\x80\xa8three\rfour\n")
  want = ["one", "", "two\u2028three\rfour"]   # split at "\n" only
  assert dec.read_lines(path) == dec.read_lines(str(path)) == want
  assert dec.read_lines(io.BytesIO(path.read_bytes())) == want
  latin1 = tmp_path / "latin1.txt"                       # as training refuses it, with the line
  latin1.write_bytes(b"one\ntwo\ncaf\xe9\n")
  with pytest.raises(UserError, match=r"latin1.txt line 3: invalid UTF-8 \(byte 0xe9\)"):
    dec.read_lines(latin1)
  with pytest.raises(UserError, match=r"^standard input line 1: invalid UTF-8 \(byte 0xff\)"):
    dec.read_lines(io.BytesIO(b"\xff\n"))
  assert dec.read_lines(io.StringIO("a\nb")) == ["a", "b"]
  assert dec.read_lines(io.BytesIO(b"")) == []
  with pytest.raises(UserError, match="cannot read .*nope.txt: No such file"):
    dec.read_lines(tmp_path / "nope.txt")
  with pytest.raises(UserError, match="Is a directory"):
    dec.read_lines(tmp_path)


# ---------------------------------------------------------------------------------------
# Search cores on hand-built distributions (no Transformer).

def _table_fn(logp_of_prefix):
  """tokens_to_logits from a Python function prefix (tuple) -> next-token log-probs.

  Every prefix of length < 4 over the 6 ids is precomputed into a table indexed by a
  prefix code, sum of (token + 1) * 7^position, that is kept in the state and extended by
  one token per step, like a KV cache: it is right only if the state follows the beams."""
  vocab, base, depth = 6, 7, 4
  table = np.full((base ** depth, vocab), -1e9, np.float32)
  for n in range(depth):
    for prefix in itertools.product(range(vocab), repeat=n):
      table[sum((t + 1) * base ** i for i, t in enumerate(prefix))] = logp_of_prefix(prefix)
  table = jnp.asarray(table)

  def fn(seq_NxL1, index, code_N):
    tok = lax_index(seq_NxL1, index)
    # Position 0 holds BOS, which is not part of the prefix.
    code_N = jnp.where(index == 0, 0, code_N + (tok + 1) * base ** jnp.maximum(index - 1, 0))
    return table[code_N], code_N

  return fn


def lax_index(seq, index):
  return jax.lax.dynamic_index_in_dim(seq, index, axis=1, keepdims=False)


def _logp(d, default=-1e9):
  out = np.full(6, default, np.float32)
  for tok, p in d.items():
    out[tok] = np.log(p)
  return out


EOS, A, B_, C = 2, 3, 4, 5


def _run_beam(fn, beam, max_len, limits, batch=1, min_len=0, state=None):
  @jax.jit
  def go():
    if state is None:
      init = jnp.zeros((batch * beam.size,), jnp.int32)
    else:
      init = jnp.repeat(state, beam.size, axis=0)
    return dec.beam_search(fn, init, batch_size=batch, beam=beam, max_len=max_len,
                           limits_B=jnp.asarray(limits), bos_id=BOS, eos_id=EOS,
                           pad_id=PAD, min_len=min_len)
  return jax.tree_util.tree_map(np.asarray, go())


def _run_greedy(fn, max_len, batch=1, strategy=Greedy(), state=None):
  @jax.jit
  def go():
    return dec.sample_search(fn, jnp.zeros((batch,), jnp.int32) if state is None else state,
                             batch_size=batch, strategy=strategy, max_len=max_len,
                             limits_B=jnp.full((batch,), max_len), bos_id=BOS, eos_id=EOS,
                             pad_id=PAD, rng=jax.random.key(3))
  return jax.tree_util.tree_map(np.asarray, go())


def _random_lm(vocab=12, scale=3.0):
  """A random "language model" of unbounded depth: the state is a hash of the row's start
  value and of every token fed so far, and the logits are a hash of it and the token id."""
  def mix(x):
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)

  def fn(seq_NxL1, index, hash_N):
    hash_N = mix(hash_N + lax_index(seq_NxL1, index).astype(jnp.uint32) + jnp.uint32(1))
    bits = mix(hash_N[:, None] * jnp.uint32(vocab) + jnp.arange(vocab, dtype=jnp.uint32))
    return scale * (bits >> 8).astype(jnp.float32) / 2.0 ** 24, hash_N
  return fn


def test_cache_phases_grow_to_max_len():
  for max_len in range(1, 321):
    ends = dec.cache_phases(max_len)
    assert ends[-1] == max_len and len(ends) <= 3 and ends == sorted(set(ends)), ends
    for end in ends[:-1]:   # inner ends: even (beam search takes 2 steps per iteration)
      assert end % 8 == 0 and 16 <= end <= 0.75 * max_len, ends
    if max_len >= 64:       # the first phase covers at most a quarter of the steps (+7)
      assert ends[0] <= max_len / 4 + 8, ends
  assert dec.cache_phases(64) == [16, 32, 64] and dec.cache_phases(20) == [20]


def _cache_lm(vocab=12):
  """A toy model with a KV-like cache [N, 1, slots, 1]: step i writes the fed token to slot
  i and its logits hash every slot <= i (integer sums, exact whatever the cache's length),
  so a lost write, a slot read past the cache, or a beam that kept another's cache shows."""
  seen = []

  def mix(x):
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    return x ^ (x >> 15)

  def fn(seq_NxL1, index, cache_Nx1xSx1):
    seen.append(cache_Nx1xSx1.shape[2])
    tok_N = lax_index(seq_NxL1, index).astype(jnp.uint32)
    cache = jax.lax.dynamic_update_slice(cache_Nx1xSx1, tok_N[:, None, None, None], (0, 0, index, 0))
    pos = jnp.arange(cache.shape[2], dtype=jnp.uint32)
    h_N = jnp.sum(jnp.where(pos <= index, mix(cache[:, 0, :, 0] + 7 * pos), 0), -1)
    bits = mix(h_N[:, None] * jnp.uint32(vocab) + jnp.arange(vocab, dtype=jnp.uint32))
    return 3.0 * (bits >> 8).astype(jnp.float32) / 2.0 ** 24, cache
  return fn, seen


@pytest.mark.parametrize("strategy", [Greedy(), Beam(size=3, alpha=0.6, n_best=3)])
def test_phased_loop_equals_one_loop_over_the_whole_cache(strategy):
  """The loop in phases over a growing cache (16, 32, 64 slots) decodes exactly as one loop
  over all 64 slots, for greedy and for beam search (whose cache moves with its beams)."""
  L, rows = 64, 2
  n = rows * getattr(strategy, "size", 1)
  outs, traced = [], []
  for resize in (None, dec.resize_cache):
    fn, seen = _cache_lm()
    kw = dict(batch_size=rows, max_len=L, limits_B=jnp.full((rows,), L), bos_id=BOS,
              eos_id=EOS, pad_id=PAD, min_len=L, resize_state=resize)
    cache = jnp.zeros((n, 1, L, 1), jnp.uint32)
    if isinstance(strategy, Beam):
      run = jax.jit(lambda: dec.beam_search(fn, cache, beam=strategy, **kw))
    else:
      run = jax.jit(lambda: dec.sample_search(fn, cache, strategy=strategy, **kw))
    outs.append(jax.tree_util.tree_map(np.asarray, run()))
    traced.append(sorted(set(seen)))
  assert traced == [[64], [16, 32, 64]]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_array_equal(outs[0].scores, outs[1].scores)
  assert (outs[1].lengths == L).all() and len(np.unique(outs[1].tokens)) > 3


def test_top_k_one_tiny_top_p_and_beam_of_one_are_greedy():
  fn, rows, L = _random_lm(vocab=1200), 8, 16     # a vocabulary long enough for top_k's chunks
  start = jnp.arange(1, rows + 1, dtype=jnp.uint32)
  greedy = _run_greedy(fn, L, rows, state=start)
  assert len(set(greedy.lengths[:, 0].tolist())) > 1          # EOS ends some rows early
  for strategy in (Sample(temperature=0.7, top_k=1), Sample(temperature=1.5, top_p=1e-6)):
    out = _run_greedy(fn, L, rows, strategy, state=start)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_allclose(out.scores, greedy.scores, atol=1e-5)
  out = _run_beam(fn, Beam(size=1, alpha=0.0), L, [L] * rows, batch=rows, state=start)
  np.testing.assert_array_equal(out.tokens, greedy.tokens)
  np.testing.assert_array_equal(out.lengths, greedy.lengths)
  np.testing.assert_allclose(out.scores, greedy.scores, atol=1e-5)


def test_sampling_is_reproducible_at_a_fixed_seed():
  fn, rows, L = _random_lm(), 8, 16
  run = jax.jit(lambda rng: dec.sample_search(
      fn, jnp.arange(1, rows + 1, dtype=jnp.uint32), batch_size=rows,
      strategy=Sample(temperature=1.0, top_p=0.95), max_len=L,
      limits_B=jnp.full((rows,), L), bos_id=BOS, eos_id=EOS, pad_id=PAD, rng=rng))
  a, b, c = run(jax.random.key(7)), run(jax.random.key(7)), run(jax.random.key(8))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.scores, b.scores)
  assert not np.array_equal(a.tokens, c.tokens)
  # decode() takes an int seed, a key or raw key data alike.
  for rng in (7, jax.random.key(7), jax.random.PRNGKey(7)):
    assert jax.random.key_data(dec._as_key(rng)).tolist() == [0, 7]


def test_beam_finds_the_best_sequence_that_greedy_misses():
  # Greedy takes A (0.6), after which everything is poor; B then EOS has p = 0.36.
  def logp(prefix):
    if prefix == ():
      return _logp({A: 0.6, B_: 0.4})
    if prefix[0] == A:
      return _logp({EOS: 0.3, A: 0.25, B_: 0.25, C: 0.2})
    return _logp({EOS: 0.9, C: 0.1})
  fn = _table_fn(logp)
  greedy = _run_greedy(fn, 4)
  assert greedy.tokens[0, 0, 0] == A
  out = _run_beam(fn, Beam(size=2, alpha=0.0, n_best=2), 4, [4])
  np.testing.assert_array_equal(out.tokens[0, 0], [B_, EOS, PAD, PAD])
  assert out.lengths[0, 0] == 2
  assert out.scores[0, 0] == pytest.approx(math.log(0.36), abs=1e-5)
  # Second best: the best of the A-branch, A then EOS (0.18), which greedy returns.
  assert out.scores[0, 1] == pytest.approx(math.log(0.18), abs=1e-5)
  np.testing.assert_array_equal(greedy.tokens[0, 0, :2], [A, EOS])
  assert out.tokens[0, 1, 1] == EOS and out.lengths[0, 1] == 2


def test_length_penalty_decides_between_short_and_long():
  # "EOS" now: p 0.55, length 1. "A EOS": p 0.45 * 0.95 = 0.4275, length 2.
  def logp(prefix):
    if prefix == ():
      return _logp({EOS: 0.55, A: 0.45})
    return _logp({EOS: 0.95, A: 0.05})
  fn = _table_fn(logp)
  lp = lambda n, a: ((5 + n) / 6) ** a
  for alpha, want, size in ((0.0, [EOS], 1), (0.6, [EOS], 2), (3.0, [A, EOS], 1)):
    assert (math.log(0.55) / lp(1, alpha) > math.log(0.4275) / lp(2, alpha)) == (want == [EOS])
    # With alpha 3 even a beam of one goes on past its EOS: a longer one may still win.
    out = _run_beam(fn, Beam(size=size, alpha=alpha), 4, [4])
    n = len(want)
    np.testing.assert_array_equal(out.tokens[0, 0, :n], want)
    assert out.lengths[0, 0] == n and (out.tokens[0, 0, n:] == PAD).all()
    p = 0.55 if n == 1 else 0.4275
    assert out.scores[0, 0] == pytest.approx(math.log(p) / lp(n, alpha), abs=1e-5)
  # Greedy stops at the first EOS whatever the penalty.
  np.testing.assert_array_equal(_run_greedy(fn, 4).tokens[0, 0, :2], [EOS, PAD])


def _random_logp(seed):
  """Random next-token log-probs over {EOS, A, B, C} (PAD and BOS impossible)."""
  rng = np.random.default_rng(seed)
  cache = {}

  def logp(prefix):
    if prefix not in cache:
      x = np.full(6, -np.inf)
      x[[EOS, A, B_, C]] = rng.normal(size=4) * 1.5
      cache[prefix] = (x - np.log(np.exp(x - x.max()).sum()) - x.max()).astype(np.float32)
    return cache[prefix]
  return logp


def _brute_force_nbest(logp, limit, alpha, n):
  """Every sequence over {EOS, A, B, C} of length <= limit ending with (only) EOS."""
  hyps = []
  for length in range(1, limit + 1):
    for body in itertools.product([A, B_, C], repeat=length - 1):
      seq = body + (EOS,)
      total = sum(float(logp(seq[:t])[seq[t]]) for t in range(length))
      hyps.append((total / ((5 + length) / 6) ** alpha, seq))
  hyps.sort(key=lambda h: -h[0])
  return hyps[:n]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 3.0])
@pytest.mark.parametrize("max_len, limits", [(4, (4, 2)), (3, (3, 1))])
def test_wide_beam_equals_brute_force_nbest(alpha, max_len, limits):
  """With more beams than extensions (3^3 prefixes x 4 tokens at the last step), beam
  search is exhaustive, so its n-best list must be the brute-force one. Two rows with
  different length limits check per-row limits; the table is read through a prefix code
  kept in the state, so the state must follow the beams' reordering. An odd max_len ends
  the loop (two steps per iteration) with a step past the end."""
  logp = _random_logp(0)
  fn = _table_fn(logp)          # draws every prefix's distribution once, in a fixed order
  out = _run_beam(fn, Beam(size=128, alpha=alpha, n_best=5), max_len, list(limits), batch=2)
  for row, limit in enumerate(limits):
    want = _brute_force_nbest(logp, limit, alpha, 5)
    for k, (score, seq) in enumerate(want):
      assert out.scores[row, k] == pytest.approx(score, abs=1e-4)
      assert out.lengths[row, k] == len(seq)
      np.testing.assert_array_equal(out.tokens[row, k, :len(seq)], seq)
  # The penalty changes the winner, so the test can tell the alphas apart.
  assert _brute_force_nbest(logp, 4, 0.0, 1)[0][1] != _brute_force_nbest(logp, 4, 3.0, 1)[0][1]


def test_beam_respects_min_len_and_falls_back_to_truncated_hypotheses():
  # EOS is likely everywhere, but min_len forbids it before length 3: with a limit of 3
  # every hypothesis is then exactly two non-EOS tokens and EOS.
  fn = _table_fn(lambda prefix: _logp({EOS: 0.7, A: 0.2, B_: 0.1}))
  out = _run_beam(fn, Beam(size=2, alpha=0.0, n_best=2), 4, [3], min_len=3)
  np.testing.assert_array_equal(out.lengths, [[3, 3]])
  assert (out.tokens[0, :, 2] == EOS).all() and (out.tokens[0, :, :2] != EOS).all()
  np.testing.assert_array_equal(out.tokens[0, 0], [A, A, EOS, PAD])
  # min_len beyond the limit: nothing can finish, the best hypotheses cut at the limit
  # come back (without EOS), scored with the penalty of their length.
  out = _run_beam(fn, Beam(size=2, alpha=0.6, n_best=2), 4, [3], min_len=9)
  np.testing.assert_array_equal(out.tokens[0, 0], [A, A, A, PAD])
  np.testing.assert_array_equal(out.lengths, [[3, 3]])
  assert out.scores[0, 0] == pytest.approx(3 * math.log(2 / 3) / (8 / 6) ** 0.6, abs=1e-5)
  assert out.scores[0, 1] == pytest.approx(math.log(4 / 27) / (8 / 6) ** 0.6, abs=1e-5)


@pytest.mark.parametrize("vocab, k", [(8000, 8), (1000, 2), (3001, 4), (40, 3)])
def test_fast_top_k_and_argmax_match_lax(vocab, k):
  rng = np.random.default_rng(vocab)
  x = rng.normal(size=(5, vocab)).astype(np.float32)
  x[1, : vocab // 2] = -np.inf                        # masked tokens, as after filtering
  x[2, 7] = x[2, vocab - 3] = x[2].max() + 1.0        # a tie for the maximum
  vals, idx = jax.jit(dec.top_k, static_argnums=1)(x, k)
  want_vals, want_idx = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(vals, want_vals)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(jax.jit(dec.argmax)(x), np.argmax(x, -1))


PROBS = np.array([0.0, 0.05, 0.1, 0.15, 0.3, 0.4])     # PAD (id 0) is never chosen


def _np_filter(probs, temperature=1.0, top_k=0, top_p=1.0):
  """The distribution Sample(...) draws from, written out plainly."""
  p = np.where(probs > 0, probs ** (1 / temperature), 0.0)
  p /= p.sum()
  order = np.argsort(-p, kind="stable")                # ties: the lowest id first
  keep = np.zeros(len(p), bool)
  keep[order[:top_k or len(p)]] = True
  p = np.where(keep, p, 0.0) / p[keep].sum()
  mass_before = np.cumsum(p[order]) - p[order]
  keep[order[mass_before >= top_p]] = False
  return np.where(keep, p, 0.0) / p[keep].sum()


TIED = np.array([0.0, 0.1, 0.2, 0.2, 0.25, 0.25])


@pytest.mark.parametrize("probs, strategy, kept", [
    (PROBS, Sample(), [1, 2, 3, 4, 5]),
    (PROBS, Sample(top_k=2), [4, 5]),
    (PROBS, Sample(top_p=0.65), [4, 5]),            # 0.4 + 0.3 reaches 0.65
    (PROBS, Sample(top_p=0.75), [3, 4, 5]),         # 0.4 + 0.3 does not reach 0.75
    (PROBS, Sample(temperature=0.5, top_k=4, top_p=0.9), [3, 4, 5]),  # 0.57 + 0.32 < 0.9
    # ties are ranked by id
    (TIED, Sample(top_k=1), [4]),                   # greedy: the first of the tied best
    (TIED, Sample(top_k=3), [2, 4, 5]),             # exactly 3: the first of the tied 0.2s
    (TIED, Sample(top_p=0.2), [4]),                 # one 0.25 reaches 0.2
    (TIED, Sample(top_p=0.6), [2, 4, 5]),           # 0.25 + 0.25 < 0.6 <= 0.7
])
def test_filter_logits_keeps_the_top_k_and_the_nucleus(probs, strategy, kept):
  logits = jnp.log(jnp.asarray(probs[1:]))
  x = np.asarray(jax.jit(dec.filter_logits, static_argnums=1)(logits[None], strategy))[0]
  np.testing.assert_array_equal(np.flatnonzero(np.isfinite(x)) + 1, kept)
  want = _np_filter(probs, strategy.temperature, strategy.top_k, strategy.top_p)
  np.testing.assert_allclose(np.exp(x - x.max()) / np.exp(x - x.max()).sum(), want[1:],
                             atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45])
def test_a_tiny_temperature_is_greedy(temperature):
  """logits / T overflows float32 for these T (1e-38 and 1e-45 are subnormal)."""
  logits = jnp.asarray([[0.5, 2.0, 3.0, -1.0], [7.0, 1.0, 7.0, 6.5]], jnp.float32)
  x = np.asarray(dec.filter_logits(logits, Sample(temperature=temperature)))
  assert not np.isnan(x).any()
  np.testing.assert_array_equal(x.argmax(-1), [2, 0])
  n = 1000
  fn = lambda seq, i, s: (jnp.broadcast_to(logits[0], (seq.shape[0], 4)), s)
  out = dec.sample_search(fn, (), batch_size=n, strategy=Sample(temperature=temperature),
                          max_len=1, limits_B=jnp.ones((n,), jnp.int32), bos_id=BOS,
                          eos_id=EOS, pad_id=PAD, rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0, 0]), 2)


def test_sampling_follows_the_filtered_distribution():
  """Temperature 2, top-k 4, top-p 0.8: empirical frequencies of 20,000 draws."""
  strategy = Sample(temperature=2.0, top_k=4, top_p=0.8)
  logits = jnp.log(jnp.maximum(jnp.asarray(PROBS, jnp.float32), 1e-30))
  fn = lambda seq, i, s: (jnp.broadcast_to(logits, (seq.shape[0], 6)), s)
  n = 20000
  out = jax.jit(lambda rng: dec.sample_search(
      fn, (), batch_size=n, strategy=strategy, max_len=1, limits_B=jnp.ones((n,), jnp.int32),
      bos_id=BOS, eos_id=EOS, pad_id=PAD, rng=rng))(jax.random.key(0))
  got = np.bincount(np.asarray(out.tokens[:, 0, 0]), minlength=6) / n
  want = _np_filter(PROBS, 2.0, 4, 0.8)
  assert (want > 0).sum() == 3                  # both filters bite
  np.testing.assert_allclose(got, want, atol=0.015)


@pytest.mark.parametrize("variant", [dict(tie_output=False), dict(share_embeddings=False)])
def test_decode_head_of_every_variant_matches_teacher_forcing(ref, variant):
  """The loop's head (`head_DxV`: laid out [D, V] once per call) gives the logits of
  `Transformer.output_head` for an untied projection with its bias and for a tied target
  embedding that the source does not share."""
  cfg = CFG.replace(**variant)
  params = _random_params(2, cfg)
  if "logits_dense" in params["params"]:   # a visible bias: zero would hide a missing add
    params["params"]["logits_dense"]["bias"] += 0.5 * np.arange(V, dtype=np.float32) / V
  out = dec.decode(cfg, params, ref["src"], dec.Greedy(), bos_id=BOS, eos_id=ref["eos"],
                   max_len=6, min_len=6, return_logits=True)
  tgt_in = np.concatenate([np.full((3, 1), BOS), np.asarray(out.tokens[:, 0, :-1])], 1)
  want = np.asarray(Transformer(cfg).apply(params, ref["src"], tgt_in.astype(np.int32)))
  np.testing.assert_allclose(out.logits, want, atol=1e-5, rtol=0)


def test_bf16_decode_matches_the_bf16_model_teacher_forced(params, ref):
  """dtype=bfloat16: the loop runs on bf16 copies of the matrices (`decode_params`, the
  embedding tables excepted: they are only looked up). That is exactly what the bf16 model
  computes from the f32 params in training, so greedy tokens == argmax of the teacher-forced
  bf16 model on the decoded prefix; passing the copies in gives the same result; and bf16
  differs from f32 (so the cast really happened)."""
  cfg = CFG.replace(dtype="bfloat16")
  out = dec.decode(cfg, params, ref["src"], dec.Greedy(), bos_id=BOS, eos_id=ref["eos"],
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
  again = dec.decode(cfg, cast, ref["src"], dec.Greedy(), bos_id=BOS, eos_id=ref["eos"],
                     max_len=8)
  np.testing.assert_array_equal(again.tokens, out.tokens)
  np.testing.assert_array_equal(again.scores, out.scores)


def test_decode_params_casts_the_matrices_but_not_embeddings_or_vectors(params):
  cfg = CFG.replace(dtype="bfloat16")
  cast = dec.decode_params(cfg, params)
  leaves = jax.tree_util.tree_leaves_with_path(cast)
  assert len(leaves) == len(jax.tree_util.tree_leaves(params))
  kinds = set()
  for path, x in leaves:
    name = path[-1].key
    want = jnp.float32 if x.ndim < 2 or name == "embedding" else jnp.bfloat16
    assert x.dtype == want, (jax.tree_util.keystr(path), x.dtype)
    kinds.add((name, x.dtype == jnp.bfloat16))
  assert {("embedding", False), ("kernel", True), ("bias", False)} <= kinds
  assert dec.decode_params(CFG, params) is params        # float32: nothing to do
  assert dec.decode_params(cfg, cast) is cast            # already cast: nothing to do
