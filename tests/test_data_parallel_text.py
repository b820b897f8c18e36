"""Your parallel text read where it lies: Moses files, TSV, a directory, lines by number as
textio reads them; and one-line errors for bad files (line counts, empty, invalid UTF-8,
missing path, TSV columns)."""
import os

import numpy as np
import pytest

import seq2seq
from seq2seq import UserError, textio
from seq2seq.data import load_dataset
from seq2seq.data import parallel_text
from seq2seq.data import testing as dtest


def test_moses_corpus_splits_in_file_order(tmp_path):
  root = dtest.write_corpus_dir(str(tmp_path / "c"), (("train", 60), ("dev", 7), ("test", 9)))
  corpus = parallel_text.open_corpus(root)
  assert corpus.splits == ("train", "validation", "test")
  assert {s: corpus.num_examples(s) for s in corpus.splits} == {"train": 60, "validation": 7,
                                                                "test": 9}
  for split, seed in (("train", 0), ("validation", 1), ("test", 2)):
    src, tgt = corpus.read(split)
    assert list(zip(src, tgt)) == dtest.sentence_pairs(corpus.num_examples(split), seed=seed)
  src, tgt = corpus.read("train", [59, 3, 3, 0])       # by number, in the order asked
  pairs = dtest.sentence_pairs(60, seed=0)
  assert list(zip(src, tgt)) == [pairs[59], pairs[3], pairs[3], pairs[0]]
  assert (corpus.src_key, corpus.tgt_key) == ("en", "fr")
  # a changed corpus is another corpus: its identity (the token cache's key) changes
  before = corpus.identity("test"), corpus.identity("train")
  dtest.write_moses(os.path.join(root, "test"), dtest.sentence_pairs(9, seed=99))
  after = parallel_text.open_corpus(root)
  assert after.identity("test") != before[0] and after.identity("train") == before[1]


def test_tsv_and_crlf_and_unicode_separators(tmp_path):
  path = tmp_path / "pairs.tsv"
  # \r\n line ends, a BOM, and U+2028 inside a sentence (must not split the line)
  path.write_bytes("\ufeffone cat\tun chat\r\ntwo\u2028dogs\tdeux chiens\r\nend\tfin".encode())
  src, tgt = parallel_text.open_corpus(str(path)).read("train")
  assert list(zip(src, tgt)) == [("one cat", "un chat"), ("two\u2028dogs", "deux chiens"),
                                 ("end", "fin")]


@pytest.mark.parametrize("block,span", [(1 << 24, 1 << 22), (7, 5)])
def test_text_file_reads_lines_as_textio_does(tmp_path, monkeypatch, block, span):
  """Line i of a scanned file, read alone, in runs or in any order, is line i of
  textio.read_lines, whatever its line ends, byte-order mark and multi-byte characters;
  files are read in blocks (here also 7 bytes: characters and "\\r\\n" split between
  blocks) and windows of lines."""
  monkeypatch.setattr(parallel_text, "_BLOCK", block)
  monkeypatch.setattr(parallel_text, "_SPAN", span)
  rng = np.random.default_rng(0)
  words = ["café", "naïve", "日本語", "🙂", "a", "tab\there", "\u2028", " ", "x" * 30]
  cases = [b"a\nb\nc\n", b"a\nb\nc", "\ufeffone\r\ntwo\u2028x\r\nend".encode(),
           b"x\r\n\r\ny\r", b"\n\nz\n", "é\n".encode() * 5, b"\r\n" * 3 + b"a",
           "\n".join("".join(rng.choice(words, rng.integers(0, 6))) + ("\r" if rng.random() < .3
                                                                     else "")
                     for _ in range(300)).encode()]
  for i, data in enumerate(cases):
    path = tmp_path / f"f{i}"
    path.write_bytes(data)
    want = textio.read_lines(str(path))
    f = parallel_text.TextFile(str(path))
    assert f.lines() == want
    assert len(f) == len(want) == textio.count_lines(str(path))
    idx = rng.integers(0, len(want), 40)
    assert f.lines(idx) == [want[i] for i in idx]
    assert f.lines(np.arange(1, len(want))[::2]) == want[1::2]
    assert f.lines([]) == []


