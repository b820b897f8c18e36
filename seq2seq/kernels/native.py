"""C++ kernels for XLA:CPU, compiled on first use with the machine's C++ compiler and called
through XLA's FFI: `decode_attention` (decode_attention.cc), a decode step's attention read
once from its cache (bfloat16 or float32), in place or through beam search's table of rows;
`top_k_logsumexp` (top_k.cc), a row's best entries and its logsumexp in one read.

The library is built for this CPU (-march=native, or SEQ2SEQ_NATIVE_MARCH's value, e.g.
x86-64-v3 for AVX2 only; ~2 s), as all native code is (`seq2seq.native_build`), its name
depending also on JAX's and jaxlib's versions and the CPU's flags. Without a compiler, with a
build that fails, or with SEQ2SEQ_NATIVE=off, `available()` is False and the kernel tables
keep XLA's own code: the same function, slower (`unavailable_reason()` says why).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from seq2seq import native_build

SOURCES = tuple(Path(__file__).with_name(n) for n in ("decode_attention.cc", "top_k.cc"))
HEADERS = (Path(__file__).with_name("fast_exp.h"),)
TARGET = "seq2seq_decode_attention"
TARGET_ROWS = "seq2seq_decode_attention_rows"   # the same, each key read from its own row
TARGET_TOP_K = "seq2seq_top_k_logsumexp"
# symbol -> the name it is registered under: the symbol and the build's hash, so that two
# versions of the package in one process (bench/ab.py) each call their own kernel
_registered: dict[str, str] = {}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC",
         # vectorised float sums (a different order of the same additions) and no errno
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno")
_why_not = ""


def _compiler() -> str | None:
  return native_build.compiler("C++")


def _cpu_flags() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((l for l in f if l.startswith(("flags", "Features"))), "")
  except OSError:
    return ""


def build(where: Path | None = None) -> Path:
  """The compiled library, built now if this source, compiler, JAX and CPU have none yet.
  Raises native_build.Unavailable (a RuntimeError, with the compiler's first error) when it
  cannot be built."""
  flags = (*FLAGS, f"-march={os.environ.get('SEQ2SEQ_NATIVE_MARCH') or 'native'}",
           "-I", jax.ffi.include_dir())
  return native_build.build("kernels", "C++", SOURCES, flags, headers=HEADERS, where=where,
                            depends_on=(jax.__version__, jaxlib.__version__, _cpu_flags()))


@functools.cache
def available() -> bool:
  """Whether the kernels are built, loaded and registered with XLA:CPU in this process."""
  global _why_not
  try:
    path = build()
    lib = ctypes.cdll.LoadLibrary(str(path))
    for symbol in (TARGET, TARGET_ROWS, TARGET_TOP_K):
      name = f"{symbol}_{path.stem.rsplit('-', 1)[-1]}"
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
      _registered[symbol] = name
  except (OSError, RuntimeError, AttributeError) as e:
    _why_not = str(e)
    return False
  return True


def unavailable_reason() -> str:
  return "" if available() else _why_not


def _target(symbol: str) -> str:
  if not available():
    raise RuntimeError(f"the C++ kernels are not available: {_why_not}")
  return _registered[symbol]


def decode_attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask_BxQxK, rows_BxK=None) -> jax.Array:
  """softmax(q·kᵀ)·v -> [B, H, Q, D] float32, for q already scaled; keys and values read
  in their dtype (bfloat16, its bits as uint16, or float32); mask [1|B, 1|Q, K], True =
  may attend; a query with no allowed key gets zeros. With `rows_BxK` (int32), key j of
  row b is read from row rows[b, j] of k and v (`reference.key_rows`). Needs
  `available()`."""
  args = [q_BxHxQxD.astype(jnp.float32), k_BxHxKxD, v_BxHxKxD, mask_BxQxK.astype(jnp.bool_)]
  if rows_BxK is not None:
    args.append(rows_BxK.astype(jnp.int32))
  return jax.ffi.ffi_call(_target(TARGET if rows_BxK is None else TARGET_ROWS),
                          jax.ShapeDtypeStruct(q_BxHxQxD.shape, jnp.float32),
                          vmap_method="sequential")(*args)


def top_k_logsumexp(x_NxV, k: int):
  """(values [N, k], indices [N, k] int32, logsumexp [N]) of float32 x: `lax.top_k(x, k)`
  (best first, ties to the lower index) and `logsumexp(x, axis=-1)`, read once. Needs
  `available()`."""
  n = x_NxV.shape[0]
  return jax.ffi.ffi_call(_target(TARGET_TOP_K),
                          (jax.ShapeDtypeStruct((n, k), jnp.float32),
                           jax.ShapeDtypeStruct((n, k), jnp.int32),
                           jax.ShapeDtypeStruct((n,), jnp.float32)),
                          vmap_method="sequential")(x_NxV.astype(jnp.float32))
