"""seq2seq/watchdog.py's phases (an evaluation inside a run), on its own: one whose batches
keep coming is left alone; one with no batch done past its bound is stopped, once, with a
line naming it; outside a watch, phases and progress do nothing."""
import re
import time

from seq2seq import watchdog


def test_a_phase_is_stopped_only_once_no_batch_is_done_past_its_bound(monkeypatch):
  monkeypatch.setattr(watchdog, "POLL_S", 0.02)
  monkeypatch.setattr(watchdog, "MIN_S", 0.0)
  monkeypatch.setattr(watchdog, "FACTOR", 10.0)
  said = []
  with watchdog.watching(lambda line, error: said.append((line, error))) as watch:
    watchdog.dispatched(None, 1)   # a step: the slowest so far is from the watch's start
    watchdog.dispatched(None, 2)
    watch.slowest = 0.1            # (as if the first step had taken 0.1 s)
    with watchdog.phase("the evaluation of validation at step 2"):
      for _ in range(10):          # batches 0.05 s apart: far within 10 x 0.1 s
        time.sleep(0.05)
        watchdog.progress()
      assert not said
      last = time.monotonic()      # then no batch done: stopped past 10 x the slowest
      while not said and time.monotonic() - last < 60:
        time.sleep(0.01)
      waited = time.monotonic() - last
    assert watch.phase is None
    assert waited >= 0.95 * watch.batch_bound() >= 0.95, (waited, watch.batch_bound())
  assert len(said) == 1, said
  line, error = said[0]
  assert error is None
  assert re.fullmatch(r"the evaluation of validation at step 2 hung: no batch done in \d+ s, "
                      r"the slowest step or batch so far [\d.]+ s \(compiles included\)", line)


def test_outside_a_watch_phases_and_progress_do_nothing():
  with watchdog.phase("the evaluation of test at step 0"):
    watchdog.progress()
    watchdog.progress(object())
  assert not watchdog._WATCHES