def test_an_index_of_other_than_the_lines_counted_says_the_file_changed(tmp_path):
  """The index is written into arrays sized by the line count taken when the file was
  opened: a file that now holds more or fewer lines gives no index (no SHA-256), never one
  written past its end."""
  path = tmp_path / "t.txt"
  path.write_bytes(b"a\nb\r\nc")
  with open(path, "rb") as f:
    sha, starts, ends, _ = parallel_text._index(f, str(path), False, 3)
  assert sha is not None and starts.tolist() == [0, 2, 5] and ends.tolist() == [1, 3, 6]
  for lines in (2, 4, 0):
    with open(path, "rb") as f:
      assert parallel_text._index(f, str(path), False, lines)[0] is None


def test_error_whitespace_only_and_bom_only_files(tmp_path):
  for data in (b"  \n \n", b"\xef\xbb\xbf", b"\n"):
    _bad(tmp_path, **{"t.en": data, "t.fr": b"x\n"})
    assert "t.en is empty" in _error(str(tmp_path / "t"), tmp_path)


def test_invalid_utf8_is_found_before_anything_is_written(tmp_path):
  """A bad byte deep in a big training file (past the vocabulary's sample) stops the run
  before it writes anything, naming the line."""
  pairs = dtest.sentence_pairs(3000, seed=4)
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), pairs)
  data = (tmp_path / "c" / "train.fr").read_bytes().split(b"\n")
  data[2500] = data[2500] + b" caf\xe9"
  (tmp_path / "c" / "train.fr").write_bytes(b"\n".join(data))
  assert "train.fr line 2501: invalid UTF-8" in _error(prefix, tmp_path)
  assert not (tmp_path / "w").exists()


def test_load_dataset_reverse(tmp_path):
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), dtest.sentence_pairs(40, seed=1))
  cfg = seq2seq.Config(data=seq2seq.DataConfig(
      dataset="parallel_text", train_files=prefix, validation_files=prefix, reverse=True,
      data_dir=str(tmp_path / "tfds"), vocab_size=300))
  ds = load_dataset(cfg, str(tmp_path / "w"), process_index=0, process_count=1)
  assert ds.splits == ("train", "validation")
  b = next(ds.eval_batches("validation", 64))
  pairs = set(dtest.sentence_pairs(40, seed=1))
  assert {(t, s) for s, t, v in zip(b["src_text"], b["tgt_text"], b["valid"]) if v} == pairs


def _bad(tmp_path, **files):
  """Writes files (name -> bytes) and returns the prefix / path of the first."""
  for name, data in files.items():
    (tmp_path / name).write_bytes(data)
  return str(tmp_path)


def _error(train_files, tmp_path, **kw) -> str:
  cfg = seq2seq.Config(data=seq2seq.DataConfig(
      dataset="parallel_text", train_files=train_files, data_dir=str(tmp_path / "tfds"), **kw))
  with pytest.raises(UserError) as e:
    load_dataset(cfg, str(tmp_path / "w"), process_index=0, process_count=1)
  msg = str(e.value)
  assert "\n" not in msg and msg
  return msg


def test_error_line_counts(tmp_path):
  _bad(tmp_path, **{"t.en": b"a\nb\nc\n", "t.fr": b"x\ny\n"})
  msg = _error(str(tmp_path / "t"), tmp_path)
  assert "t.en has 3 lines" in msg and "t.fr has 2 lines" in msg


def test_error_empty_file(tmp_path):
  _bad(tmp_path, **{"t.en": b"", "t.fr": b"x\n"})
  assert "t.en is empty" in _error(str(tmp_path / "t"), tmp_path)


def test_error_invalid_utf8_names_file_and_line(tmp_path):
  _bad(tmp_path, **{"t.en": b"a\nb\n", "t.fr": "ok\n".encode() + b"caf\xe9 latin-1\n"})
  msg = _error(str(tmp_path / "t"), tmp_path)
  assert "t.fr line 2: invalid UTF-8" in msg


def test_error_missing_paths(tmp_path):
  assert "no such file" in _error(str(tmp_path / "nothing"), tmp_path)
  assert "nothing.en" in _error(str(tmp_path / "nothing"), tmp_path)
  _bad(tmp_path, **{"t.en": b"a\n", "t.fr": b"b\n"})
  assert "no such file" in _error(str(tmp_path / "t"), tmp_path,
                                  validation_files=str(tmp_path / "dev"))
  assert "train_files" in _error("", tmp_path)
  assert "no such file" in _error(str(tmp_path / "none.tsv"), tmp_path)


def test_error_tsv_columns(tmp_path):
  _bad(tmp_path, **{"p.tsv": b"a\tb\nno tab here\n"})
  assert "p.tsv line 2: expected 2 tab-separated columns" in _error(str(tmp_path / "p.tsv"),
                                                                     tmp_path)
