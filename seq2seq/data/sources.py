"""What a run's training sources were, kept in its workdir (`train_sources.json`): the
longest (tokens, EOS included), the pieces they hold, and one source of the run's own data.

A model answers anything with a confident translation; decode.py uses this record to say
which inputs are unlike everything the model was trained on (`unfamiliar`), and train.py's
closing hint shows the example. Gathered (`Tally`) as the training shards are built, written
by process 0 from the training pairs it reads (its shards, in a multi-host run).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
from etils import epath

from seq2seq.data import numbers
from seq2seq.data.tokenizer import EOS_ID, atomic_write
from seq2seq.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class TrainSources:
  longest: int              # tokens of the longest training source, EOS included
  pieces: frozenset         # ids of every piece the training sources hold
  example: str = ""         # a source of the run's data, held out when a split is


class Tally:
  """What the training sources hold, gathered shard by shard as they are built: the longest
  and the count of each piece, of the sources as rows hold them (the length policy's)."""

  def __init__(self, vocab_size: int):
    self.longest, self.counts = 0, np.zeros(vocab_size, np.int64)

  def add(self, ids, pairs) -> None:
    """A shard's token ids (token_ids.TokenIds) and the pairs training takes of them."""
    self.counts += pieces_trained_on(ids, pairs, len(self.counts))
    self.longest = max(self.longest, int(pairs.src_len.max()))

  def record(self, corpus, tokenizer, candidates: int = 100) -> TrainSources:
    """The record, with an example: the first of the first `candidates` sources of the
    first held-out split (else train) that is like them."""
    seen = frozenset(np.flatnonzero(self.counts).tolist()) - {EOS_ID}
    record = TrainSources(self.longest, seen)
    split = next(s for s in ("test", "validation", "train") if s in corpus.splits)
    texts, _ = corpus.read(split, range(min(candidates, corpus.num_examples(split))))
    for text in texts:
      ids = tokenizer.encode(tokenizer.normalize_source(text)) + [EOS_ID]
      if text.strip() and not any(unfamiliar(ids, tokenizer, record)):
        return dataclasses.replace(record, example=text)
    return record


def pieces_trained_on(ids, pairs, vocab: int) -> np.ndarray:
  """Occurrences of each piece in the sources the pairs take: the stored counts less those
  of what the length policy leaves out (pairs dropped, tails cut), read from those alone."""
  lens = ids.src.lengths
  taken = np.zeros(len(lens), lens.dtype)                # tokens of each stored source taken
  taken[pairs.keep] = pairs.src_len - 1
  out = np.flatnonzero(taken < lens)
  left = ids.read("src", ids.src.offsets[out].astype(np.int64) + taken[out], lens[out] - taken[out])
  return ids.src_pieces - np.bincount(left, minlength=vocab)[:vocab]


def write(workdir: Workdir | str | os.PathLike, record: TrainSources) -> None:
  data = {"longest": int(record.longest), "pieces": sorted(int(i) for i in record.pieces),
          "example": record.example}
  atomic_write(str(Workdir.of(workdir).train_sources), json.dumps(data).encode())


def read(workdir: Workdir | str | os.PathLike) -> TrainSources | None:
  """The workdir's record; None for a workdir written before runs kept one (or damaged)."""
  path = epath.Path(Workdir.of(workdir).train_sources)
  try:
    data = json.loads(path.read_text())
    return TrainSources(int(data["longest"]), frozenset(int(i) for i in data["pieces"]),
                        str(data.get("example", "")))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def unfamiliar(ids: Sequence[int], tokenizer, record: TrainSources | None
               ) -> tuple[bool, bool]:
  """(unseen, long) of a source as the model reads it (`ids`, EOS included): it holds a
  piece no training source held, or it is longer than the longest training source. Without
  a record only the vocabulary's own gaps count: byte-fallback and UNK pieces."""
  body = list(ids[:-1]) if len(ids) and ids[-1] == EOS_ID else list(ids)
  if record is None:
    return any(tokenizer.is_byte_or_unknown(i) for i in body), False
  return any(i not in record.pieces for i in body), len(ids) > record.longest


def what_the_model_reads(data_cfg) -> str | None:
  """What a model of this data config was trained to read, where a sentence can say it."""
  if data_cfg.dataset == "numbers":
    return (f"English number words from zero to {numbers.STRATA[-1][1] - 1:,}, as num2words "
            f"writes them (\"{numbers.number_words(342817, 'en')}\")")
  return None
