"""The train steps in flight, watched from a thread: a step that fails on one device while
the step's other devices wait for it, or that hangs, ends the run in one line, not never.

A device that fails inside a step leaves the step's other devices waiting for it in the
step's collectives. No error reaches the host, which waits on their results for good, and
so do the other hosts (XLA:CPU shows it with 2 devices a process; NCCL's collectives wait
alike). Nothing can be redone either: a device that waits in a collective runs nothing
after it. So while `watching`, a thread looks at the outputs of the steps in flight every
POLL_S (the loop hands it each step's outputs as it dispatches it: no host sync), and
finds a step

  failed  where a device's outputs hold an error while another device's are not ready,
          on two looks running: that device failed, the others wait for it;
  hung    whose outputs are not all ready BOUND seconds after it was dispatched: BOUND is
          FACTOR times the slowest step so far, timed from one dispatch to the next (the
          first from the watch's start: its compile), and at least MIN_S.

An evaluation or a decoding inside the run (`phase`) is watched the same way, its batches
for steps: the batch in flight (`progress(outputs)`) failed on one device while another
waits, or no batch done for BOUND seconds, with the slowest step or batch so far in FACTOR
times.

It calls `on_stop(line, error)` (net.run_failures: every host stops, exit 2) with a line
that names the step or the evaluation. The checkpoints written stay intact: one being
written is left unfinished, and the next run sets it aside (checkpoint.py).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable

import jax

from seq2seq.kernels.accelerator import first_line

POLL_S = 0.5
MIN_S = 300.0
FACTOR = 10.0
JOIN_S = 10.0   # the most a block's end waits for its watch's last look
_WATCHES: list = []   # the watch of the run in progress


class _Watch:

  def __init__(self, on_stop: Callable[[str, BaseException | None], None]):
    self.on_stop = on_stop
    self.last: int | None = None     # the number of the step dispatched last
    self.at = time.monotonic()       # when (before any: the watch's start)
    self.slowest = 0.0               # the longest time from one dispatch to the next
    self.flight = collections.deque()   # (number, outputs, when dispatched), oldest first
    self.phase: _Phase | None = None    # the evaluation or decoding in progress
    self.slowest_batch = 0.0         # the longest wait for one of their batches
    self.done = threading.Event()

  def dispatched(self, outputs, number: int | None) -> None:
    now = time.monotonic()
    self.slowest = max(self.slowest, now - self.at)
    self.at = now
    self.last = self.last + 1 if number is None else number
    self.flight.append((self.last, outputs, now))

  def bound(self) -> float:
    return max(MIN_S, FACTOR * self.slowest)

  def batch_bound(self) -> float:
    return max(MIN_S, FACTOR * max(self.slowest, self.slowest_batch))

  def run(self) -> None:
    seen = {}   # what the last look found failed on one device ("step": its number, "batch")
    while not self.done.wait(POLL_S):
      stop = self._phase_stopped(seen) or self._steps_stopped(seen)
      if stop is not None:
        return self.on_stop(*stop)

  def _steps_stopped(self, seen: dict) -> tuple | None:
    while self.flight:
      number, outputs, at = self.flight[0]
      ready, failed = _look(outputs)
      if ready:
        self.flight.popleft()
        continue
      waited = time.monotonic() - at
      if failed is not None and seen.get("step") == number:
        device, error = failed
        return (f"step {number}: device {device} failed while the step's other devices "
                f"waited for it in its collectives ({first_line(error)})", error)
      seen["step"] = number if failed is not None else None
      if waited > self.bound():
        return (f"step {number} hung: no result from its devices in {waited:.0f} s, the "
                f"slowest step so far {self.slowest:.1f} s (its compile included)", None)
      return None

  def _phase_stopped(self, seen: dict) -> tuple | None:
    phase = self.phase
    if phase is None:
      return None
    at, outputs = phase.at, phase.outputs
    ready, failed = (True, None) if outputs is None else _look(outputs)
    if not ready and failed is not None and seen.get("batch") is outputs:
      device, error = failed
      return (f"{phase.label}: device {device} failed while the other devices waited for it "
              f"in its collectives ({first_line(error)})", error)
    seen["batch"] = outputs if not ready and failed is not None else None
    waited = time.monotonic() - at
    if phase is self.phase and at == phase.at and waited > self.batch_bound():
      return (f"{phase.label} hung: no batch done in {waited:.0f} s, the slowest step or "
              f"batch so far {max(self.slowest, self.slowest_batch):.1f} s (compiles "
              f"included)", None)
    return None


class _Phase:

  def __init__(self, label: str):
    self.label = label
    self.at = time.monotonic()   # when it began, or its last batch was done or dispatched
    self.outputs = None          # the batch in flight's, where given


def _look(outputs) -> tuple[bool, tuple | None]:
  """(whether every shard of `outputs` is ready, (device, error) of one that failed)."""
  ready, failed = True, None
  for leaf in jax.tree_util.tree_leaves(outputs):
    if not isinstance(leaf, jax.Array) or leaf.is_deleted():
      continue
    for shard in leaf.addressable_shards:
      try:
        if not shard.data.is_ready():
          ready = False
        elif failed is None:
          shard.data.block_until_ready()   # (ready: raises its error, or returns at once)
      except Exception as e:   # noqa: BLE001 - the device's error
        failed = (shard.device, e)
  return ready, failed


@contextlib.contextmanager
def watching(on_stop: Callable[[str, BaseException | None], None]):
  """Watches the steps `dispatched` inside, until the block ends."""
  watch = _Watch(on_stop)
  _WATCHES.append(watch)
  thread = threading.Thread(target=watch.run, daemon=True, name="seq2seq-step-watch")
  thread.start()
  try:
    yield watch
  finally:
    watch.done.set()
    _WATCHES.remove(watch)
    # Ended before the block is left: a daemon thread still inside jaxlib's C++ when the
    # interpreter exits aborts the process ("FATAL: exception not rethrown").
    thread.join(timeout=JOIN_S)
    watch.flight.clear()   # the steps' outputs let go of here, not in the thread


def starting(state) -> None:
  """Before a step: the first one's number, read once a watch (one host sync a run)."""
  if _WATCHES and _WATCHES[-1].last is None:
    _WATCHES[-1].last = int(state.step)


def dispatched(outputs, number: int | None = None) -> None:
  """A step dispatched, with its outputs (not waited for): step `number`, or the one after
  the last."""
  if _WATCHES:
    _WATCHES[-1].dispatched(outputs, number)


def redoing(number: int) -> None:
  """Step `number` is done again: the next dispatched is `number` again."""
  if _WATCHES:
    _WATCHES[-1].last = number - 1


@contextlib.contextmanager
def phase(label: str):
  """An evaluation or decoding inside a watched run, named by `label` ("the evaluation of
  validation at step 1000"): its batches are watched as steps are (`progress`)."""
  if not _WATCHES:
    yield
    return
  watch = _WATCHES[-1]
  watch.phase = _Phase(label)
  try:
    yield
  finally:
    watch.phase = None
    watch.at = time.monotonic()   # (the next step's wait counts from here)


def progress(outputs=None) -> None:
  """A batch of the phase in progress done; with `outputs`, the next one dispatched, whose
  outputs a device's failure would hold."""
  if _WATCHES and _WATCHES[-1].phase is not None:
    watch, now = _WATCHES[-1], time.monotonic()
    watch.slowest_batch = max(watch.slowest_batch, now - watch.phase.at)
    watch.phase.outputs, watch.phase.at = outputs, now
