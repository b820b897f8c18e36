"""The parallel_text builder: Moses files, TSV, a directory; and one-line errors for bad
files (line counts, empty, invalid UTF-8, missing path, TSV columns)."""
import os

import pytest

import seq2seq
from seq2seq import UserError
from seq2seq.data import load_dataset
from seq2seq.data import parallel_text
from seq2seq.data import testing as dtest


def _read_all(builder, split):
  src = builder.as_data_source(split=split)
  return [(r["en"].decode(), r["fr"].decode()) for r in src.__getitems__(list(range(len(src))))]


def test_moses_builder_splits_and_determinism(tmp_path):
  root = dtest.write_corpus_dir(str(tmp_path / "c"), (("train", 60), ("dev", 7), ("test", 9)))
  builds = []
  for run in range(2):  # two builds into two data dirs store the same examples, same order
    b = parallel_text.make_builder(root, data_dir=str(tmp_path / f"tfds{run}"))
    b.download_and_prepare()
    builds.append({s: _read_all(b, s) for s in ("train", "validation", "test")})
  assert builds[0] == builds[1]
  data = builds[0]
  assert {k: len(v) for k, v in data.items()} == {"train": 60, "validation": 7, "test": 9}
  assert set(data["train"]) == set(dtest.sentence_pairs(60, seed=0))   # aligned, complete
  assert set(data["test"]) == set(dtest.sentence_pairs(9, seed=2))
  assert b.info.supervised_keys == ("en", "fr")
  # a changed corpus is a different builder config (so it is rebuilt)
  dtest.write_moses(os.path.join(root, "test"), dtest.sentence_pairs(9, seed=99))
  b2 = parallel_text.make_builder(root, data_dir=str(tmp_path / "tfds0"))
  assert b2.builder_config.name != b.builder_config.name and not b2.is_prepared()


def test_tsv_and_crlf_and_unicode_separators(tmp_path):
  path = tmp_path / "pairs.tsv"
  # \r\n line ends, a BOM, and U+2028 inside a sentence (must not split the line)
  path.write_bytes("\ufeffone cat\tun chat\r\ntwo\u2028dogs\tdeux chiens\r\nend\tfin".encode())
  b = parallel_text.make_builder(str(path), data_dir=str(tmp_path / "tfds"))
  b.download_and_prepare()
  assert sorted(_read_all(b, "train")) == sorted(
      [("one cat", "un chat"), ("two\u2028dogs", "deux chiens"), ("end", "fin")])


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
