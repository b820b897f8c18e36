"""first_fit.c, compiled on first use with the machine's C compiler and called through ctypes:
the packing plan's loop (`pipeline._first_fit_rows`, the same rule in Python) at ~50x its
speed, so that an epoch of millions of pairs is planned in a fraction of a second.

The library is built into $XDG_CACHE_HOME/seq2seq/native (default ~/.cache/seq2seq/native;
SEQ2SEQ_NATIVE_DIR elsewhere), named by a hash of its source and the compiler, so later
processes load it at once. Without a compiler, with a build that fails, or with
SEQ2SEQ_NATIVE=off, `rows` returns None and the caller runs the Python loop, saying why
once (`say_why_python`; not when SEQ2SEQ_NATIVE=off asked for it).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("first_fit.c")
FLAGS = ("-O2", "-shared", "-fPIC")


def _directory() -> Path:
  if os.environ.get("SEQ2SEQ_NATIVE_DIR"):
    return Path(os.environ["SEQ2SEQ_NATIVE_DIR"])
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seq2seq" / "native"


_why_not = ""


@functools.cache
def _library():
  """The loaded library, or None when it cannot be had (`unavailable_reason` says why)."""
  global _why_not
  if os.environ.get("SEQ2SEQ_NATIVE", "").lower() in ("off", "0", "false", "no"):
    _why_not = "SEQ2SEQ_NATIVE is off"
    return None
  cc = next((p for p in map(shutil.which, (os.environ.get("CC") or "cc", "gcc", "clang"))
             if p), None)
  if cc is None:
    _why_not = "no C compiler (cc, gcc or clang) on PATH"
    return None
  key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *FLAGS]).encode()).hexdigest()[:16]
  where = _directory()
  lib = where / f"seq2seq_first_fit-{key}.so"
  try:
    if not lib.exists():
      where.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(suffix=".so", dir=where)   # then renamed: concurrent builds
      os.close(fd)                                          # each write whole files
      try:
        built = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                               text=True, errors="replace")
        if built.returncode:
          said = (built.stderr.strip().splitlines() or [f"exit {built.returncode}"])[0]
          _why_not = f"{cc} failed on {SOURCE.name}: {said}"
          return None
        os.replace(tmp, lib)
      finally:
        if os.path.exists(tmp):
          os.remove(tmp)
    f = ctypes.CDLL(str(lib)).seq2seq_first_fit
  except (OSError, AttributeError) as e:
    _why_not = f"cannot build or load {lib}: {getattr(e, 'strerror', None) or e}"
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


@functools.cache
def say_why_python() -> None:
  """Says once, as a warning, that the plan runs the Python loop, and why (not when
  SEQ2SEQ_NATIVE=off asked for it)."""
  why = unavailable_reason()
  if why and why != "SEQ2SEQ_NATIVE is off":
    warnings.warn(f"the packing plan runs its Python loop, ~50x slower than first_fit.c: "
                  f"{why}")


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
