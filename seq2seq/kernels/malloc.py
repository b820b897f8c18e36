"""glibc malloc settings for training: XLA:CPU reuses its per-step memory instead of having
the kernel fault it in afresh at every step.

XLA:CPU allocates a program's temporary buffer (hundreds of MB for a `small` train step)
with malloc on a worker thread at every run, and frees it after. glibc serves a request that
large with a fresh mmap and unmaps it on free, so at every step the kernel faults in and
zeroes every page again. With one arena, no mmap and no trimming, the buffer comes from the
main heap and the next step reuses it: train steps 1.1-1.2x faster (docs/performance.md).
The price: freed memory stays with the process, and threads share one arena's lock, which
makes decoding, with its many small allocations per step, a little slower. So train.py (and
the training benches) call `keep_freed_memory()`; decode.py and `import seq2seq` do not.
One-off work (compiling, an evaluation's decoding) would leave its memory in the heap for
the rest of the run, so the training loop calls `release_freed_memory()` after its first
step and around each evaluation. On GPU/TPU hosts XLA's buffers live on the device and only
the lock is left: set SEQ2SEQ_MALLOC=default there if host threads slow down.

Call it before JAX starts its threads: a thread keeps the arena it first used. It does
nothing off glibc, if the environment already tunes malloc (`GLIBC_TUNABLES`, any
`MALLOC_*`), or with SEQ2SEQ_MALLOC=default.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # glibc's malloc.h
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1))
_tuned = False   # set by keep_freed_memory


def keep_freed_memory(environ=os.environ) -> bool:
  """Applies SETTINGS with mallopt; True if glibc took them all."""
  if (environ.get("SEQ2SEQ_MALLOC", "").lower() == "default" or "GLIBC_TUNABLES" in environ
      or any(k.startswith("MALLOC_") for k in environ)):
    return False
  try:
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
      return False
    global _tuned
    _tuned = all([libc.mallopt(param, value) == 1 for param, value in SETTINGS])
    return _tuned
  except (OSError, AttributeError):
    return False


def release_freed_memory() -> bool:
  """Gives the heap's free pages back to the kernel (glibc's `malloc_trim`), if
  `keep_freed_memory` tuned malloc in this process; True if it did. Call it after one-off
  work (compiling, an evaluation) whose memory the tuned heap would otherwise keep for the
  rest of the run; the next train step then faults its temporary buffer in once."""
  if not _tuned:
    return False
  ctypes.CDLL(None).malloc_trim(0)
  return True
