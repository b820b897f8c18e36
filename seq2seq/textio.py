"""Reading text files and streams the way both the data loader and decode.py need."""
from __future__ import annotations

import os
import stat
from typing import Iterator

from seq2seq.errors import UserError


def read_lines(source) -> list[str]:
  r"""The lines of `source`: a path, or an open binary or text stream (e.g. standard input).
  Lines split at "\n" only; "\n" / "\r\n" ends and a leading byte-order mark removed.
  A missing or unreadable file, or bytes that are not UTF-8, raise UserError."""
  return list(iter_lines(source))


def iter_lines(source) -> Iterator[str]:
  """`read_lines` one line at a time, for input that need not fit in memory (decode.py's).
  A path is opened now (one that cannot be read raises UserError here); bytes that are not
  UTF-8 raise UserError when their line is reached."""
  name, own = "standard input", False
  if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
    name, own = str(source), True
    try:
      source = open(source, "rb")
    except OSError as e:
      raise UserError(f"cannot read {name}: {e.strerror or e}") from None
  return _lines(source, name, own)


def _lines(stream, name: str, own: bool) -> Iterator[str]:
  try:
    for number, line in enumerate(stream, 1):   # binary streams split at b"\n" only
      if isinstance(line, bytes):
        try:
          line = line.decode("utf-8")
        except UnicodeDecodeError as e:
          raise UserError(f"{name} line {number}: invalid UTF-8 (byte 0x{line[e.start]:02x})"
                          ) from None
      if number == 1:
        line = line.removeprefix("\ufeff")
      yield line.removesuffix("\n").removesuffix("\r")
  finally:
    if own:
      stream.close()


def count_lines(path) -> int | None:
  """How many lines `read_lines(path)` would return, counted without decoding; None if
  `path` is not a regular file (a pipe can be read only once) or cannot be read."""
  try:
    if not stat.S_ISREG(os.stat(path).st_mode):
      return None
    count, last = 0, b"\n"
    with open(path, "rb") as f:
      while block := f.read(1 << 20):
        count += block.count(b"\n")
        last = block[-1:]
    return count + (last != b"\n")
  except OSError:
    return None
