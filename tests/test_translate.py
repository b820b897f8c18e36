"""Strings in, strings out: translate / translate_nbest / translate_chunks against `decode`,
and reading input lines."""
import jax
import numpy as np
import pytest

from seq2seq import decoding, textio
from seq2seq import translate as tr
from seq2seq.errors import UserError
from seq2seq.search import Beam, Greedy, Sample
from test_decoding import CFG, _random_params


@pytest.fixture(scope="module")
def params():
  return _random_params(0)


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
  got = tr.translate(params, CFG, tok, sentences, Greedy(), batch_size=8)
  assert len(got) == len(sentences)
  assert tr.translate(params, CFG, tok, sentences[::-1], Greedy(), batch_size=8) == got[::-1]
  # The same batch by hand (sorted by length, padded to 16 columns and 8 rows).
  order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
  src = np.zeros((8, 16), np.int32)
  src[len(order):, 0] = tok.eos_id
  for r, i in enumerate(order):
    ids = tok.encode(sentences[i]) + [tok.eos_id]
    src[r, :len(ids)] = ids
  res = decoding.decode(CFG, params, src, Greedy(), bos_id=tok.bos_id, eos_id=tok.eos_id)
  for r, ids in enumerate(res.token_lists(tok.eos_id)[:len(order)]):
    assert got[order[r]] == tok.decode(ids)
  with pytest.raises(UserError, match="sentence 0 has 70 tokens"):
    tr.translate(params, CFG, tok, ["a" * 69], Greedy())


@pytest.mark.slow   # compiles a decode loop per sentence and per pass (13-19 s)
@pytest.mark.parametrize("batching", ["slots", "fixed"])
def test_translate_nbest_scores_truncates_and_skips_empty_lines(params, monkeypatch, batching):
  tok = _Chars()
  beam = Beam(size=2, alpha=0.6, n_best=2)
  done = []
  long = "a" * 80                              # 81 tokens with EOS; the model reads 64
  out = tr.translate_nbest(params, CFG, tok, ["hello", "", "abc", long], beam,
                            progress=done.append, batching=batching)
  # Each sentence as `decode` translates it alone (the long one cut to 63 tokens + EOS).
  tokens = 0
  for i, text in ((0, "hello"), (2, "abc"), (3, "a" * 63)):
    ids = tok.encode(text) + [tok.eos_id]
    alone = decoding.decode(CFG, params, np.array([ids], np.int32), beam, bos_id=tok.bos_id,
                            eos_id=tok.eos_id)
    assert out.texts[i] == [tok.decode(h[0]) for h in
                            (alone.token_lists(tok.eos_id, j) for j in range(2))]
    np.testing.assert_allclose(out.scores[i], alone.scores[0], rtol=1e-5)
    tokens += alone.lengths[0].sum()
  assert out.num_tokens == tokens > 0
  assert out.truncated == [3]
  assert done[0] == 1 and sum(done) == 4       # the empty line first, then the others
  assert out.texts[1] == [""] and out.scores[1] == [0.0]
  for i in (0, 2, 3):
    assert len(out.texts[i]) == 2 and out.texts[i][0] != out.texts[i][1]
    assert out.scores[i][0] >= out.scores[i][1] > -np.inf
  # Truncation keeps EOS: the cut source is the 63 first tokens + EOS, i.e. "a" * 63.
  same = tr.translate_nbest(params, CFG, tok, ["hello", "", "abc", "a" * 63], beam,
                            batching=batching)
  assert same.truncated == [] and same.texts == out.texts and same.scores == out.scores
  # The best hypothesis is what translate() returns (which neither cuts nor skips).
  assert tr.translate(params, CFG, tok, ["hello", "abc", "a" * 63], beam) == \
      [out.texts[i][0] for i in (0, 2, 3)]
  with pytest.raises(UserError, match="sentence 0 has 81 tokens"):
    tr.translate_nbest(params, CFG, tok, [long], beam, truncate=False, batching=batching)
  # Empty lines never reach the model.
  fail = lambda *a, **k: pytest.fail("decoded an empty line")
  monkeypatch.setattr(tr, "decode", fail)
  monkeypatch.setattr(tr.slots, "decode_stream", fail)
  empty = tr.translate_nbest(params, CFG, tok, ["", ""], beam, batching=batching)
  assert empty == tr.Translations([[""], [""]], [[0.0], [0.0]], 0, [])
  with pytest.raises(UserError, match="max_len must be in"):
    tr.translate_nbest(params, CFG, tok, [""], beam, max_len=CFG.max_len + 1)
  with pytest.raises(UserError, match="batching must be one of auto, slots, fixed"):
    tr.translate_nbest(params, CFG, tok, [""], beam, batching="dynamic")


