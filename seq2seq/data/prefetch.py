"""The next batches, prepared on a background thread while the device computes."""
from __future__ import annotations

import queue
import threading


class Prefetch:
  """Prepares the next batches on a background thread while the device computes."""

  def __init__(self, it, size: int = 4):
    self._q: queue.Queue = queue.Queue(size)
    self._it = it
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()

  def _run(self):
    try:
      for x in self._it:
        self._q.put(x)
    except BaseException as e:  # surfaced on the main thread
      self._q.put(e)

  def __next__(self):
    x = self._q.get()
    if isinstance(x, BaseException):
      raise x
    return x
