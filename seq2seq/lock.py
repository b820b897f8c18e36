"""One training run per workdir: the lock `<workdir>/train.lock`.

The lock is a small JSON file (host, pid, since, the host's boot id, the process's start
time, a random token), created atomically before a run writes anything and removed when it
ends. Its holder refreshes the file's modification time every `HEARTBEAT_SECONDS` (the
heartbeat) and checks that the file still holds its token. In a multi-host run process 0
holds it for all hosts.

A lock whose holder is gone is taken over with a warning:
  * same host (same hostname, boot id and pid namespace): its pid is not alive, or is alive
    but started at another time (the pid was reused);
  * otherwise (another host, container or boot): its heartbeat is older than
    `SEQ2SEQ_LOCK_STALE_SECONDS` (default 120), measured with the file system's clock (the
    mtime of a file written just now beside it), so that the hosts' clocks need not agree.
A run that finds the lock gone or naming another run stops before its next save.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path

from seq2seq.errors import UserError

LOCK_FILE = "train.lock"
HEARTBEAT_SECONDS = 10.0
DEFAULT_STALE_SECONDS = 120


class WorkdirLocked(UserError):
  """Another run holds the workdir."""


class LockLost(UserError):
  """The lock file no longer names this run (deleted, or taken over by another run)."""


def stale_seconds() -> float:
  value = os.environ.get("SEQ2SEQ_LOCK_STALE_SECONDS", "") or str(DEFAULT_STALE_SECONDS)
  if not value.isdigit() or int(value) < 1:
    raise UserError(f"SEQ2SEQ_LOCK_STALE_SECONDS must be a whole number of seconds >= 1, "
                    f"got {value!r}")
  return float(value)


def _boot_id() -> str:
  try:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    return ""


def _pid_namespace() -> str:
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return ""


def _stat(pid: int) -> list[str]:
  """The fields of /proc/<pid>/stat after the name (Linux), [] if unknown."""
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return []


def _start_time(pid: int) -> str:
  """The process's start time in clock ticks since boot (Linux), "" if unknown."""
  stat = _stat(pid)
  return stat[19] if len(stat) > 19 else ""   # field 22


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # alive, another user's
    return True
  return _stat(pid)[:1] != ["Z"]   # a killed process not yet reaped by its parent


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  since: str              # local time, ISO 8601, of the holder's host
  boot_id: str = ""
  pid_namespace: str = ""
  start_time: str = ""
  token: str = ""

  @classmethod
  def me(cls) -> "Holder":
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return cls(host=socket.gethostname(), pid=os.getpid(), since=now, boot_id=_boot_id(),
               pid_namespace=_pid_namespace(), start_time=_start_time(os.getpid()),
               token=uuid.uuid4().hex)

  def describe(self) -> str:
    return f"host {self.host}, pid {self.pid}, since {self.since}"


