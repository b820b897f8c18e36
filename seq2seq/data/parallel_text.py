"""Your own parallel text, read where it lies: Moses-style aligned files or a two-column TSV.

    --config.data.dataset=parallel_text --config.data.train_files=corpus/train
        reads corpus/train.en and corpus/train.fr (line i translates line i), with
        src_lang=en, tgt_lang=fr; validation_files / test_files likewise (optional).
    --config.data.train_files=pairs.tsv       one `source<TAB>target` pair per line
    --config.data.train_files=corpus/         a directory: corpus/train.*, and
                                              corpus/{validation,valid,dev}.* and corpus/test.*
                                              when present

No copy is made and nothing is held whole: each file is scanned once per run, in blocks
(about a second a GB): its SHA-256, which keys the vocabulary and the token cache, where
each line starts and ends (NumPy), and the checks. Every problem is one line (`UserError`):
a missing file, an empty file, invalid UTF-8 (file and line), different line counts (both
files and both counts), a TSV line without exactly two columns. Lines are split on "\\n"
only (never on the other Unicode line separators, which would silently misalign a corpus);
a trailing "\\r" and a leading byte-order mark are removed. Lines are then read by number,
a block of the file at a time.
"""
from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import stat
from concurrent import futures

import numpy as np

from seq2seq import textio
from seq2seq.errors import UserError

_VALIDATION_NAMES = ("validation", "valid", "dev")


@dataclasses.dataclass(frozen=True)
class SplitFiles:
  """One split: a TSV file, or a pair of aligned files (source, target)."""
  paths: tuple[str, ...]

  @property
  def is_tsv(self) -> bool:
    return len(self.paths) == 1


def _is_tsv(path: str) -> bool:
  return path.endswith((".tsv", ".tsv.txt"))


def resolve_files(train_files: str, validation_files: str = "", test_files: str = "",
                  src_lang: str = "en", tgt_lang: str = "fr") -> dict[str, SplitFiles]:
  """Maps split name -> files from the config strings (train is required)."""
  if not train_files:
    raise UserError("dataset=parallel_text needs --config.data.train_files: a prefix "
                    f"(PREFIX.{src_lang} + PREFIX.{tgt_lang}), a .tsv file or a directory")
  if src_lang == tgt_lang:
    raise UserError(f"parallel_text: src_lang and tgt_lang are both {src_lang!r}")
  given = {"train": train_files, "validation": validation_files, "test": test_files}
  if os.path.isdir(train_files):
    def find(names):
      for name in names:
        prefix = os.path.join(train_files, name)
        if os.path.exists(f"{prefix}.{src_lang}"):
          return prefix
        if os.path.exists(f"{prefix}.tsv"):
          return f"{prefix}.tsv"
      return ""
    given["train"] = find(("train",)) or os.path.join(train_files, "train")
    given["validation"] = validation_files or find(_VALIDATION_NAMES)
    given["test"] = test_files or find(("test",))
  out = {}
  for split, spec in given.items():
    if not spec:
      continue
    if _is_tsv(spec):
      out[split] = SplitFiles((spec,))
    else:
      out[split] = SplitFiles((f"{spec}.{src_lang}", f"{spec}.{tgt_lang}"))
  return out


_BLOCK = 1 << 24   # bytes read at a time
_SPAN = 1 << 22    # lines read together when they start within this many bytes
_BOM = b"\xef\xbb\xbf"
_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


