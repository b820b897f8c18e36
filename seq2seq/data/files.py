"""Files and processes the data path shares: atomic writes, a write that failed said in one
line, waiting for another host's file, child processes that end with their parent."""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from seq2seq.errors import UserError

_ADVICE = {
    errno.ENOSPC: "free space there, or give a --workdir on a disk with room",
    errno.EDQUOT: "free space there, or give a --workdir on a disk with room",
    errno.EFBIG: "raise the file size limit, ulimit -f",
    errno.EROFS: "make it writable, or give another --workdir",
    errno.EACCES: "make it writable, or give another --workdir",
    errno.EPERM: "make it writable, or give another --workdir",
}


def cannot_write(path, e: OSError, advice: str = "") -> UserError:
  """The one line for a file that could not be written: the file, the system's reason and
  what to do."""
  advice = advice or _ADVICE.get(e.errno, "")
  return UserError(f"cannot write {path}: {e.strerror or e}" + (f" ({advice})" if advice else ""))


def atomic_write(path, data: bytes) -> None:
  """Writes `path` via a unique temporary file and a rename, so readers never see half;
  a write that fails leaves no temporary file and is one line (UserError)."""
  p = Path(path)
  tmp = p.parent / f".{p.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    tmp.replace(p)  # replace, not rename: another host may have written the same file
  except OSError as e:
    tmp.unlink(missing_ok=True)
    raise cannot_write(p, e) from None


def wait_for(predicate, what: str, timeout: float, poll: float = 1.0) -> None:
  """Polls `predicate()` until true; UserError after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not predicate():
    left = deadline - time.monotonic()
    if left <= 0:
      raise UserError(f"timed out after {timeout:.0f}s waiting for {what} (written by "
                      f"process 0; is the directory shared between hosts?)")
    time.sleep(min(poll, left))


_PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int) -> None:
  """Makes this (child) process end when process `parent` does, even killed: on Linux the
  kernel's parent-death signal, elsewhere a thread that watches the parent."""
  if sys.platform.startswith("linux"):
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
        if os.getppid() != parent:   # it ended before the signal was asked for
          os._exit(1)
        return
    except (OSError, AttributeError):
      pass

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)
  threading.Thread(target=watch, daemon=True).start()
