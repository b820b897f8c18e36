"""Translation metrics and the run's logs (JSON lines + TensorBoard, no TensorFlow)."""
from __future__ import annotations

import json
import os
import sys
import time

import sacrebleu

from seq2seq.errors import UserError
from seq2seq.workdir import Workdir


def bleu(hypotheses: list[str], references: list[str]) -> float:
  """Corpus BLEU (sacreBLEU, 13a tokenisation), 0-100."""
  if not hypotheses:
    return 0.0
  return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def chrf(hypotheses: list[str], references: list[str]) -> float:
  if not hypotheses:
    return 0.0
  return float(sacrebleu.corpus_chrf(hypotheses, [references]).score)


def exact_match(hypotheses: list[str], references: list[str]) -> float:
  """Fraction of hypotheses equal to their reference after stripping outer white space."""
  if not hypotheses:
    return 0.0
  return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / len(hypotheses)


class LogWriteError(UserError):
  """The run's log could not be written (a full disk): the run stops as when a checkpoint
  cannot be written, and nothing more is logged."""


class MetricsWriter:
  """Appends `{"step", "time", "split", ...}` lines to metrics.jsonl and scalars to a
  TensorBoard event file. Only process 0 writes (others get a writer that does nothing).

  Both files are appended to on the caller's thread, each write opened and closed: a full
  disk is one LogWriteError there, after which nothing more is written (tensorboardX's
  SummaryWriter writes from a thread of its own, which a full disk ends with a traceback,
  and its queue, no longer read, then blocks the run)."""

  def __init__(self, workdir: Workdir | str | os.PathLike, enabled: bool = True):
    self.enabled = enabled
    self._tb = None
    if not enabled:
      return
    wd = Workdir.of(workdir)
    self.path = wd.metrics
    try:
      if self.path.exists() and self.path.stat().st_size:
        with open(self.path, "rb+") as f:  # a run killed mid-line: end that line, keep the rest
          f.seek(-1, 2)
          if f.read(1) != b"\n":
            f.write(b"\n")
    except OSError as e:
      raise _write_error(self.path, e) from None
    try:
      import socket
      from tensorboardX.proto.event_pb2 import Event
      wd.tensorboard.mkdir(exist_ok=True)
      tb = wd.tensorboard / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
      with open(tb, "ab") as f:
        f.write(_record(Event(wall_time=time.time(), file_version="brain.Event:2")))
      self._tb = tb
    except Exception:  # TensorBoard is a nicety; the JSON log is the record.
      self._tb = None

  def write(self, step: int, split: str, scalars: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), "time": round(time.time(), 3), "split": split}
    row.update({k: float(v) for k, v in scalars.items()})
    self._append(self.path, (json.dumps(row) + "\n").encode())
    if self._tb is not None:
      from tensorboardX.proto.event_pb2 import Event
      from tensorboardX.summary import scalar
      self._append(self._tb, b"".join(
          _record(Event(wall_time=row["time"], step=int(step),
                        summary=scalar(f"{split}/{k}", float(v)))) for k, v in scalars.items()))

  def _append(self, path, data: bytes) -> None:
    try:
      with open(path, "ab") as f:
        f.write(data)
    except OSError as e:
      self.enabled = False
      raise _write_error(path, e) from None

  def close(self) -> None:
    """Nothing is left to write: each write closed its files."""
    self.enabled = False


def _write_error(path, e: OSError) -> LogWriteError:
  return LogWriteError(f"cannot write {path}: {e.strerror or e} (the checkpoints saved before "
                       f"it are intact)")


def _record(event) -> bytes:
  """`event` as a TFRecord: its length, the length's masked CRC-32C, the data, its CRC."""
  import struct
  from tensorboardX.record_writer import masked_crc32c
  data = event.SerializeToString()
  header = struct.pack("Q", len(data))
  return (header + struct.pack("I", masked_crc32c(header)) + data
          + struct.pack("I", masked_crc32c(data)))


def read_metrics(workdir: Workdir | str | os.PathLike) -> list[dict]:
  """The rows of <workdir>/metrics.jsonl in step order. A resumed run logs again the steps
  after its checkpoint: the last row written for a (split, step) wins. Lines that are not
  JSON (a run killed mid-line) are skipped with a warning."""
  path = Workdir.of(workdir).metrics
  if not path.exists():
    return []
  latest, bad = {}, 0
  for i, line in enumerate(path.read_text(errors="replace").splitlines()):
    try:
      row = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
      row = None
      bad += 1
    if isinstance(row, dict) and "step" in row:
      latest[(row.get("split"), row["step"])] = (i, row)
  if bad:
    print(f"warning: skipped {bad} unreadable line(s) of {path}", file=sys.stderr)
  return [row for _, row in sorted(latest.values(), key=lambda v: (v[1]["step"], v[0]))]