class TextFile:
  """One UTF-8 text file: its SHA-256 and line count (read once as it is opened), and, from
  the first read on, where each line's text starts and ends (`starts`/`ends`, int64 byte
  offsets, the line end and a "\\r" before it excluded; `tabs`, a TSV line's tab)."""

  def __init__(self, path: str, tsv: bool = False):
    self.path, self.tsv = path, tsv
    if not os.path.exists(path):
      raise UserError(f"parallel_text: no such file: {path}")
    if os.path.isdir(path):
      raise UserError(f"parallel_text: {path} is a directory, expected a text file")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):   # a FIFO or a device would be read forever, or block
      kind = next((k for test, k in _KINDS if test(mode)), "special file")
      raise UserError(f"parallel_text: {path} is not a regular file (a {kind}): give a file")
    with self._open() as f:
      self._stat = _identity(f)
      try:
        self.sha256, self._len, lone_cr = _digest(f)
      except OSError as e:
        self._unreadable(e)
      self._check_unchanged(f)
    if not self._len:
      raise UserError(f"parallel_text: {path} is empty")
    if lone_cr > self._len:   # more "\\r" alone than lines: its lines end so
      raise UserError(f"parallel_text: {path} ends its lines with \\r alone (old Mac OS line "
                      f"ends): convert them to \\n, e.g. with tr '\\r' '\\n'")
    self.starts = self.ends = self.tabs = None

  def _open(self):
    try:
      return open(self.path, "rb")
    except OSError as e:
      self._unreadable(e)

  def _unreadable(self, e: OSError):
    raise UserError(f"parallel_text: cannot read {self.path}: {e.strerror or e}") from None

  def _check_unchanged(self, f) -> None:
    """UserError if the file is not the one this run opened (its size, time or inode)."""
    if _identity(f) != self._stat:
      self._changed()

  def _changed(self):
    raise UserError(f"parallel_text: {self.path} changed while this run read it: run again "
                    f"once it is written")

  def __len__(self) -> int:
    return self._len

  def check(self) -> None:
    """Indexes the lines, checking that the bytes are UTF-8 and that a TSV line has two
    columns (UserError naming the first line that is wrong). Once, before the first read: a
    run whose vocabulary and token ids are stored reads no text at all."""
    if self.starts is None:
      with self._open() as f:
        self._check_unchanged(f)
        try:
          sha256, self.starts, self.ends, self.tabs = _index(f, self.path, self.tsv,
                                                             self._len)
        except OSError as e:
          self._unreadable(e)
        self._check_unchanged(f)
      if sha256 != self.sha256:   # not the text the run opened: nothing of it is read
        self.release()
        self._changed()

  def release(self) -> None:
    """Forgets the index (16 bytes a line) until the next read."""
    self.starts = self.ends = self.tabs = None

  def lines(self, indices=None) -> list[str]:
    """The lines `indices` (default: all), in that order."""
    self.check()
    idx = np.arange(len(self)) if indices is None else np.asarray(indices, np.int64)
    if len(idx) == 0:
      return []
    a, b = int(idx[0]), int(idx[-1]) + 1
    with self._open() as f:
      self._check_unchanged(f)
      try:
        if (b - a == len(idx) and np.all(np.diff(idx) == 1)
            and np.all(self.starts[a + 1:b] == self.ends[a:b - 1] + 1)):
          # a run of lines ended by "\\n" alone: decoded at once, split at "\\n"
          f.seek(self.starts[a])
          out = f.read(self.ends[b - 1] - self.starts[a]).decode("utf-8").split("\n")
        else:
          out = _read_lines(f, self.starts, self.ends, idx)
      except UnicodeDecodeError:   # (it was UTF-8 when indexed)
        self._changed()
      except OSError as e:
        self._unreadable(e)
      if len(out) != len(idx):
        self._changed()
      self._check_unchanged(f)
      return out

  def columns(self, indices=None) -> tuple[list[str], list[str]]:
    """A TSV file's two columns of lines `indices` (default: all)."""
    self.check()
    idx = np.arange(len(self)) if indices is None else np.asarray(indices, np.int64)
    with self._open() as f:
      self._check_unchanged(f)
      try:
        out = (_read_lines(f, self.starts, self.tabs, idx),
               _read_lines(f, self.tabs + 1, self.ends, idx))
      except UnicodeDecodeError:
        self._changed()
      except OSError as e:
        self._unreadable(e)
      self._check_unchanged(f)
      return out


