"""SentencePiece tokenizer with fixed special ids, trained once on the training split.

Ids: PAD 0, BOS 1, EOS 2, UNK 3, then the pieces. Byte fallback is on, so any character
the training text never showed is spelt as UTF-8 byte pieces (<0xE6> ...) and decodes back
exactly; UNK is only produced for invalid ids. Text is normalised with SentencePiece's
default `nmt_nfkc` rule (NFKC plus whitespace folding) on the way in.

`Tokenizer.encode` returns pieces only (no BOS/EOS); the data pipeline appends EOS. Sources
go through `normalize_source` first: lower-cased when the run's data.lowercase_source says.
"""
from __future__ import annotations

import io
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from seq2seq.data.files import atomic_write, wait_for  # noqa: F401 (also from here)
from seq2seq.errors import UserError

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class Tokenizer:
  """A SentencePiece model whose special ids are PAD 0, BOS 1, EOS 2, UNK 3."""
  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  unk_id = UNK_ID

  def __init__(self, model_proto: bytes, path: str = "", *, lowercase_source: bool = False):
    self._proto = model_proto
    self.path = str(path)
    self.lowercase_source = bool(lowercase_source)
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    got = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
    if got != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
      raise UserError(f"{path or 'tokenizer'}: special ids (pad, bos, eos, unk) are {got}, "
                      f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}")

  # --- construction ----------------------------------------------------------------------

  @classmethod
  def load(cls, path: str, *, lowercase_source: bool = False) -> "Tokenizer":
    p = epath.Path(path)
    if not p.exists():
      raise UserError(f"no SentencePiece model at {path}")
    try:
      return cls(p.read_bytes(), str(path), lowercase_source=lowercase_source)
    except (RuntimeError, OSError) as e:
      raise UserError(f"{path} is not a readable SentencePiece model ({e})") from None

  @classmethod
  def train(cls, sentences: Iterable[str], path: str = "", *, vocab_size: int = 8000,
            model_type: str = "unigram", character_coverage: float = 1.0,
            num_threads: int = 2) -> "Tokenizer":
    """Trains on `sentences`; writes the model to `path` atomically if given.

    `vocab_size` counts everything (4 specials + 256 byte pieces + learned pieces); it is a
    soft limit for unigram (a small corpus may yield fewer pieces instead of failing).
    """
    out = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(sentences), model_writer=out,
          **cls.trainer_args(vocab_size, model_type, character_coverage, num_threads))
    except RuntimeError as e:
      raise UserError(f"SentencePiece training failed: {str(e).strip().splitlines()[-1]}") \
          from None
    tok = cls(out.getvalue(), str(path))
    if path:
      atomic_write(path, out.getvalue())
    return tok

  @staticmethod
  def trainer_args(vocab_size: int = 8000, model_type: str = "unigram",
                   character_coverage: float = 1.0, num_threads: int = 2) -> dict:
    """SentencePieceTrainer.train's settings for a vocabulary of `vocab_size` ids. Its
    threads stay 2 on any machine: the model SentencePiece makes depends on their number
    (on the Bible's 29k English verses, 1, 2, 4 and 8 threads made four different unigram
    and four different BPE models; each the same again for the same number), so a
    vocabulary of the same text and settings is the same everywhere."""
    if model_type not in ("unigram", "bpe", "char", "word"):
      raise UserError(f"spm_model_type must be unigram, bpe, char or word, got {model_type!r}")
    if vocab_size < 4 + 256 + 2:
      raise UserError(f"vocab_size {vocab_size} is too small: byte fallback alone needs 260 "
                      f"ids plus a few pieces")
    return dict(vocab_size=vocab_size, model_type=model_type,
                character_coverage=character_coverage, byte_fallback=True,
                pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
                pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>", unk_piece="<unk>",
                hard_vocab_limit=False, train_extremely_large_corpus=False,
                max_sentence_length=1 << 16, num_threads=num_threads, minloglevel=2)

  # --- use -------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def model_proto(self) -> bytes:
    return self._proto

  def encode(self, text: str) -> list[int]:
    """Piece ids of `text`, without BOS/EOS."""
    return self._sp.encode(text)

  def normalize_source(self, text: str) -> str:
    """A source sentence as the model reads it (before `encode`)."""
    return normalize_source(text, self.lowercase_source)

  def is_byte_or_unknown(self, i: int) -> bool:
    """A byte-fallback piece (a character the vocabulary has no piece for) or UNK."""
    return self._sp.is_byte(int(i)) or self._sp.is_unknown(int(i))

  def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
    return self._sp.encode(list(texts), num_threads=num_threads)

  def _clean(self, ids) -> list[int]:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    stop = np.flatnonzero(ids == EOS_ID)
    if stop.size:
      ids = ids[:stop[0]]
    keep = (ids != PAD_ID) & (ids != BOS_ID) & (ids >= 0) & (ids < self.vocab_size)
    return ids[keep].tolist()

  def decode(self, ids) -> str:
    """Text of `ids` (a list or 1-D array): stops at the first EOS, skips PAD and BOS."""
    return self._sp.decode(self._clean(ids))

  def decode_batch(self, ids_BxT) -> list[str]:
    return [self.decode(row) for row in ids_BxT]

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))


def normalize_source(text: str, lowercase: bool) -> str:
  return text.lower() if lowercase else text


def get_tokenizer(path: str, sentences_fn, *, vocab_size: int, model_type: str,
                  character_coverage: float, process_index: int = 0,
                  timeout: float = 1800.0, lowercase_source: bool = False) -> Tokenizer:
  """Loads the model at `path`, or trains it: process 0 trains on `sentences_fn()` and
  writes atomically, the other processes wait for the file."""
  p = epath.Path(path)
  if not p.exists():
    if process_index == 0:
      Tokenizer.train(sentences_fn(), path, vocab_size=vocab_size, model_type=model_type,
                      character_coverage=character_coverage)
    else:
      wait_for(p.exists, path, timeout)
  return Tokenizer.load(path, lowercase_source=lowercase_source)
