"""first_fit.c, compiled on first use with the machine's C compiler and called through ctypes:
the packing plan's loop (`pipeline._first_fit_rows`, the same rule in Python) at ~50x its
speed, so that an epoch of millions of pairs is planned in a fraction of a second.

Built and found as all native code is (`seq2seq.native_build`). Without a compiler, with a
build that fails, or with SEQ2SEQ_NATIVE=off, `rows` returns None and the caller runs the
Python loop, saying why once (`say_why_python`; not when SEQ2SEQ_NATIVE=off asked for it).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from seq2seq import native_build

SOURCE = Path(__file__).with_name("first_fit.c")
FLAGS = ("-O2", "-shared", "-fPIC")
_why_not = ""


@functools.cache
def _library():
  """The loaded library, or None when it cannot be had (`unavailable_reason` says why)."""
  global _why_not
  try:
    lib = native_build.build("first_fit", "C", [SOURCE], FLAGS)
    f = ctypes.CDLL(str(lib)).seq2seq_first_fit
  except native_build.Unavailable as e:
    _why_not = str(e)
    return None
  except (OSError, AttributeError) as e:
    _why_not = f"cannot load the library built from {SOURCE.name}: {getattr(e, 'strerror', None) or e}"
    return None
  i32 = np.ctypeslib.ndpointer(np.int32, flags="C")
  f.argtypes = [i32, i32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, i32]
  f.restype = ctypes.c_int64
  return f


def available() -> bool:
  return _library() is not None


def unavailable_reason() -> str:
  """Why the compiled loop cannot be had ("" if it can)."""
  return "" if available() else _why_not


def say_why_python() -> None:
  """Says once, as a warning, that the plan runs the Python loop, and why (not when
  SEQ2SEQ_NATIVE=off asked for it)."""
  native_build.say_why_without("the packing plan runs its Python loop, ~50x slower than "
                               "first_fit.c", unavailable_reason())


def rows(src_len: np.ndarray, tgt_len: np.ndarray, seq_len: int, window: int,
         max_rows: int) -> np.ndarray | None:
  """`pipeline._first_fit_rows(...)` computed in C; None where the library cannot be had."""
  f = _library()
  if f is None or not 1 <= window <= 256:
    return None
  src_len = np.ascontiguousarray(src_len, np.int32)
  tgt_len = np.ascontiguousarray(tgt_len, np.int32)
  row = np.empty(len(src_len), np.int32)
  f(src_len, tgt_len, len(src_len), seq_len, window, max_rows, row)
  return row