def _identity(f) -> tuple[int, int, int, int]:
  """What tells an open file's version: device, inode, size, modification time (ns)."""
  st = os.fstat(f.fileno())
  return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _digest(f) -> tuple[str, int, int]:
  """(SHA-256, lines, "\\r" not before a "\\n") of an open file; 0 lines if it holds
  nothing but white space."""
  digest = hashlib.sha256()
  size, count, lone_cr, last, text = 0, 0, 0, b"\n", False
  while block := f.read(_BLOCK):
    digest.update(block)   # (hashing and NumPy's count let go of the interpreter)
    count += int(np.count_nonzero(np.frombuffer(block, np.uint8) == 10))
    if b"\r" in block or last == b"\r":   # (most text holds none)
      cr = block.count(b"\r")
      lone_cr += cr - block.count(b"\r\n") - (last == b"\r" and block[:1] == b"\n")
    text = text or bool((block[3:] if size == 0 and block.startswith(_BOM) else block).strip())
    size, last = size + len(block), block[-1:]
  return digest.hexdigest(), (count + (last != b"\n")) if text else 0, lone_cr


def _index(f, path: str, tsv: bool, lines: int):
  """(SHA-256, starts, ends, tab offsets or None) of an open file of `lines` lines (as
  `_digest` counted them; else the SHA-256 is None: it changed); UserError if it is not UTF-8
  or (tsv) a line has not exactly one tab. The offsets are written in place as the blocks
  are read: 17 bytes a line at most, at any time."""
  decoder = codecs.getincrementaldecoder("utf-8")()
  digest = hashlib.sha256()
  ends = np.empty(lines, np.int64)   # first each line's "\n", then where its text ends
  cr = np.zeros(lines, bool)         # its "\n" follows a "\r"
  tabs = []
  size, last, first, k = 0, 10, b"", 0
  while block := f.read(_BLOCK):
    digest.update(block)
    try:
      if not (block.isascii() and decoder.getstate()[0] == b""):
        decoder.decode(block)
    except UnicodeDecodeError:
      _raise_not_utf8(path)
    data = np.frombuffer(block, np.uint8)
    nl = np.flatnonzero(data == 10)
    if k + len(nl) > lines:
      return None, None, None, None
    ends[k:k + len(nl)] = nl + size
    cr[k:k + len(nl)] = data[np.maximum(nl - 1, 0)] == 13
    if len(nl) and nl[0] == 0:
      cr[k] = last == 13
    k += len(nl)
    if tsv:
      tabs.append(np.flatnonzero(data == 9) + size)
    first = first or block[:3]
    size, last = size + len(block), block[-1]
  try:
    decoder.decode(b"", final=True)
  except UnicodeDecodeError:
    _raise_not_utf8(path)
  if size and last != 10:   # a last line with no "\n"
    if k == lines:
      return None, None, None, None
    ends[k], cr[k] = size, last == 13
    k += 1
  if k != lines:
    return None, None, None, None
  starts = np.empty(lines, np.int64)
  if lines:
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
  ends -= cr
  del cr
  if size >= 3 and first == _BOM:
    starts[0] += 3
  if not tsv:
    return digest.hexdigest(), starts, ends, None
  tabs = np.concatenate(tabs).astype(np.int64)
  lo, hi = np.searchsorted(tabs, starts), np.searchsorted(tabs, ends)
  bad = np.flatnonzero(hi - lo != 1)
  if len(bad):
    i = int(bad[0])
    raise UserError(f"parallel_text: {path} line {i + 1}: expected 2 tab-separated "
                    f"columns (source<TAB>target), found {int(hi[i] - lo[i]) + 1}")
  return digest.hexdigest(), starts, ends, tabs[lo]


def _raise_not_utf8(path: str):
  for _ in textio.iter_lines(path):   # raises the UserError naming the line
    pass
  raise UserError(f"parallel_text: {path}: invalid UTF-8")


