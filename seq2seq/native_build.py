"""Native code compiled on first use with the machine's compiler, one way for all of it: the
packing plan's loop (data/first_fit.c, called through ctypes) and the decode kernels
(kernels/*.cc, called through XLA's FFI).

A library is built into SEQ2SEQ_NATIVE_DIR (default $XDG_CACHE_HOME/seq2seq/native, i.e.
~/.cache/seq2seq/native), named by a hash of its sources, the compiler, its flags and whatever
else the caller says it depends on, so later processes load it in milliseconds. It is written
to a temporary file and renamed: concurrent builds each write whole files. SEQ2SEQ_NATIVE=off
turns all of it off. Where a library cannot be had, `Unavailable` says why in one line, and the
caller runs the same computation without it (Python's loop, XLA's code) and says so.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

OFF = "SEQ2SEQ_NATIVE=off"


class Unavailable(RuntimeError):
  """A library that cannot be had, and why (one line)."""


def turned_off() -> bool:
  return os.environ.get("SEQ2SEQ_NATIVE", "").lower() in ("off", "0", "false", "no")


def default_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seq2seq" / "native"


def directory() -> Path:
  return Path(os.environ.get("SEQ2SEQ_NATIVE_DIR") or default_dir())


# language -> (the variable that names its compiler, the compilers looked for on PATH)
COMPILERS = {"C": ("CC", ("cc", "gcc", "clang")), "C++": ("CXX", ("c++", "g++", "clang++"))}


def compiler(language: str) -> str | None:
  """The compiler of `language` ("C" or "C++"): $CC/$CXX if set, else the first on PATH."""
  env, names = COMPILERS[language]
  found = (shutil.which(n) for n in (os.environ.get(env), *names) if n)
  return next((path for path in found if path), None)


def build(name: str, language: str, sources, flags, *, headers=(), depends_on=(),
          where: Path | None = None) -> Path:
  """The library `seq2seq_{name}-{hash}.so` built from `sources` with `flags`, now if this
  hash (sources, headers, compiler, flags, `depends_on`) has none yet. Raises Unavailable
  when it is turned off or cannot be built (naming the compiler and its first error)."""
  if turned_off():
    raise Unavailable(OFF)
  cc = compiler(language)
  if cc is None:
    env, names = COMPILERS[language]
    raise Unavailable(f"no {language} compiler ({', '.join(names[:-1])} or {names[-1]}; or "
                      f"set {env}) on PATH")
  sources, where = [Path(s) for s in sources], Path(where or directory())
  key = hashlib.sha256("\0".join([*(Path(p).read_text() for p in (*sources, *headers)), cc,
                                  *flags, *depends_on]).encode()).hexdigest()[:16]
  lib = where / f"seq2seq_{name}-{key}.so"
  if lib.exists():
    return lib
  try:
    where.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=where)
    os.close(fd)
  except OSError as e:
    raise Unavailable(f"cannot write into {where}: {e.strerror or e}") from None
  try:
    p = subprocess.run([cc, *flags, *map(str, sources), "-o", tmp], capture_output=True,
                       text=True, errors="replace")
    if p.returncode:
      lines = p.stderr.strip().splitlines()
      first = next((l for l in lines if "error" in l), lines[0] if lines else
                   f"exit {p.returncode}")
      raise Unavailable(f"{cc} failed on {', '.join(s.name for s in sources)}: {first[:300]}")
    os.replace(tmp, lib)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return lib


@functools.cache
def say_why_without(what: str, why: str) -> None:
  """Says once a process, as a warning, that `what` runs without its native code, and `why`;
  nothing where SEQ2SEQ_NATIVE=off asked for it."""
  if why and why != OFF:
    warnings.warn(f"{what}: {why}")
