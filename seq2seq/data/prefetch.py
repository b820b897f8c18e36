"""The next batches, prepared on a background thread while the device computes."""
from __future__ import annotations

import queue
import threading
import time


class Prefetch:
  """Prepares the next batches on a background thread while the device computes."""

  def __init__(self, it, size: int = 4):
    self._q: queue.Queue = queue.Queue(size)
    self._it = it
    self._stop = threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()

  def _run(self):
    try:
      for x in self._it:
        if self._stop.is_set():
          return
        self._q.put(x)
    except BaseException as e:  # surfaced on the main thread
      self._q.put(e)

  def close(self, timeout: float = 60.0) -> None:
    """Stops the thread and closes the batches' iterator (its own threads end with it): no
    thread of the input pipeline runs on into the interpreter's exit, where one inside
    NumPy's C++ sort aborts the process."""
    self._stop.set()
    end = time.monotonic() + timeout
    while self._t.is_alive() and time.monotonic() < end:
      try:
        self._q.get_nowait()   # a put waiting for room returns
      except queue.Empty:
        self._t.join(0.05)
    if not self._t.is_alive() and hasattr(self._it, "close"):
      self._it.close()

  def __next__(self):
    x = self._q.get()
    if isinstance(x, BaseException):
      raise x
    return x