def _read_lines(f, starts: np.ndarray, ends: np.ndarray, idx: np.ndarray) -> list[str]:
  """Lines idx (byte ranges starts[i]:ends[i] of file f), a few MB of the file a read."""
  order = np.argsort(idx, kind="stable")
  s, e = starts[idx[order]], ends[idx[order]]
  out = [""] * len(idx)
  a = 0
  while a < len(order):
    b = a + max(1, int(np.searchsorted(s[a:], s[a] + _SPAN, side="right")))
    lo = int(s[a])
    f.seek(lo)
    buf = f.read(int(e[a:b].max()) - lo)
    for k, x, y in zip(order[a:b].tolist(), (s[a:b] - lo).tolist(), (e[a:b] - lo).tolist()):
      out[k] = buf[x:y].decode("utf-8")
    a = b
  return out


def _two_at_a_time(fn, items) -> list:
  """fn(item) of each item, two at a time (hashing and NumPy let go of the interpreter):
  the results in order, or the first item's error."""
  with futures.ThreadPoolExecutor(2) as pool:
    return [f.result() for f in [pool.submit(fn, x) for x in items]]


class TextCorpus:
  """Your parallel text's splits, read by line number (`read`), never held whole."""

  def __init__(self, files: dict[str, SplitFiles], src_lang: str, tgt_lang: str,
               reverse: bool = False):
    self.files = files
    self.src_lang, self.tgt_lang = src_lang, tgt_lang
    self.src_key, self.tgt_key = (tgt_lang, src_lang) if reverse else (src_lang, tgt_lang)
    self.name = f"parallel_text {files['train'].paths[0]}"
    self.splits = tuple(files)
    opened = iter(_two_at_a_time(lambda x: TextFile(*x), [(p, f.is_tsv) for f in files.values()
                                                          for p in f.paths]))
    self._text = {split: tuple(next(opened) for _ in f.paths) for split, f in files.items()}
    for split, f in self._text.items():
      if len(f) == 2 and len(f[0]) != len(f[1]):
        raise UserError(f"parallel_text: {f[0].path} has {len(f[0])} lines but "
                        f"{f[1].path} has {len(f[1])} lines")

  def num_examples(self, split: str) -> int:
    return len(self._text[split][0])

  def check(self, split: str) -> None:
    """The split's files are UTF-8 and well formed (`TextFile.check`)."""
    _two_at_a_time(TextFile.check, self._text[split])

  def release(self, split: str) -> None:
    """Forgets the split's line index until it is read again."""
    for f in self._text[split]:
      f.release()

  def identity(self, split: str) -> str:
    """What a split's pairs are: the languages, the direction and its files' SHA-256."""
    return (f"parallel_text {self.src_key}>{self.tgt_key} "
            + " ".join(f.sha256 for f in self._text[split]))

  def files_sha256(self, split: str) -> str:
    """SHA-256 of the split's files' SHA-256 digests, in file order."""
    h = hashlib.sha256()
    for f in self._text[split]:
      h.update(bytes.fromhex(f.sha256))
    return h.hexdigest()

  def text_bytes(self, split: str) -> int:
    """The split's bytes (its files' sizes)."""
    return sum(os.path.getsize(f.path) for f in self._text[split])

  def read(self, split: str, indices=None) -> tuple[list[str], list[str]]:
    """(sources, targets) of pairs `indices` (default: all) of `split`."""
    if split not in self._text:
      raise UserError(f"dataset {self.name} has no split {split!r} "
                      f"(available: {', '.join(self.splits)})")
    self.check(split)   # (its files indexed two at a time, before the first read)
    f = self._text[split]
    src, tgt = f[0].columns(indices) if len(f) == 1 else (f[0].lines(indices),
                                                           f[1].lines(indices))
    return (tgt, src) if self.src_key != self.src_lang else (src, tgt)


def open_corpus(train_files: str, validation_files: str = "", test_files: str = "",
                src_lang: str = "en", tgt_lang: str = "fr", reverse: bool = False
                ) -> TextCorpus:
  """The corpus the config names, its files scanned and checked (UserError on a problem)."""
  return TextCorpus(resolve_files(train_files, validation_files, test_files, src_lang,
                                  tgt_lang), src_lang, tgt_lang, reverse)
