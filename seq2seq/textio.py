"""Reading text files and streams the way both the data loader and decode.py need."""
from __future__ import annotations

from seq2seq.errors import UserError


def read_lines(source) -> list[str]:
  r"""The lines of `source`: a path, or an open binary or text stream (e.g. standard input).
  Lines split at "\n" only; "\n" / "\r\n" ends and a leading byte-order mark removed.
  A missing or unreadable file, or bytes that are not UTF-8, raise UserError."""
  name = "standard input"
  if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
    name = str(source)
    try:
      with open(source, "rb") as f:
        data = f.read()
    except OSError as e:
      raise UserError(f"cannot read {source}: {e.strerror or e}") from None
  else:
    data = source.read()
  if isinstance(data, bytes):
    try:
      text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
      line = data.count(b"\n", 0, e.start) + 1
      raise UserError(f"{name} line {line}: invalid UTF-8 (byte 0x{data[e.start]:02x})"
                      ) from None
  else:
    text = data
  text = text.removeprefix("\ufeff")
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return [line.removesuffix("\r") for line in lines]
