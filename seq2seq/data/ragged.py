"""Ragged arrays: many int sequences as one flat array and the offsets between them, the form
token ids take on disk (token_ids.py) and in batches (pipeline.py)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from seq2seq.data.tokenizer import EOS_ID


@dataclasses.dataclass(frozen=True)
class Ragged:
  """A list of int32 sequences as `flat` tokens and `offsets` ([n+1], offsets[0] == 0)."""
  flat: np.ndarray
  offsets: np.ndarray

  @classmethod
  def from_lists(cls, seqs) -> "Ragged":
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32,
                       count=int(offsets[-1]))
    return cls(flat, offsets)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def __getitem__(self, i: int) -> np.ndarray:
    return self.flat[self.offsets[i]:self.offsets[i + 1]]

  def take(self, idx: np.ndarray) -> "Ragged":
    idx = np.asarray(idx, np.int64)
    lens = self.lengths[idx]
    offsets = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Ragged(self.flat[gather_index(self.offsets[idx], lens)], offsets)

  def with_eos(self, max_len: int) -> tuple["Ragged", np.ndarray]:
    """Each sequence cut to max_len - 1 tokens and EOS appended; also the cut mask."""
    lens = self.lengths
    keep_lens = np.minimum(lens, max_len - 1)
    src = gather_index(self.offsets[:-1], keep_lens)
    new_lens = keep_lens + 1
    offsets = np.zeros(len(self) + 1, np.int64)
    np.cumsum(new_lens, out=offsets[1:])
    flat = np.full(int(offsets[-1]), EOS_ID, np.int32)
    flat[gather_index(offsets[:-1], keep_lens)] = self.flat[src]
    return Ragged(flat, offsets), lens > keep_lens


def gather_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
  """Concatenation of arange(s, s + l) for each (s, l): the flat positions of a selection."""
  starts, lens = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
  total = int(lens.sum())
  if total == 0:
    return np.zeros(0, np.int64)
  excl = np.cumsum(lens) - lens
  return np.repeat(starts - excl, lens) + np.arange(total, dtype=np.int64)
