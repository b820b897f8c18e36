"""TFDS catalog datasets by name: the whole path under tfds.testing.mock_data, --reverse,
and one-line errors (unknown name, not a translation dataset, cannot download)."""
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

import seq2seq
from seq2seq import UserError
from seq2seq.data import catalog, load_dataset


def _cfg(tmp_path, name, **kw):
  return seq2seq.Config(
      data=seq2seq.DataConfig(dataset=name, data_dir=str(tmp_path / "tfds"), vocab_size=280,
                              **kw),
      train=seq2seq.TrainConfig(batch_size=4, seq_len=32))


@pytest.fixture
def online(monkeypatch):
  # mock_data replaces download_and_prepare with a no-op; skip the network probe that
  # fails fast on this offline machine.
  monkeypatch.setattr(catalog, "_offline_reason", lambda: "")


@pytest.mark.parametrize("name,keys", [("ted_hrlr_translate/pt_to_en", ("pt", "en")),
                                       ("wmt14_translate/de-en", ("de", "en"))])
@pytest.mark.parametrize("reverse", [False, True])
def test_mock_catalog_dataset(tmp_path, online, name, keys, reverse):
  with tfds.testing.mock_data(num_examples=24):
    ds = load_dataset(_cfg(tmp_path, name, reverse=reverse), str(tmp_path / "w"),
                      process_index=0, process_count=1)
    src_key, tgt_key = keys[::-1] if reverse else keys
    assert (ds.stats["source_key"], ds.stats["target_key"]) == (src_key, tgt_key)
    assert ds.num_examples("train") == 24
    assert set(ds.splits) >= {"train", "validation", "test"}
    b = next(ds.train_batches(0))
    assert b["src"].shape == (4, 32) and b["src"].dtype == np.int32
    assert (b["src_segments"] > 0).sum() > 0
    e = next(ds.eval_batches("test", 8))
    records = ds.corpus.data_source("test")
    first = records[0]
    assert e["src_text"][0] == first[src_key] and e["tgt_text"][0] == first[tgt_key]
    assert ds.tokenizer.decode(e["tgt"][0]) == first[tgt_key].strip() or \
        ds.tokenizer.decode(e["tgt"][0]) == " ".join(first[tgt_key].split())


def test_unknown_and_non_translation_datasets(tmp_path):
  with pytest.raises(UserError, match="unknown dataset 'no_such_dataset'"):
    load_dataset(_cfg(tmp_path, "no_such_dataset"), str(tmp_path / "w"), process_index=0,
                 process_count=1)
  with pytest.raises(UserError, match="not Text"):
    load_dataset(_cfg(tmp_path, "mnist"), str(tmp_path / "w"), process_index=0,
                 process_count=1)
  with pytest.raises(UserError, match="xx-yy"):
    load_dataset(_cfg(tmp_path, "wmt14_translate/xx-yy"), str(tmp_path / "w"),
                 process_index=0, process_count=1)


def test_cannot_download_is_one_line_user_error(tmp_path, monkeypatch):
  # This machine is offline: the probe fails at once (no 200 s of download retries).
  monkeypatch.setattr(catalog, "_offline_reason", lambda: "no network: test")
  t = time.monotonic()
  with pytest.raises(UserError) as e:
    load_dataset(_cfg(tmp_path, "ted_hrlr_translate/pt_to_en"), str(tmp_path / "w"),
                 process_index=0, process_count=1)
  msg = str(e.value)
  assert "not prepared" in msg and "data_dir" in msg and "\n" not in msg
  assert time.monotonic() - t < 10
  # a download that fails for any other reason is a UserError too
  monkeypatch.setattr(catalog, "_offline_reason", lambda: "")

  def fail(self, *a, **k):
    raise ConnectionError("Max retries exceeded\nwith url")
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", fail)
  with pytest.raises(UserError, match="ConnectionError: Max retries exceeded;?") as e:
    load_dataset(_cfg(tmp_path, "wmt14_translate/de-en"), str(tmp_path / "w"),
                 process_index=0, process_count=1)
  assert "\n" not in str(e.value)
