"""Token ids on disk: each sentence's ids, tokenized here or over worker processes, memory-
mapped and compact; nothing left by a refused, interrupted or killed run; a workdir of an
earlier version; the vocabulary's sample and the child process that trains it; progress."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import seq2seq
from seq2seq import UserError
from seq2seq.data import load_dataset, parallel_text, token_ids, vocabulary
from seq2seq.data import testing as dtest
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.workdir import Workdir


def _cfg(train_files, **data):
  d = dict(dataset="parallel_text", train_files=str(train_files), vocab_size=300,
           max_src_len=16, max_tgt_len=16)
  d.update(data)
  return seq2seq.Config(data=seq2seq.DataConfig(**d),
                        train=seq2seq.TrainConfig(batch_size=8, seq_len=32))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("ids")
  pairs = [(s.capitalize(), t) for s, t in dtest.sentence_pairs(900, seed=3)]
  dtest.write_moses(str(root / "c" / "train"), pairs)
  dtest.write_moses(str(root / "c" / "test"), dtest.sentence_pairs(12, seed=4))
  text = parallel_text.open_corpus(str(root / "c"))
  tok = Tokenizer.train([s.lower() for s, _ in pairs] + [t for _, t in pairs], vocab_size=300)
  tok.lowercase_source = True
  return root, text, tok


def test_each_pairs_ids_here_or_over_worker_processes(corpus, monkeypatch):
  root, text, tok = corpus
  monkeypatch.setattr(token_ids, "CHUNK", 128)
  here = token_ids.tokenize(text, "train", None, tok, root / "here", workers=1)
  monkeypatch.setattr(token_ids, "PARALLEL_MIN", 0)
  some = np.arange(1, 900, 2)
  over = token_ids.tokenize(text, "train", some, tok, root / "over", workers=2)
  src, tgt = text.read("train")
  for i in range(900):
    assert here.src[i].tolist() == tok.encode(src[i].lower())   # (lowercase_source)
    assert here.tgt[i].tolist() == tok.encode(tgt[i])
  for k, i in enumerate(some):
    assert over.src[k].tolist() == here.src[i].tolist()
    assert over.tgt[k].tolist() == here.tgt[i].tolist()
  assert isinstance(here.src.flat, np.memmap) and here.src.flat.dtype == np.uint16
  assert here.src.offsets.dtype == np.uint32
  np.testing.assert_array_equal(here.src_pieces, np.bincount(here.src.flat, minlength=300))
  again = token_ids.load(root / "here", 300)
  for side in ("src", "tgt"):
    np.testing.assert_array_equal(getattr(again, side).flat, getattr(here, side).flat)
    np.testing.assert_array_equal(getattr(again, side).offsets, getattr(here, side).offsets)
  starts, lens = here.src.offsets[[3, 10, 11]], here.src.lengths[[3, 10, 11]]
  assert here.read("src", starts, lens).tolist() == sum(
      (here.src[i].tolist() for i in (3, 10, 11)), [])
  # a directory that is not whole is not read
  (root / "here" / "tgt.ids").write_bytes((root / "here" / "tgt.ids").read_bytes()[:-2])
  with pytest.raises(token_ids.Broken, match="tgt.ids is not the file that was written"):
    token_ids.load(root / "here", 300)
  assert token_ids.load(root / "nothing", 300) is None


def test_the_text_index_goes_once_the_last_chunk_is_read(corpus, monkeypatch):
  """With release, the split's line index is let go when its last chunk has been read,
  before the ids are gathered and checked; the ids are those tokenizing without it makes."""
  root, text, tok = corpus
  monkeypatch.setattr(token_ids, "CHUNK", 128)
  files = text._text["train"]
  held_while_checking = []
  scan_all = token_ids._scan_all
  monkeypatch.setattr(token_ids, "_scan_all", lambda *a: (
      held_while_checking.append([f.starts is not None for f in files]), scan_all(*a))[1])
  kept = token_ids.tokenize(text, "train", None, tok, root / "kept", workers=1)
  released = token_ids.tokenize(text, "train", None, tok, root / "released", workers=1,
                                release=True)
  assert held_while_checking == [[True, True], [False, False]]
  for side in ("src", "tgt"):
    np.testing.assert_array_equal(getattr(released, side).flat, getattr(kept, side).flat)
  assert text.read("train", [5]) == ([text.read("train")[0][5]], [text.read("train")[1][5]])


def test_a_run_stopped_while_tokenizing_leaves_nothing(tmp_path, monkeypatch):
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), dtest.sentence_pairs(400, 1))
  monkeypatch.setattr(token_ids, "CHUNK", 50)
  calls = []

  def encode(*a, **k):
    calls.append(1)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real(*a, **k)
  real = token_ids._encode
  monkeypatch.setattr(token_ids, "_encode", encode)
  with pytest.raises(KeyboardInterrupt):
    load_dataset(_cfg(prefix), str(tmp_path / "w"), process_index=0, process_count=1)
  assert not (tmp_path / "w").exists()
  (tmp_path / "w2" / "checkpoints").mkdir(parents=True)   # an existing workdir: as it was
  calls.clear()
  with pytest.raises(KeyboardInterrupt):
    load_dataset(_cfg(prefix), str(tmp_path / "w2"), process_index=0, process_count=1)
  assert os.listdir(tmp_path / "w2") == ["checkpoints"]


def test_the_vocabulary_is_published_before_tokenizing_and_a_refused_run_puts_back_what_it_replaced(
    tmp_path, monkeypatch):
  """A new vocabulary is in the workdir before the token ids are made (another host of the
  run tokenizes its shards meanwhile); a run refused after it (every pair too long) leaves
  the workdir as it was: a vocabulary it replaced (built with other settings, of no run) is
  back, byte for byte."""
  pairs = [(f"{s} big red", f"{t} gibo dero") for s, t in dtest.sentence_pairs(300, 1)]
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), pairs)
  work = tmp_path / "w"
  load_dataset(_cfg(prefix, vocab_size=290), str(work), process_index=0, process_count=1)
  before = {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()}
  seen = []
  real = token_ids.tokenize

  def tokenize(*a, **k):
    seen.append(Tokenizer.load(str(work / "vocab.model")).vocab_size)
    return real(*a, **k)
  monkeypatch.setattr(token_ids, "tokenize", tokenize)
  with pytest.warns(UserWarning, match="built from other data or settings"):
    with pytest.raises(UserError, match="are longer than the limits"):
      load_dataset(_cfg(prefix, max_src_len=2, max_tgt_len=2), str(work), process_index=0,
                   process_count=1)
  assert seen and seen[0] == 300
  assert {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()} == before


def test_what_a_killed_run_left_is_removed(tmp_path):
  cache = tmp_path / "data_cache"
  dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True).stdout)
  left = token_ids.staging(cache / "train-0of1-abc")
  left = left.with_name(left.name.replace(f".tmp-{os.getpid()}-", f".tmp-{dead}-"))
  mine = token_ids.staging(cache / "test-all-def")
  for d in (left, mine):
    d.mkdir(parents=True)
  token_ids.remove_staging(cache)                 # the ended process's only
  assert not left.exists() and mine.exists()
  token_ids.remove_staging(cache, os.getpid())    # this process's (a refused run)
  assert not mine.exists()


def test_a_workdir_of_an_earlier_version(tmp_path):
  """Its token cache (data_cache/*.npz) is replaced; where its pairs came in another order
  (your own text, read through TFDS then), a resumed run says so once, at start."""
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), dtest.sentence_pairs(200, 1))
  work = tmp_path / "w"
  load_dataset(_cfg(prefix), str(work), process_index=0, process_count=1)
  (work / "data_cache" / "train-0of1-0123456789abcdef.npz").write_bytes(b"earlier")
  (work / "checkpoints" / "40").mkdir(parents=True)
  with pytest.warns(UserWarning, match="earlier version.*from the step it resumes at.*"
                                       "another order"):
    load_dataset(_cfg(prefix), str(work), process_index=0, process_count=1)
  assert not list((work / "data_cache").glob("*.npz"))
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    load_dataset(_cfg(prefix), str(work), process_index=0, process_count=1)   # said once
    # the other corpora kept their order: replaced without a word
    (work / "data_cache" / "train-0of1-0123456789abcdef.npz").write_bytes(b"earlier")
    token_ids.replace_earlier_versions(work / "data_cache", Workdir(work), False)
  assert not [w for w in said if "earlier version" in str(w.message)]
  assert not list((work / "data_cache").glob("*.npz"))


def test_the_vocabulary_trained_in_a_child_process_is_the_one_trained_here(corpus, tmp_path):
  """The same sample, settings and order as an in-process Tokenizer.train (how earlier
  versions trained it): the same model, byte for byte."""
  root, text, _ = corpus
  record = vocabulary.built_from(_cfg(root / "c" / "train", lowercase_source=True), text)
  child = vocabulary.train(text, record)
  src, tgt = text.read("train")
  here = Tokenizer.train([s.lower() for s in src] + tgt, vocab_size=300)
  assert child.model_proto == here.model_proto


def test_sentencepiece_failing_is_one_line(corpus, tmp_path):
  root, text, _ = corpus
  args = {**Tokenizer.trainer_args(300), "model_type": "bpe", "vocab_size": 300,
          "character_coverage": 2.0}
  with open(tmp_path / "sample", "w+b") as f, pytest.raises(UserError) as e:
    vocabulary._write_records(f, ["a b c"] * 10)
    f.flush()
    vocabulary._train_in_child([f], args, False)
  assert str(e.value).startswith("SentencePiece training failed: ") and "\n" not in str(e.value)


def test_the_vocabularys_sample_is_capped_in_bytes(corpus, monkeypatch):
  root, text, _ = corpus
  cfg = _cfg(root / "c" / "train")
  assert vocabulary.sample_size(text) == (900, False)
  assert "max_bytes" not in vocabulary.built_from(cfg, text)   # (as earlier versions wrote)
  monkeypatch.setattr(vocabulary, "SPM_MAX_BYTES", text.text_bytes("train") // 3)
  k, capped = vocabulary.sample_size(text)
  assert capped and k == (text.text_bytes("train") // 3) * 900 // text.text_bytes("train")
  assert k in (299, 300)
  assert vocabulary.built_from(cfg, text)["max_bytes"] == text.text_bytes("train") // 3
  monkeypatch.setattr(vocabulary, "SPM_MAX_PAIRS", 100)
  assert vocabulary.sample_size(text) == (100, False)


def test_long_phases_show_progress(tmp_path, monkeypatch, capfd):
  prefix = dtest.write_moses(str(tmp_path / "c" / "train"), dtest.sentence_pairs(300, 1))
  monkeypatch.setattr(token_ids, "BAR_DELAY", 0)
  monkeypatch.setattr(vocabulary, "BAR_DELAY", 0)
  load_dataset(_cfg(prefix), str(tmp_path / "w"), process_index=0, process_count=1,
               progress=True)
  err = capfd.readouterr().err
  assert "vocabulary: 100%" in err and "tokenizing train: 100%" in err and "300/300" in err
  load_dataset(_cfg(prefix), str(tmp_path / "w2"), process_index=0, process_count=1,
               progress=False)
  assert "tokenizing" not in capfd.readouterr().err