def _read(path: Path) -> Holder | None:
  """The holder named by the lock file; None if there is no file; raises ValueError if it
  is not a lock file (empty or half-written by a process killed as it wrote it)."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    return None
  d = json.loads(text)   # ValueError (JSONDecodeError) for a torn file
  fields = {f.name for f in dataclasses.fields(Holder)}
  try:
    return Holder(**{k: v for k, v in d.items() if k in fields})
  except TypeError as e:
    raise ValueError(str(e)) from None


def _fs_now(directory: Path) -> float:
  """The file system's current time: the mtime of a file created just now in `directory`
  (on a shared file system that is the server's clock, which the heartbeat also uses)."""
  probe = directory / f".{LOCK_FILE}.clock-{uuid.uuid4().hex[:8]}"
  try:
    probe.write_bytes(b"")
    return probe.stat().st_mtime
  except OSError:
    return time.time()
  finally:
    probe.unlink(missing_ok=True)


def _create(path: Path, text: str) -> bool:
  """Creates `path` holding `text` if it does not exist (atomically: no reader sees it
  half-written); False if it exists."""
  tmp = path.with_name(f".{path.name}.new-{uuid.uuid4().hex[:8]}")
  tmp.write_text(text)
  try:
    os.link(tmp, path)
    return True
  except FileExistsError:
    return False
  except OSError:   # no hard links (some FUSE file systems): an exclusive create instead
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      f.write(text)
    return True
  finally:
    tmp.unlink(missing_ok=True)


class WorkdirLock:
  """`with WorkdirLock(workdir): ...` or acquire()/release(). `check()` raises LockLost
  once the heartbeat has found the file gone or naming another run."""

  def __init__(self, workdir, heartbeat: float = HEARTBEAT_SECONDS):
    self.workdir = Path(workdir)
    self.path = self.workdir / LOCK_FILE
    self.heartbeat = heartbeat
    self.me = Holder.me()
    self._held = False
    self._lost: str | None = None
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # --- taking it ------------------------------------------------------------------------

  def acquire(self) -> None:
    text = json.dumps(dataclasses.asdict(self.me), indent=1) + "\n"
    torn_since = None
    for _ in range(50):
      try:
        if _create(self.path, text):
          return self._took()
      except OSError as e:
        raise UserError(f"workdir {self.workdir} is not writable: {e.strerror or e}") from None
      try:
        holder = _read(self.path)
      except ValueError:   # being written (link makes that rare) or torn by a crash
        torn_since = torn_since or time.monotonic()
        if time.monotonic() - torn_since < 5 or self._age() < 10:
          time.sleep(0.2)
          continue
        holder = Holder(host="?", pid=0, since="?")
      if holder is None:   # released just now
        continue
      why = self._stale(holder)
      if why is None:
        raise WorkdirLocked(
            f"workdir {self.workdir} is in use by another run ({holder.describe()}); wait "
            f"for it to end or use another --workdir (if that run is gone, delete "
            f"{self.path})")
      if self._take_over(holder):
        warnings.warn(f"took over the lock of workdir {self.workdir} from a run that is "
                      f"gone ({holder.describe()}: {why})")
        return self._took()
    raise WorkdirLocked(f"workdir {self.workdir}: could not take {self.path} (other runs "
                        f"keep taking it)")

  def _age(self) -> float:
    try:
      return _fs_now(self.workdir) - self.path.stat().st_mtime
    except FileNotFoundError:
      return 0.0

  def _stale(self, h: Holder) -> str | None:
    """Why the holder `h` is gone, or None if it may be running."""
    if (h.host, h.boot_id, h.pid_namespace) == (self.me.host, self.me.boot_id,
                                                self.me.pid_namespace):
      if h.pid == self.me.pid and h.start_time == self.me.start_time:
        return None                       # this very process (another thread's run)
      if not _pid_alive(h.pid):
        return "its process is not running"
      if h.start_time and self.me.start_time and _start_time(h.pid) != h.start_time:
        return f"pid {h.pid} is now another process"
      return None
    limit = stale_seconds()
    age = self._age()
    if age > limit:
      return f"no heartbeat for {age:.0f} s (more than {limit:.0f} s)"
    return None

  def _take_over(self, old: Holder) -> bool:
    """Replaces the lock of `old` by ours, unless another run changed it meanwhile. A short
    second lock (`train.lock.takeover`) keeps two runs from taking over at once."""
    guard = self.path.with_name(self.path.name + ".takeover")
    if not _create(guard, self.me.token):
      try:
        if _fs_now(self.workdir) - guard.stat().st_mtime > 30:   # left by a crash
          guard.unlink(missing_ok=True)
      except FileNotFoundError:
        pass
      time.sleep(0.2)
      return False
    try:
      try:
        current = _read(self.path)
      except ValueError:
        current = Holder(host="?", pid=0, since="?")
      if current is not None and current.token != old.token:
        return False
      tmp = self.path.with_name(f".{self.path.name}.new-{uuid.uuid4().hex[:8]}")
      tmp.write_text(json.dumps(dataclasses.asdict(self.me), indent=1) + "\n")
      os.replace(tmp, self.path)
      return True
    finally:
      guard.unlink(missing_ok=True)

  def _took(self) -> None:
    if _read(self.path) != self.me:   # a file system that does not honour exclusive creates
      raise WorkdirLocked(f"workdir {self.workdir}: another run took {self.path} at the "
                          f"same time")
    self._held = True
    self._thread = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
    self._thread.start()

  # --- holding it -----------------------------------------------------------------------

  def _beat(self) -> None:
    while not self._stop.wait(self.heartbeat):
      try:
        holder = _read(self.path)
      except (OSError, ValueError):
        continue   # a passing file system error: try again at the next beat
      if holder != self.me:
        self._lost = ("it was deleted" if holder is None else
                      f"it now names another run: {holder.describe()}")
        return
      try:
        os.utime(self.path)
      except OSError:
        pass

  def check(self) -> None:
    """LockLost if this run no longer holds the lock (read now, and as the heartbeat found)."""
    if self._held and not self._lost:
      try:
        holder = _read(self.path)
        if holder != self.me:
          self._lost = ("it was deleted" if holder is None else
                        f"it now names another run: {holder.describe()}")
      except (OSError, ValueError):
        pass
    if self._lost:
      raise LockLost(f"this run no longer holds the lock of workdir {self.workdir} "
                     f"({self._lost}); stopped without saving, so that two runs never "
                     f"write one workdir (the checkpoints saved before are intact)")

  def release(self) -> None:
    if not self._held:
      return
    self._held = False
    self._stop.set()
    try:
      if _read(self.path) == self.me:
        self.path.unlink()
    except (OSError, ValueError):
      pass

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
