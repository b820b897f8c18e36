"""Where the pairs come from: your parallel text (read where it lies, parallel_text.py), a
TFDS dataset of the catalog (catalog.py) or the embedded numbers task (numbers.py).

    corpus = open_corpus(cfg)
    corpus.splits, corpus.num_examples("train")
    src, tgt = corpus.read("train", indices)     # lists of strings, `indices` in order
    corpus.identity("train")                     # names the split's pairs (cache keys)

A corpus is read by example number and never held whole. TFDS datasets are array_record
files read through TFDS data sources (no TensorFlow), prepared once in cfg.data.data_dir
("" -> $TFDS_DATA_DIR or ~/tensorflow_datasets) by process 0, and opened by the others once
it has (load_dataset's hosts agree on it).
"""
from __future__ import annotations

import logging

import numpy as np
import tensorflow_datasets as tfds

from seq2seq.config import Config
from seq2seq.data import catalog, numbers, parallel_text
from seq2seq.errors import UserError

log = logging.getLogger("seq2seq.data")

_READ_CHUNK = 4096


def _text(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


class TfdsCorpus:
  """A prepared TFDS builder read through array_record data sources (no TensorFlow)."""

  def __init__(self, builder: tfds.core.DatasetBuilder, src_key: str, tgt_key: str):
    self.builder, self.src_key, self.tgt_key = builder, src_key, tgt_key
    self.name = builder.info.full_name
    known = list(builder.info.splits.keys())
    # Under tfds.testing.mock_data the split names are unknown: assume the usual three.
    names = known or ["train", "validation", "test"]
    order = {"train": 0, "validation": 1, "test": 2}
    self.splits = tuple(sorted(names, key=lambda s: (order.get(s, 3), s)))
    self._sources = {}

  def data_source(self, split: str):
    if split not in self.splits:
      raise UserError(f"dataset {self.name} has no split {split!r} "
                      f"(available: {', '.join(self.splits)})")
    if split not in self._sources:
      self._sources[split] = self.builder.as_data_source(split=split)
    return self._sources[split]

  def num_examples(self, split: str) -> int:
    return len(self.data_source(split))

  def identity(self, split: str) -> str:
    return f"{self.name}|{self.src_key}>{self.tgt_key}|{split}|{self.num_examples(split)}"

  def check(self, split: str) -> None:
    """(TFDS wrote the records: nothing to check.)"""

  def release(self, split: str) -> None:
    """(Nothing is held to forget.)"""

  def text_bytes(self, split: str) -> int:
    """The split's size as TFDS stored it (its records: a little more than their text); 0
    where TFDS does not say."""
    try:
      return int(self.builder.info.splits[split].num_bytes or 0)
    except (KeyError, TypeError, ValueError):
      return 0

  def read(self, split: str, indices=None) -> tuple[list[str], list[str]]:
    """(sources, targets) of examples `indices` (default: all) of `split`."""
    ds = self.data_source(split)
    idx = np.arange(len(ds)) if indices is None else np.asarray(indices, np.int64)
    src, tgt = [], []
    for a in range(0, len(idx), _READ_CHUNK):
      chunk = idx[a:a + _READ_CHUNK].tolist()
      try:
        records = ds.__getitems__(chunk)
      except TypeError:  # tfds.testing.mock_data's __getitems__ is broken; read one by one
        records = [ds[i] for i in chunk]
      src.extend(_text(r[self.src_key]) for r in records)
      tgt.extend(_text(r[self.tgt_key]) for r in records)
    return src, tgt


def _prepare(builder, make_builder, process_index: int, what: str, downloads: bool,
             progress: bool = False) -> tfds.core.DatasetBuilder:
  """Process 0 builds the dataset (with TFDS's progress bars if `progress`); the others open
  it once the hosts agreed that process 0 has (seq2seq.hosts)."""
  if builder.is_prepared():
    return builder
  if process_index != 0:
    builder = make_builder()  # re-read: process 0 wrote the files since
    if not builder.is_prepared():
      raise UserError(f"TFDS dataset {what} is not in {builder.data_dir}, though process 0 "
                      f"prepared it there: give a data_dir on a file system every host shares")
    return builder
  log.info("preparing TFDS dataset %s in %s", what, builder.data_dir)
  from tensorflow_datasets.core.utils import tqdm_utils
  was = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(progress)  # (none in training logs)
  try:
    catalog.prepare(builder, downloads)
  finally:
    tfds.display_progress_bar(was)
  return builder


def open_corpus(cfg: Config, process_index: int = 0, progress: bool = False):
  """The corpus named by cfg.data: a `parallel_text.TextCorpus` or a `TfdsCorpus` (prepared
  in cfg.data.data_dir). UserError on bad input, before anything is built."""
  d = cfg.data
  if d.dataset == "parallel_text":
    return parallel_text.open_corpus(d.train_files, d.validation_files, d.test_files,
                                     d.src_lang, d.tgt_lang, d.reverse)
  data_dir = d.data_dir or None
  if d.dataset == "numbers":
    if d.target_lang not in numbers.LANGUAGES:
      raise UserError(f"numbers task: target_lang must be one of "
                      f"{', '.join(numbers.LANGUAGES)}, got {d.target_lang!r}")
    make = lambda: numbers.Seq2seqNumbers(config=d.target_lang, data_dir=data_dir,  # noqa
                                          file_format="array_record")
  else:
    make = lambda: catalog.get_builder(d.dataset, data_dir)  # noqa: E731
  builder = make()
  src_key, tgt_key = catalog.supervised_keys(builder, d.reverse)  # before any download
  builder = _prepare(builder, make, process_index, d.dataset, d.dataset != "numbers", progress)
  return TfdsCorpus(builder, src_key, tgt_key)