@pytest.mark.slow   # ~10 s of compiling: the full suite runs it
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

  chunks = tr.translate_chunks(params, CFG, tok, lazily(), strategy, chunk_size=3, rng=5)
  offset, first = next(chunks)
  assert offset == 0 and len(read) == 3 and len(first.texts) == 3   # only one chunk read
  got = [(offset, first)] + list(chunks)
  assert [o for o, _ in got] == [0, 3, 6]
  key = jax.random.key(5)
  for k, (offset, out) in enumerate(got):
    want = tr.translate_nbest(params, CFG, tok, sentences[offset:offset + 3], strategy,
                               rng=jax.random.fold_in(key, k))
    assert out.texts == want.texts and out.scores == want.scores
    assert out.num_tokens == want.num_tokens
    assert out.truncated == [offset + i for i in want.truncated]
  assert [i for _, out in got for i in out.truncated] == [3, 6]
  # A chunk's draw does not depend on what follows it.
  again = next(tr.translate_chunks(params, CFG, tok, sentences[:3], strategy,
                                    chunk_size=3, rng=5))
  assert again[1].texts == got[0][1].texts
  with pytest.raises(UserError, match="chunk_size must be >= 1"):
    next(tr.translate_chunks(params, CFG, tok, sentences, strategy, chunk_size=0))


def test_auto_batching_chooses_by_strategy_and_sentence_count():
  """Slots where a finished sentence has a successor to take its slot; fixed batches for
  greedy and beam search of at most one batch (the same tokens, a cheaper step), and for
  beam search whose kernels move every beam's cache (no table of rows); sampling keeps
  the slots' one key per sentence whatever the count."""
  from seq2seq import kernels
  resolve = tr.resolve_batching
  assert resolve("auto", Greedy(), 65, 64) == "slots"
  assert resolve("auto", Greedy(), 64, 64) == resolve("auto", Greedy(), 1, 64) == "fixed"
  assert resolve("auto", Greedy()) == "slots"                 # a count not known
  assert resolve("auto", Sample(temperature=1.0), 1, 64) == "slots"
  cpu, ref = CFG.replace(kernels="cpu"), CFG.replace(kernels="reference")
  rows = kernels.get("cpu").beam_rows(cpu)
  assert resolve("auto", Beam(size=4), 1000, 64, cpu) == ("slots" if rows else "fixed")
  assert resolve("auto", Beam(size=4), 1000, 64, ref) == "fixed"
  assert resolve("auto", Beam(size=4), 1000, 64) == "fixed"   # no config: no table known
  assert resolve("auto", Beam(size=4), 64, 64, cpu) == "fixed"
  assert resolve("slots", Greedy(), 1, 64) == "slots" and resolve("fixed", Greedy()) == "fixed"


@pytest.mark.parametrize("read", ["read_lines", "iter_lines"])
def test_read_lines(tmp_path, read):
  """read_lines, and iter_lines one line at a time (decode.py's input), read alike; the
  line count of a file without decoding it is theirs."""
  import io
  read_lines = (textio.read_lines if read == "read_lines"
                else lambda source: list(textio.iter_lines(source)))
  path = tmp_path / "in.txt"
  path.write_bytes(b"\xef\xbb\xbfone\r\n\ntwo\xe2\x80\xa8three\rfour\n")
  want = ["one", "", "two\u2028three\rfour"]   # split at "\n" only
  assert read_lines(path) == read_lines(str(path)) == want
  assert read_lines(io.BytesIO(path.read_bytes())) == want
  assert textio.count_lines(path) == 3
  latin1 = tmp_path / "latin1.txt"                       # as training refuses it, with the line
  latin1.write_bytes(b"one\ntwo\ncaf\xe9\n")
  with pytest.raises(UserError, match=r"latin1.txt line 3: invalid UTF-8 \(byte 0xe9\)"):
    read_lines(latin1)
  with pytest.raises(UserError, match=r"^standard input line 1: invalid UTF-8 \(byte 0xff\)"):
    read_lines(io.BytesIO(b"\xff\n"))
  assert read_lines(io.StringIO("a\nb")) == ["a", "b"]
  assert read_lines(io.BytesIO(b"")) == []
  no_end = tmp_path / "no_end.txt"
  no_end.write_bytes(b"a\n\nb")
  assert read_lines(no_end) == ["a", "", "b"] and textio.count_lines(no_end) == 3
  (tmp_path / "empty.txt").write_bytes(b"")
  assert textio.count_lines(tmp_path / "empty.txt") == 0
  assert textio.count_lines(tmp_path / "nope.txt") is None
  with pytest.raises(UserError, match="cannot read .*nope.txt: No such file"):
    read_lines(tmp_path / "nope.txt")
  with pytest.raises(UserError, match="Is a directory"):
    read_lines(tmp_path)


def test_a_string_is_one_sentence_and_other_items_are_refused(params):
  """A str passed where a list of sentences goes is one sentence (not one per character),
  in every function of the API; items that are not strings are one-line errors."""
  tok = _Chars()
  one = tr.translate(params, CFG, tok, ["hello"], Greedy())
  assert tr.translate(params, CFG, tok, "hello", Greedy()) == one
  assert tr.translate_nbest(params, CFG, tok, "hello", Greedy()).texts == [one]
  chunks = list(tr.translate_chunks(params, CFG, tok, "hello", Greedy()))
  assert [(o, out.texts) for o, out in chunks] == [(0, [one])]
  for bad in (["hello", 3], [b"hello"], [None]):
    with pytest.raises(UserError, match="sentences must be strings") as e:
      tr.translate(params, CFG, tok, bad, Greedy())
    assert "\n" not in str(e.value)
