"""`load_dataset(cfg, workdir)`: the one entry point train.py and the evaluation use.

    ds = load_dataset(cfg, workdir)
    ds.tokenizer                      # SentencePiece, PAD 0 / BOS 1 / EOS 2 / UNK 3
    ds.train_batches(start_step)      # infinite, deterministic, this host's rows
    ds.eval_batches("test", 64)       # padded, never dropped
    ds.num_examples("train"), ds.splits, ds.stats

Where things live:
  * TFDS data (array_record) in cfg.data.data_dir ("" -> $TFDS_DATA_DIR or
    ~/tensorflow_datasets), built by process 0 and waited for by the others;
  * the SentencePiece model at <workdir>/vocab.model, and beside it vocab.json: what it was
    built from (the training data's identity and the SentencePiece settings) and its
    SHA-256. A stored vocabulary is reused only if it was built from the same data and
    settings, or if a run (config.json) already depends on it;
  * tokenized splits (flat int32 tokens + offsets, .npz) in <workdir>/data_cache/, keyed by
    the vocabulary, the dataset and the host shard, so each split is tokenized once;
  * what the training sources were (longest, pieces, an example) in
    <workdir>/train_sources.json (sources.py), for decode.py's warnings.

Sources are lower-cased before tokenizing when data.lowercase_source says (the numbers task).
Nothing is written into the workdir until every check on the data has passed (the files,
the shards, the lengths): a refused run leaves no vocabulary or cache behind.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import tensorflow_datasets as tfds

from seq2seq.config import Config
from seq2seq.data import catalog, numbers, parallel_text, sources
from seq2seq.data.pipeline import Ragged, TrainStream, apply_length_policy, pad_batch
from seq2seq.data.tokenizer import (EOS_ID, Tokenizer, atomic_write, normalize_source,
                                    wait_for)
from seq2seq.errors import UserError
from seq2seq.workdir import Workdir

log = logging.getLogger("seq2seq.data")

NUMBERS_MAX_VOCAB = 1024      # the numbers task needs ~370 ids (260 are specials + bytes)
SPM_MAX_PAIRS = 500_000       # SentencePiece trains on at most this many training pairs
PREPARE_TIMEOUT = 3600.0      # seconds a non-zero process waits for process 0's files
_READ_CHUNK = 4096


def _text(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


class Source:
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
    self._texts = {}

  def data_source(self, split: str):
    if split not in self.splits:
      raise UserError(f"dataset {self.name} has no split {split!r} "
                      f"(available: {', '.join(self.splits)})")
    if split not in self._sources:
      self._sources[split] = self.builder.as_data_source(split=split)
    return self._sources[split]

  def num_examples(self, split: str) -> int:
    return len(self.data_source(split))

  def read(self, split: str, indices=None) -> tuple[list[str], list[str]]:
    """(sources, targets) of examples `indices` (default: all) of `split`."""
    if split in self._texts:
      src, tgt = self._texts[split]
      if indices is None:
        return src, tgt
      return [src[i] for i in indices], [tgt[i] for i in indices]
    ds = self.data_source(split)
    idx = list(range(len(ds))) if indices is None else [int(i) for i in indices]
    src, tgt = [], []
    for a in range(0, len(idx), _READ_CHUNK):
      chunk = idx[a:a + _READ_CHUNK]
      try:
        records = ds.__getitems__(chunk)
      except TypeError:  # tfds.testing.mock_data's __getitems__ is broken; read one by one
        records = [ds[i] for i in chunk]
      src.extend(_text(r[self.src_key]) for r in records)
      tgt.extend(_text(r[self.tgt_key]) for r in records)
    if indices is None:
      self._texts[split] = (src, tgt)
    return src, tgt


def _prepare(builder, make_builder, process_index: int, what: str, downloads: bool
             ) -> tfds.core.DatasetBuilder:
  """Process 0 builds the dataset; the others wait until it is there."""
  if builder.is_prepared():
    return builder
  if process_index != 0:
    wait_for(lambda: make_builder().is_prepared(), f"TFDS dataset {what}", PREPARE_TIMEOUT,
             poll=5.0)
    return make_builder()  # re-read now that the files exist
  log.info("preparing TFDS dataset %s in %s", what, builder.data_dir)
  from tensorflow_datasets.core.utils import tqdm_utils
  was = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)  # no per-example progress bars in training logs
  try:
    catalog.prepare(builder, downloads)
  finally:
    tfds.display_progress_bar(was)
  return builder


def open_source(cfg: Config, process_index: int = 0) -> Source:
  """The dataset named by cfg.data, prepared in cfg.data.data_dir."""
  d = cfg.data
  data_dir = d.data_dir or None
  if d.dataset == "numbers":
    if d.target_lang not in numbers.LANGUAGES:
      raise UserError(f"numbers task: target_lang must be one of "
                      f"{', '.join(numbers.LANGUAGES)}, got {d.target_lang!r}")
    make = lambda: numbers.Seq2seqNumbers(config=d.target_lang, data_dir=data_dir,  # noqa
                                          file_format="array_record")
  elif d.dataset == "parallel_text":
    make = lambda: parallel_text.make_builder(  # noqa: E731
        d.train_files, d.validation_files, d.test_files, d.src_lang, d.tgt_lang, data_dir)
  else:
    make = lambda: catalog.get_builder(d.dataset, data_dir)  # noqa: E731
  builder = make()
  src_key, tgt_key = catalog.supervised_keys(builder, d.reverse)  # before any download
  downloads = d.dataset not in ("numbers", "parallel_text")
  builder = _prepare(builder, make, process_index, d.dataset, downloads)
  return Source(builder, src_key, tgt_key)


class Dataset:
  """Tokenized splits of one source and the batches built from them."""

  def __init__(self, cfg: Config, wd: Workdir, source: Source, tokenizer: Tokenizer,
               process_index: int, process_count: int, defer_writes: bool = False):
    self.cfg, self.source, self.tokenizer = cfg, source, tokenizer
    self.workdir = wd
    # With defer_writes, tokenized splits are kept until flush(): nothing is written before
    # the checks on the data (shards, lengths) have passed.
    self._pending: list[tuple[str, bytes]] | None = [] if defer_writes else None
    self.process_index, self.process_count = process_index, process_count
    self.splits = source.splits
    if "train" not in self.splits:
      raise UserError(f"dataset {source.name} has no 'train' split "
                      f"(available: {', '.join(self.splits)})")
    t = cfg.train
    if t.batch_size % process_count:
      raise UserError(f"batch_size {t.batch_size} is not divisible by the number of hosts "
                      f"({process_count})")
    self.host_batch_size = t.batch_size // process_count
    self._eval = {}
    self._build_train()

  # --- tokenized arrays, cached on disk -----------------------------------------------

  def _cache_path(self, split: str, shard: str) -> Path:
    key = hashlib.sha256(self.tokenizer.model_proto)
    key.update(f"{self.source.name}|{self.source.src_key}>{self.source.tgt_key}|{split}|"
               f"{shard}|{self.source.num_examples(split)}".encode())
    return self.workdir.data_cache / f"{split}-{shard}-{key.hexdigest()[:16]}.npz"

  def _tokenized(self, split: str, indices, shard: str) -> tuple[Ragged, Ragged]:
    """Token ids (no EOS) of examples `indices` of `split`, from the cache if present."""
    path = self._cache_path(split, shard)
    if path.exists():
      z = np.load(io.BytesIO(path.read_bytes()))
      return (Ragged(z["src_flat"], z["src_offsets"]), Ragged(z["tgt_flat"], z["tgt_offsets"]))
    src_text, tgt_text = self.source.read(split, indices)
    src = Ragged.from_lists(self.tokenizer.encode_batch(
        [self.tokenizer.normalize_source(s) for s in src_text]))
    tgt = Ragged.from_lists(self.tokenizer.encode_batch(tgt_text))
    buf = io.BytesIO()
    np.savez(buf, src_flat=src.flat, src_offsets=src.offsets, tgt_flat=tgt.flat,
             tgt_offsets=tgt.offsets)
    if self._pending is None:
      atomic_write(str(path), buf.getvalue())
    else:
      self._pending.append((str(path), buf.getvalue()))
    return src, tgt

  def flush(self) -> None:
    """Writes the tokenized splits kept so far; from now on they are written as made."""
    for path, data in self._pending or ():
      atomic_write(path, data)
    self._pending = None

  # --- training -----------------------------------------------------------------------

  def _build_train(self):
    d, t = self.cfg.data, self.cfg.train
    n = self.source.num_examples("train")
    shards = d.num_shards or self.process_count
    if shards % self.process_count or t.batch_size % shards:
      raise UserError(f"num_shards {shards} must be a multiple of the number of hosts "
                      f"({self.process_count}) and divide batch_size ({t.batch_size})")
    per_host = shards // self.process_count
    mine = range(self.process_index * per_host, (self.process_index + 1) * per_host)
    src_limit, tgt_limit = min(d.max_src_len, t.seq_len), min(d.max_tgt_len, t.seq_len)
    self._streams, totals, host_examples = [], {}, 0
    vocab = self.tokenizer.vocab_size
    self.source_pieces, self.longest_source = np.zeros(vocab, bool), 0   # (EOS included)
    for shard in mine:
      # Shard `shard`: every `shards`-th example, starting at `shard`.
      idx = np.arange(shard, n, shards)
      if len(idx) == 0:
        raise UserError(f"the training split has {n} examples, fewer than the {shards} shards")
      src, tgt = self._tokenized("train", idx, f"{shard}of{shards}")
      src, tgt, _, stats = apply_length_policy(src, tgt, src_limit, tgt_limit, d.length_policy)
      if stats["kept"] == 0:
        raise UserError(f"all {len(idx)} training pairs of shard {shard} are longer than "
                        f"the limits (source {src_limit}, target {tgt_limit} tokens with EOS); "
                        f"raise max_src_len/max_tgt_len/seq_len or use length_policy=truncate")
      for k in ("kept", "dropped_too_long", "truncated"):
        totals[k] = totals.get(k, 0) + stats[k]
      self.source_pieces |= np.bincount(src.flat, minlength=vocab)[:vocab] > 0
      self.longest_source = max(self.longest_source, int(src.lengths.max()))
      host_examples += len(idx)
      self._streams.append(TrainStream(src, tgt, batch_size=t.batch_size // shards,
                                       seq_len=t.seq_len, pack=d.pack, seed=t.seed,
                                       process_index=shard))
    over = totals["dropped_too_long"] + totals["truncated"]
    if over:
      warnings.warn(f"{over} of {host_examples} training pairs are longer than {src_limit} "
                    f"source / {tgt_limit} target tokens (EOS included): "
                    + ("dropped" if d.length_policy == "drop" else "truncated"))
    self.stats = {
        "dataset": self.source.name, "source_key": self.source.src_key,
        "target_key": self.source.tgt_key, "vocab_size": self.tokenizer.vocab_size,
        "train_examples": n, "host_examples": int(host_examples), "num_shards": shards,
        "process_index": self.process_index, "process_count": self.process_count,
        "length_policy": d.length_policy, "max_src_len": src_limit, "max_tgt_len": tgt_limit,
        **totals, "pack": d.pack,
        **self._streams[0].epoch_stats(0)}  # (packing figures of this host's first shard)

  def train_batches(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Infinite batches of int32 [batch_size // process_count, seq_len]: src, tgt (EOS-
    terminated, no BOS), src/tgt_segments (0 pad, 1.. example), src/tgt_positions.
    Batch k depends only on (seed, k, the shard): resuming at k repeats it exactly, and
    this host's rows are its shards' rows, stacked."""
    step = int(start_step)
    while True:
      parts = [s.batch(step) for s in self._streams]
      yield parts[0] if len(parts) == 1 else {
          k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
      step += 1

  def train_sources(self, candidates: int = 100) -> sources.TrainSources:
    """The record of what the training sources were, with an example: the first of the
    first `candidates` sources of the first held-out split (else train) that is like them."""
    seen = frozenset(np.flatnonzero(self.source_pieces).tolist()) - {EOS_ID}
    record = sources.TrainSources(self.longest_source, seen)
    split = next(s for s in ("test", "validation", "train") if s in self.splits)
    texts, _ = self.source.read(split, range(min(candidates, self.num_examples(split))))
    for text in texts:
      ids = self.tokenizer.encode(self.tokenizer.normalize_source(text)) + [EOS_ID]
      if text.strip() and not any(sources.unfamiliar(ids, self.tokenizer, record)):
        return dataclasses.replace(record, example=text)
    return record

  # --- evaluation ---------------------------------------------------------------------

  def num_examples(self, split: str) -> int:
    return self.source.num_examples(split)

  def _eval_split(self, split: str):
    if split not in self._eval:
      src_text, tgt_text = self.source.read(split)
      src, tgt = self._tokenized(split, None, "all")
      src, _ = src.with_eos(self.cfg.data.max_src_len)
      tgt, _ = tgt.with_eos(self.cfg.data.max_tgt_len)
      self._eval[split] = (src, tgt, src_text, tgt_text)
    return self._eval[split]

  def eval_batches(self, split: str, batch_size: int, max_examples: int = 0
                   ) -> Iterator[dict]:
    """Every example of `split` in stored order (the first `max_examples` if > 0), padded:
    src/tgt int32 [batch_size, L] (L = the longest in the split, at most max_src_len /
    max_tgt_len: longer ones are truncated, never dropped), valid bool [batch_size] (the
    last batch is topped up with all-zero rows), src_text/tgt_text (""-padded lists)."""
    src, tgt, src_text, tgt_text = self._eval_split(split)
    n = len(src) if max_examples <= 0 else min(max_examples, len(src))
    src_len = int(src.lengths[:n].max(initial=1))
    tgt_len = int(tgt.lengths[:n].max(initial=1))
    for a in range(0, n, batch_size):
      idx = np.arange(a, min(a + batch_size, n))
      batch = pad_batch(src, tgt, idx, batch_size, src_len, tgt_len)
      pad = [""] * (batch_size - len(idx))
      batch["src_text"] = src_text[a:a + len(idx)] + pad
      batch["tgt_text"] = tgt_text[a:a + len(idx)] + pad
      yield batch


def _process() -> tuple[int, int]:
  import jax
  return jax.process_index(), jax.process_count()


def vocab_built_from(cfg: Config, source: Source, vocab_size: int) -> dict:
  """What a vocabulary trained for `cfg` is built from: the training split's identity and
  the SentencePiece settings."""
  d = cfg.data
  if d.dataset == "parallel_text":   # the train files' bytes (not the other splits')
    h = hashlib.sha256()
    for split, paths in source.builder.builder_config.files:
      if split == "train":
        for path in paths:
          with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    data = f"parallel_text train files sha256 {h.hexdigest()[:16]}"
  else:
    data = source.name
  return {"training_data": data, "training_pairs": source.num_examples("train"),
          "source_key": source.src_key, "target_key": source.tgt_key,
          "lowercase_source": d.lowercase_source,
          "vocab_size": vocab_size, "spm_model_type": d.spm_model_type,
          "character_coverage": d.character_coverage, "max_pairs": SPM_MAX_PAIRS}


def _read_record(wd: Workdir) -> dict | None:
  try:
    record = json.loads(wd.vocab_record.read_text())
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def _stored_vocab(wd: Workdir, built_from: dict) -> tuple[bytes | None, str]:
  """(the stored vocabulary if this run may use it, why it may not: "" if it may)."""
  path = wd.vocab
  if not path.exists():
    return None, ""
  proto = path.read_bytes()
  record = _read_record(wd)
  of_a_run = wd.config.exists()   # its checkpoints depend on it
  if record is not None and record.get("sha256") != hashlib.sha256(proto).hexdigest():
    why = "it is not the file vocab.json describes"
  elif record is None:
    why = "" if of_a_run else "nothing records what it was built from"
  elif record.get("built_from") != built_from:
    was = record.get("built_from") or {}
    diff = [f"{k}: {was.get(k)!r} -> {v!r}" for k, v in built_from.items() if was.get(k) != v]
    why = f"it was built from other data or settings ({'; '.join(diff[:2])})"
  else:
    why = ""
  if why and of_a_run:   # kept, said: the run's embeddings are of these pieces
    warnings.warn(f"{path}: {why}; kept, as the run's checkpoints depend on it")
    why = ""
  return (None if why else proto), why


def _vocabulary(wd: Workdir, built_from: dict, sentences, process_index: int
                ) -> tuple[Tokenizer, bool]:
  """(the tokenizer, whether it is new and still to be written by `_write_vocabulary`).
  Process 0 reuses the stored vocabulary or trains one in memory; the others wait for the
  one process 0 writes."""
  path = wd.vocab
  if process_index != 0:
    def ready():
      proto, why = _stored_vocab(wd, built_from)
      return proto is not None and not why
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      wait_for(ready, str(path), PREPARE_TIMEOUT)
    return Tokenizer.load(str(path)), False
  proto, why = _stored_vocab(wd, built_from)
  if proto is not None:
    try:
      return Tokenizer(proto, str(path)), False
    except (RuntimeError, UserError) as e:
      if wd.config.exists():
        raise UserError(f"{path} is not a readable SentencePiece model ({e})") from None
      why = "it is not a readable SentencePiece model"
  if why:
    warnings.warn(f"{path}: {why}; no run uses it: training a new one in its place")
  d = built_from
  return Tokenizer.train(sentences(), vocab_size=d["vocab_size"],
                         model_type=d["spm_model_type"],
                         character_coverage=d["character_coverage"]), True


def _write_vocabulary(wd: Workdir, tokenizer: Tokenizer, built_from: dict) -> None:
  """vocab.model, then the record that vouches for it (a reader that finds the record finds
  its vocabulary)."""
  atomic_write(str(wd.vocab), tokenizer.model_proto)
  record = {"sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
            "built_from": built_from}
  atomic_write(str(wd.vocab_record), (json.dumps(record, indent=2) + "\n").encode())


def load_dataset(cfg: Config, workdir: Workdir | str | os.PathLike, *,
                 process_index: int | None = None, process_count: int | None = None
                 ) -> Dataset:
  """Prepares the data of `cfg.data`, the tokenizer (<workdir>/vocab.model, trained on the
  training split unless a matching one is stored) and the tokenized splits. UserError on
  bad input, before anything is written into the workdir.
  `process_index`/`process_count` default to JAX's (overridable for tests)."""
  if process_index is None or process_count is None:
    pi, pc = _process()
    process_index = pi if process_index is None else process_index
    process_count = pc if process_count is None else process_count
  d = cfg.data
  source = open_source(cfg, process_index)
  if "train" not in source.splits:
    raise UserError(f"dataset {source.name} has no 'train' split")
  vocab_size = min(d.vocab_size, NUMBERS_MAX_VOCAB) if d.dataset == "numbers" else d.vocab_size

  def sentences():
    n = source.num_examples("train")
    idx = None
    if n > SPM_MAX_PAIRS:
      idx = np.sort(np.random.default_rng(0).choice(n, SPM_MAX_PAIRS, replace=False))
    src, tgt = source.read("train", idx)
    log.info("training SentencePiece (%d pieces) on %d pairs", vocab_size, len(src))
    return [normalize_source(s, d.lowercase_source) for s in src] + tgt

  wd = Workdir.of(workdir)
  built_from = vocab_built_from(cfg, source, vocab_size)
  tokenizer, new = _vocabulary(wd, built_from, sentences, process_index)
  tokenizer.lowercase_source = d.lowercase_source
  ds = Dataset(cfg, wd, source, tokenizer, process_index, process_count, defer_writes=True)
  wd.path.mkdir(parents=True, exist_ok=True)
  if new:   # every check has passed: now the files
    _write_vocabulary(wd, tokenizer, built_from)
  ds.flush()
  if process_index == 0:
    sources.write(wd, ds.train_sources())
  return ds
