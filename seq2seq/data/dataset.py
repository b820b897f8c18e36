"""`load_dataset(cfg, workdir)`: the data path's stages, in order, and the batches they give.

    ds = load_dataset(cfg, workdir)
    ds.tokenizer                      # SentencePiece, PAD 0 / BOS 1 / EOS 2 / UNK 3
    ds.train_batches(start_step)      # infinite, deterministic, this host's rows
    ds.eval_batches("test", 64)       # padded, never dropped
    ds.num_examples("train"), ds.splits, ds.stats

  1. the corpus (corpus.py): your text files, a TFDS dataset or the embedded task;
  2. the vocabulary (vocabulary.py): <workdir>/vocab.model, trained once on a sample;
  3. token ids on disk (token_ids.py): <workdir>/data_cache/, made once, memory-mapped;
  4. packed rows for each host (pipeline.py): the length policy, each epoch's plan.
Also <workdir>/train_sources.json: what the training sources were (sources.py).

Sources are lower-cased before tokenizing when data.lowercase_source says (the numbers task).
On several hosts each stage ends in the hosts' agreement (seq2seq.hosts): process 0 makes
the vocabulary (and a TFDS dataset) while the others wait; then every host makes its own
shards' token ids at once (gathered from another host count's where a run stored them);
then they are published. A refusal on any host stops every host at the agreement it
reaches next. A new vocabulary is published as soon as it is trained, token ids once every
check on the data has passed on every host (the files, the shards, the lengths): a refused
run leaves no vocabulary or cache of its own behind, and a vocabulary it replaced is back.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

from seq2seq.config import Config
from seq2seq.data import sources, token_ids, vocabulary
from seq2seq.data.corpus import open_corpus
from seq2seq.data.files import atomic_write, cannot_write
from seq2seq.data.pipeline import TrainStream, apply_length_policy, host_shards, pad_batch
from seq2seq.data.tokenizer import Tokenizer
from seq2seq import hosts
from seq2seq.errors import UserError
from seq2seq.workdir import Workdir

NUMBERS_MAX_VOCAB = vocabulary.NUMBERS_MAX_VOCAB
LONG = 10.0   # seconds: data that took longer says what the time went on


class Dataset:
  """One corpus's token ids and the batches built from them."""

  def __init__(self, cfg: Config, wd: Workdir, corpus, tokenizer: Tokenizer,
               process_index: int, process_count: int, progress: bool = False):
    self.cfg, self.corpus, self.tokenizer = cfg, corpus, tokenizer
    self.workdir, self.progress = wd, progress
    self.process_index, self.process_count = process_index, process_count
    self.splits = corpus.splits
    self._made: list[tuple[Path, Path]] = []   # tokenized here, not yet published
    self._published = False
    self.tokenizing_s = self.checking_s = 0.0   # seconds tokenizing; checking stored ids
    self.regrouped: dict[str, int] = {}   # shards gathered from another count's: that count
    if "train" not in self.splits:
      raise UserError(f"dataset {corpus.name} has no 'train' split "
                      f"(available: {', '.join(self.splits)})")
    self.host_batch_size = cfg.train.batch_size // process_count
    for split in self.splits[1:]:   # read at every evaluation: checked before the first
      corpus.check(split)
    self._eval = {}
    self._build_train()
    # and their token ids, made (or checked) now: a fault shows before training, not after
    self._eval_ids = {split: self._token_ids(split, None, "all") for split in self.splits[1:]}

  # --- token ids, on disk -------------------------------------------------------------------

  def _token_ids(self, split: str, indices, shard: str,
                 of: tuple[int, int] | None = None, last: bool = False) -> token_ids.TokenIds:
    """The split's (shard's) stored token ids, checked; if there are none (or they are
    broken: set aside, said in one line), gathered from those of another shard count
    (shard `of` = (shard, shards); `token_ids.regroup`), else tokenized (`last`: the split's
    text is read no more after, and its index goes once it is read)."""
    identity = self.corpus.identity(split)
    where = token_ids.path(self.workdir.data_cache, self.tokenizer, identity, split, shard)
    start = time.perf_counter()
    try:
      ids = token_ids.load(where, self.tokenizer.vocab_size)
    except token_ids.Broken as why:
      warnings.warn(f"{where}: {why}; set aside, tokenizing it again")
      token_ids.set_aside(where)
      ids = None
    stored = None
    if ids is None and of is not None:
      n = self.corpus.num_examples(split)
      stored = token_ids.stored_shards(self.workdir.data_cache, self.tokenizer, identity,
                                       split, n, *of)
    self.checking_s += time.perf_counter() - start
    if ids is None:
      made, start = token_ids.staging(where), time.perf_counter()
      if stored is not None:
        ids = token_ids.regroup(stored, split, n, *of, self.tokenizer, identity, made,
                                progress=self.progress, published_as=where)
        self.regrouped[shard] = stored[0]
      else:
        ids = token_ids.tokenize(self.corpus, split, indices, self.tokenizer, made,
                                 progress=self.progress, published_as=where, release=last)
      self.tokenizing_s += time.perf_counter() - start
      self._made.append((made, where))
      if self._published:
        self.publish()
    return ids

  def publish(self) -> None:
    """Moves the token ids made so far into place; from now on they are published as made."""
    for made, where in self._made:
      try:
        token_ids.publish(made, where, self.tokenizer.vocab_size)
      except OSError as e:
        raise cannot_write(where, e) from None
    moved = dict(self._made)
    self._eval_ids = {split: dataclasses.replace(ids, path=moved.get(ids.path, ids.path))
                      for split, ids in self._eval_ids.items()}
    self._made, self._published = [], True

  # --- training -----------------------------------------------------------------------

  def _build_train(self):
    d, t = self.cfg.data, self.cfg.train
    n = self.corpus.num_examples("train")
    mine = host_shards(n, d.num_shards, t.batch_size, self.process_index, self.process_count)
    shards = d.num_shards or self.process_count
    src_limit, tgt_limit = min(d.max_src_len, t.seq_len), min(d.max_tgt_len, t.seq_len)
    self._streams, totals, host_examples = [], {}, 0
    self._sources = sources.Tally(self.tokenizer.vocab_size)
    made = {shard: self._token_ids("train", idx, f"{shard}of{shards}", (shard, shards),
                                   last=shard == max(mine))
            for shard, idx in mine.items()}
    self.corpus.release("train")   # its text is read no more: its index goes before the plans
    for shard, idx in mine.items():
      ids = made[shard]
      pairs, stats = apply_length_policy(ids.src, ids.tgt, src_limit, tgt_limit,
                                         d.length_policy)
      if stats["kept"] == 0:
        raise UserError(f"all {len(idx)} training pairs of shard {shard} are longer than "
                        f"the limits (source {src_limit}, target {tgt_limit} tokens with EOS); "
                        f"raise max_src_len/max_tgt_len/seq_len or use length_policy=truncate")
      for k in ("kept", "dropped_too_long", "truncated"):
        totals[k] = totals.get(k, 0) + stats[k]
      self._sources.add(ids, pairs)
      host_examples += len(idx)
      self._streams.append(TrainStream(pairs, batch_size=t.batch_size // shards,
                                       seq_len=t.seq_len, pack=d.pack, seed=t.seed,
                                       shard=shard))
    over = totals["dropped_too_long"] + totals["truncated"]
    if over:
      warnings.warn(f"{over} of {host_examples} training pairs are longer than {src_limit} "
                    f"source / {tgt_limit} target tokens (EOS included): "
                    + ("dropped" if d.length_policy == "drop" else "truncated"))
    self.stats = {
        "dataset": self.corpus.name, "source_key": self.corpus.src_key,
        "target_key": self.corpus.tgt_key, "vocab_size": self.tokenizer.vocab_size,
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
    try:
      while True:
        parts = [s.batch(step) for s in self._streams]
        yield parts[0] if len(parts) == 1 else {
            k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        step += 1
    finally:   # closed: the next epochs' plans being made are waited for
      for s in self._streams:
        s.finish()

  def train_sources(self, candidates: int = 100) -> sources.TrainSources:
    """The record of what the training sources were (`sources.Tally.record`)."""
    return self._sources.record(self.corpus, self.tokenizer, candidates)

  # --- evaluation ---------------------------------------------------------------------

  def num_examples(self, split: str) -> int:
    return self.corpus.num_examples(split)

  def _eval_split(self, split: str):
    if split not in self._eval:
      src_text, tgt_text = self.corpus.read(split)
      ids = self._eval_ids.get(split) or self._token_ids(split, None, "all")
      src, _ = ids.src.with_eos(self.cfg.data.max_src_len)
      tgt, _ = ids.tgt.with_eos(self.cfg.data.max_tgt_len)
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


def _open(cfg: Config, process_index: int, progress: bool):
  corpus = open_corpus(cfg, process_index, progress)
  if "train" not in corpus.splits:
    raise UserError(f"dataset {corpus.name} has no 'train' split")
  return corpus


def _tidy(wd: Workdir, corpus, tokenizer: Tokenizer, order_changes: bool) -> None:
  """What no run of the workdir reads any more: an earlier version's cache, what killed runs
  left, token ids of another vocabulary or of text that changed."""
  token_ids.replace_earlier_versions(wd.data_cache, wd, order_changes)
  token_ids.remove_staging(wd.data_cache)
  token_ids.remove_unusable(wd.data_cache, token_ids.vocabulary_key(tokenizer),
                            {split: corpus.identity(split) for split in corpus.splits})


def load_dataset(cfg: Config, workdir: Workdir | str | os.PathLike, *,
                 process_index: int | None = None, process_count: int | None = None,
                 progress: bool | None = None) -> Dataset:
  """The corpus of `cfg.data`, its vocabulary (<workdir>/vocab.model, trained on the
  training split unless a matching one is stored) and its token ids. UserError on bad
  input, before anything is published into the workdir. `process_index`/`process_count`
  default to JAX's (overridable for tests); `progress` (default: standard error is a
  terminal) shows bars for the long phases."""
  if process_index is None or process_count is None:
    pi, pc = _process()
    process_index = pi if process_index is None else process_index
    process_count = pc if process_count is None else process_count
  if progress is None:
    progress = sys.stderr.isatty()
  progress = progress and process_index == 0
  wd = Workdir.of(workdir)
  clock, waited = [time.perf_counter()], hosts.waited()
  made = wd.create()
  had_cache = wd.data_cache.is_dir()
  resuming = wd.checkpoints.is_dir() and any(wd.checkpoints.iterdir())
  corpus = tokenizer = None
  replaced = {}   # the files a new vocabulary replaced, put back if the run is refused
  try:
    with hosts.stage("vocabulary"):   # process 0's: the others wait here for it
      if process_index == 0 or cfg.data.dataset == "parallel_text":   # (not a TFDS dataset
        corpus = _open(cfg, process_index, progress)                  # process 0 builds)
      clock.append(time.perf_counter())
      if process_index == 0:
        tokenizer, new, record = vocabulary.vocabulary(cfg, wd, corpus, 0, progress)
        if new:   # published first: the other hosts tokenize their shards meanwhile
          replaced = {path: path.read_bytes() if path.is_file() else None   # (kilobytes)
                      for path in (wd.vocab, wd.vocab_record)}
          vocabulary.write(wd, tokenizer, record)
    with hosts.stage("token ids"):   # each host's shards, tokenized at once
      if corpus is None:
        corpus = _open(cfg, process_index, progress)
      if tokenizer is None:   # the one process 0 stored
        tokenizer = vocabulary.vocabulary(cfg, wd, corpus, process_index)[0]
      clock.append(time.perf_counter())
      tokenizer.lowercase_source = cfg.data.lowercase_source
      try:
        wd.data_cache.mkdir(exist_ok=True)
      except OSError as e:
        raise cannot_write(wd.data_cache, e) from None
      ds = Dataset(cfg, wd, corpus, tokenizer, process_index, process_count, progress)
    with hosts.stage("published"):
      ds.publish()
      if process_index == 0:
        _tidy(wd, corpus, tokenizer, resuming and cfg.data.dataset == "parallel_text")
        sources.write(wd, ds.train_sources())
  except BaseException:   # refused (or interrupted): what it made goes, what it replaced
    token_ids.remove_staging(wd.data_cache, os.getpid())   # is back (each host its own, and
    if not had_cache and process_index == 0:                # process 0 the workdir's)
      shutil.rmtree(wd.data_cache, ignore_errors=True)
    for path, data in replaced.items():
      if data is None:
        path.unlink(missing_ok=True)
      else:
        atomic_write(path, data)
    wd.remove_made(made)
    raise
  clock.append(time.perf_counter())
  seconds = dict(zip(("corpus", "vocabulary", "rows"), np.diff(clock).tolist()))
  seconds["token ids"], seconds["checks"] = ds.tokenizing_s, ds.checking_s
  seconds["other hosts"] = hosts.waited() - waited   # (waiting for them)
  seconds["rows"] -= ds.tokenizing_s + ds.checking_s + seconds["other hosts"]
  ds.stats["seconds"] = seconds
  if process_index == 0 and clock[-1] - clock[0] >= LONG:   # what the time went on
    print(f"data ready in {clock[-1] - clock[0]:.0f} s: " + ", ".join(
        f"{k} {seconds[k]:.1f} s" for k in ("corpus", "vocabulary", "token ids", "checks",
                                            "rows", "other hosts")
        if k != "other hosts" or process_count > 1),
        file=sys.stderr, flush=True)
  return ds
