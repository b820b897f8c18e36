"""The workdir lock (seq2seq.workdir): one run per workdir; a lock whose run is gone is taken
over, one a live run holds is refused naming it. Holders are real processes."""
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from seq2seq import lock as wl  # noqa: E402


def hold(workdir, then="time.sleep(600)") -> subprocess.Popen:
  """A process that takes the lock of `workdir`, says so, then runs `then`."""
  code = ("import time; from seq2seq.lock import WorkdirLock; "
          f"lock = WorkdirLock({str(workdir)!r}); lock.acquire(); print('held', flush=True); "
          f"{then}")
  p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                       cwd=str(ROOT))
  assert p.stdout.readline() == "held\n"
  return p


def lock_of(workdir) -> dict:
  return json.loads((Path(workdir) / wl.LOCK_FILE).read_text())


def test_a_live_holder_is_named_and_a_killed_one_taken_over(tmp_path):
  p = hold(tmp_path)
  try:
    before = (tmp_path / wl.LOCK_FILE).read_bytes()
    with pytest.raises(wl.WorkdirLocked) as e:
      wl.WorkdirLock(tmp_path).acquire()
    msg = str(e.value)
    assert f"in use by another run (host {socket.gethostname()}, pid {p.pid}, since " in msg
    assert "\n" not in msg
    assert (tmp_path / wl.LOCK_FILE).read_bytes() == before      # untouched
    assert os.listdir(tmp_path) == [wl.LOCK_FILE]                # no temporary file left
  finally:
    p.kill()   # as kill -9: the lock file stays behind
    p.wait()
  assert lock_of(tmp_path)["pid"] == p.pid
  lock = wl.WorkdirLock(tmp_path)
  with pytest.warns(UserWarning, match=rf"took over the lock .* pid {p.pid}, .*its process "
                                       r"is not running"):
    lock.acquire()
  assert lock_of(tmp_path)["pid"] == os.getpid()
  lock.release()
  assert os.listdir(tmp_path) == []


def test_a_lock_ended_normally_is_removed(tmp_path):
  p = hold(tmp_path, then="lock.release()")
  assert p.wait(30) == 0
  assert os.listdir(tmp_path) == []


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
  """The pid is alive but is another process than the one that took the lock (its start
  time differs), e.g. after a restart of the container."""
  other = dataclasses.replace(wl.Holder.me(), pid=os.getppid(), start_time="1", token="t")
  (tmp_path / wl.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(other)))
  lock = wl.WorkdirLock(tmp_path)
  with pytest.warns(UserWarning, match=f"pid {os.getppid()} is now another process"):
    lock.acquire()
  lock.release()


def test_another_hosts_lock_is_stale_once_its_heartbeat_stops(tmp_path, monkeypatch):
  monkeypatch.setenv("SEQ2SEQ_LOCK_STALE_SECONDS", "60")
  path = tmp_path / wl.LOCK_FILE
  # pid 1 is alive here, but it is another host's: only the heartbeat tells
  path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "then", "token": "t"}))
  with pytest.raises(wl.WorkdirLocked, match="host elsewhere, pid 1, since then"):
    wl.WorkdirLock(tmp_path).acquire()
  old = time.time() - 75
  os.utime(path, (old, old))
  lock = wl.WorkdirLock(tmp_path)
  with pytest.warns(UserWarning, match=r"no heartbeat for 7\d s \(more than 60 s\)"):
    lock.acquire()
  lock.release()


def test_the_heartbeat_refreshes_the_lock_and_notices_losing_it(tmp_path):
  lock = wl.WorkdirLock(tmp_path, heartbeat=0.05)
  lock.acquire()
  path = tmp_path / wl.LOCK_FILE
  old = time.time() - 1000
  os.utime(path, (old, old))
  time.sleep(0.5)
  assert path.stat().st_mtime > time.time() - 60
  lock.check()                                        # still ours
  path.write_text(json.dumps({"host": "elsewhere", "pid": 7, "since": "now", "token": "u"}))
  with pytest.raises(wl.LockLost, match="now names another run: host elsewhere, pid 7"):
    lock.check()
  lock.release()
  assert path.exists()                                # another run's: not removed
  (tmp_path / "w").mkdir()
  lock = wl.WorkdirLock(tmp_path / "w", heartbeat=0.05)
  lock.acquire()
  lock.path.unlink()
  time.sleep(0.3)
  with pytest.raises(wl.LockLost, match="it was deleted"):
    lock.check()
  lock.release()


@pytest.mark.slow   # starts a process per contender
def test_only_one_of_many_takes_over_a_stale_lock(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  stale = dataclasses.replace(wl.Holder.me(), pid=int(dead), token="dead")
  (tmp_path / wl.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(stale)))
  code = ("import sys, time, warnings; warnings.simplefilter('ignore'); "
          "from seq2seq.lock import WorkdirLock, WorkdirLocked\n"
          "time.sleep(float(sys.argv[1]) - time.time())\n"
          f"try:\n  WorkdirLock({str(tmp_path)!r}).acquire(); print('took', flush=True)\n"
          "  time.sleep(3)\n"
          "except WorkdirLocked:\n  print('refused')\n")
  start = str(time.time() + 2)
  procs = [subprocess.Popen([sys.executable, "-c", code, start], stdout=subprocess.PIPE,
                            text=True, cwd=str(ROOT)) for _ in range(4)]
  outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
  assert outs == ["refused"] * 3 + ["took"], outs


def test_bad_stale_seconds_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setenv("SEQ2SEQ_LOCK_STALE_SECONDS", "2m")
  (tmp_path / wl.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1,
                                                   "since": "then"}))
  with pytest.raises(wl.UserError, match="SEQ2SEQ_LOCK_STALE_SECONDS must be a whole number"):
    wl.WorkdirLock(tmp_path).acquire()
