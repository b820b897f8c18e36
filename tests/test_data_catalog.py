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


class ScaleTestPairs(tfds.core.GeneratorBasedBuilder):
  """A small translation dataset built from local data (as numbers.py's)."""
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, features=tfds.features.FeaturesDict({"en": tfds.features.Text(),
                                                            "fr": tfds.features.Text()}),
        supervised_keys=("en", "fr"))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(400)}

  def _generate_examples(self, n):
    from seq2seq.data import testing as dtest
    for i, (s, t) in enumerate(dtest.sentence_pairs(n, seed=7)):
      yield i, {"en": s, "fr": t}


def _records(builder):
  src = builder.as_data_source(split="train")
  return [(r["en"], r["fr"]) for r in src.__getitems__(list(range(len(src))))]


def test_a_dataset_past_tfds_memory_limit_builds_without_tensorflow(tmp_path, monkeypatch):
  """With TFDS's in-memory limit (1 GB) lowered to 1 kB, a small dataset takes the path of a
  big one (examples spilled to bucket files): without TensorFlow it builds, through the file
  system, into the very records an in-memory build writes; without that, it cannot."""
  if catalog.tensorflow_installed():
    pytest.skip("TensorFlow is installed here: TFDS uses it")
  from tensorflow_datasets.core import shuffle
  in_memory = ScaleTestPairs(data_dir=str(tmp_path / "a"), file_format="array_record")
  catalog.prepare(in_memory, downloads=False)
  monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)
  opened = []
  real = catalog._FileApi.io.gfile.GFile
  monkeypatch.setattr(catalog._FileApi.io.gfile, "GFile",
                      staticmethod(lambda path, mode="r": opened.append(path) or real(path, mode)))
  spilled = ScaleTestPairs(data_dir=str(tmp_path / "b"), file_format="array_record")
  catalog.prepare(spilled, downloads=False)
  assert len(opened) > 100                          # bucket files, written and read back
  assert _records(spilled) == _records(in_memory) and len(_records(spilled)) == 400
  import contextlib
  monkeypatch.setattr(catalog, "files_without_tensorflow", contextlib.nullcontext)
  with pytest.raises(UserError, match="tensorflow"):
    catalog.prepare(ScaleTestPairs(data_dir=str(tmp_path / "c"), file_format="array_record"),
                    downloads=False)


def test_a_builder_that_needs_tensorflow_says_so_before_any_download(tmp_path, monkeypatch):
  if catalog.tensorflow_installed():
    pytest.skip("TensorFlow is installed here")
  monkeypatch.setattr(catalog, "_offline_reason", lambda: pytest.fail("went for the network"))
  with pytest.raises(UserError, match=r"'mnist.*uses TensorFlow, which is not installed: pip "
                                      r"install tensorflow-cpu") as e:
    catalog.prepare(catalog.get_builder("mnist", str(tmp_path)))
  assert "\n" not in str(e.value)
  for name in ("wmt14_translate/de-en", "ted_hrlr_translate/pt_to_en"):
    assert not catalog.uses_tensorflow(catalog.get_builder(name, str(tmp_path)))
