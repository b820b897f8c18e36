"""The embedded numbers task: disjoint deterministic splits, the TFDS builder (shrunk for
speed), French and German configs, load_dataset on it."""
import collections

import numpy as np
import pytest
import tensorflow_datasets as tfds

import seq2seq
from seq2seq import UserError
from seq2seq.data import load_dataset
from seq2seq.data import numbers


def test_full_size_splits_disjoint_and_balanced():
  s = numbers.split_numbers()
  assert {k: len(v) for k, v in s.items()} == {"train": 30045, "validation": 1002,
                                               "test": 1002}
  train, val, test = (set(s[k].tolist()) for k in ("train", "validation", "test"))
  assert not train & test and not train & val and not val & test
  assert set(range(1000)) <= train
  # every round number (<= 2 nonzero digits) is in train unless it is held out
  naive = {n for n in range(1000, 1_000_000) if sum(c != "0" for c in str(n)) <= 2}
  assert set(numbers.round_numbers().tolist()) == naive and len(naive) == 999
  assert {3000, 3400, 300400, 990000} <= naive and not {3450, 300401} & naive
  assert naive - val - test <= train and len(naive & (val | test)) == 19
  for lo, hi in numbers.STRATA:  # a third of each held-out split per magnitude
    assert ((s["test"] >= lo) & (s["test"] < hi)).sum() == 334
  assert np.array_equal(numbers.split_numbers()["test"], s["test"])  # deterministic
  # the order is a fixed integer hash, not an RNG stream: pin a few values
  assert s["test"][:3].tolist() == [1015, 1048, 1049]
  assert s["validation"][:3].tolist() == [1008, 1014, 1064]


def test_words():
  assert numbers.number_words(342817, "en") == (
      "three hundred and forty-two thousand, eight hundred and seventeen")
  assert numbers.number_words(342817, "fr") == (
      "trois cent quarante-deux mille huit cent dix-sept")
  assert numbers.number_words(21, "de") == "einundzwanzig"


@pytest.fixture
def tiny_numbers(monkeypatch):
  """The builder with 3 held-out numbers per stratum and 20 training numbers per stratum
  (plus 0..999 and the 27 round numbers with one nonzero digit: 1087 numbers; with the
  copies of 0..99, 1803 examples), so a build takes a second."""
  monkeypatch.setattr(numbers, "HELDOUT_PER_STRATUM", 3)
  monkeypatch.setattr(numbers, "TRAIN_PER_STRATUM", 20)
  monkeypatch.setattr(numbers, "ROUND_NONZERO_DIGITS", 1)


def _read(builder, split, lang):
  src = builder.as_data_source(split=split)
  recs = src.__getitems__(list(range(len(src))))
  return [(int(r["number"]), r["en"].decode(), r[lang].decode()) for r in recs]


@pytest.mark.parametrize("lang", ["fr", "de"])
def test_builder_tiny_deterministic(tiny_numbers, tmp_path, lang):
  runs = []
  for run in range(2):
    b = numbers.Seq2seqNumbers(config=lang, data_dir=str(tmp_path / f"d{run}"),
                               file_format="array_record")
    b.download_and_prepare()
    runs.append({s: _read(b, s, lang) for s in ("train", "validation", "test")})
  assert runs[0] == runs[1]                                  # same records, same order
  data = runs[0]
  assert {k: len(v) for k, v in data.items()} == {"train": 1803, "validation": 9, "test": 9}
  nums = {k: {n for n, _, _ in v} for k, v in data.items()}
  # train holds 0 24 times, 1..99 8 times each, the rest once; held-out numbers once each
  counts = collections.Counter(n for n, _, _ in data["train"])
  assert counts[0] == 24 and {counts[n] for n in range(1, 100)} == {8}
  assert set(counts[n] for n in nums["train"] if n >= 100) == {1} and len(counts) == 1087
  assert sum(1 for n, en, tgt in data["train"] if n == 0 and (en, tgt) == (
      "zero", "zéro" if lang == "fr" else "null")) == 24
  assert all(len(v) == len(nums[k]) for k, v in data.items() if k != "train")
  assert not nums["train"] & nums["test"] and not nums["train"] & nums["validation"]
  assert not nums["validation"] & nums["test"]
  for n, en, tgt in data["test"]:
    assert en == numbers.number_words(n, "en") and tgt == numbers.number_words(n, lang)
  assert b.info.supervised_keys == ("en", lang)
  # the registered name works with tfds.data_source, too
  ds = tfds.data_source(f"seq2seq_numbers/{lang}", data_dir=str(tmp_path / "d0"))
  assert len(ds["test"]) == 9


def test_load_dataset_numbers(tiny_numbers, tmp_path):
  cfg = seq2seq.Config(data=seq2seq.DataConfig(data_dir=str(tmp_path / "tfds")),
                       train=seq2seq.TrainConfig(batch_size=8, seq_len=64))
  ds = load_dataset(cfg, str(tmp_path / "w"), process_index=0, process_count=1)
  assert ds.splits == ("train", "validation", "test")
  assert 262 < ds.tokenizer.vocab_size <= 1024    # capped small, whatever data.vocab_size
  assert ds.stats["dropped_too_long"] == 0
  b = next(ds.eval_batches("test", 4))
  assert b["src"].shape[1] <= 20 and b["tgt"].shape[1] <= 25   # short sequences
  for row, text in zip(b["tgt"], b["tgt_text"]):
    assert ds.tokenizer.decode(row) == text
  with pytest.raises(UserError, match="target_lang"):
    load_dataset(cfg.replace(data=cfg.data.__class__(target_lang="es",
                                                     data_dir=str(tmp_path / "tfds"))),
                 str(tmp_path / "w2"), process_index=0, process_count=1)
