"""A workdir's Orbax checkpoints: save, restore, list, verify checksums, average.

    <workdir>/checkpoints/<step>/state   TrainState (params, optimizer state, step)
    <workdir>/checkpoints/<step>/meta    JSON: step, data position, the checksum of each array

A checkpoint that reads back wrong (checksums.py) is skipped for the one before it and,
by a run that writes, moved to <workdir>/checkpoints_unreadable/. `load_workdir` (load.py)
restores a trained model from a workdir.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from seq2seq import checksums as checksum_lib
from seq2seq import state as state_lib
from seq2seq.config import Config
from seq2seq.errors import UserError
from seq2seq.workdir import Workdir, refuse_url

# Importable from here as before they moved.
from seq2seq.checksums import checksums  # noqa: E402,F401
from seq2seq.workdir import UNREADABLE_DIR, read_config, write_config  # noqa: E402,F401

log = logging.getLogger("seq2seq")


def _first_line(e: Exception) -> str:
  msg = str(e).splitlines()[0] if str(e) else type(e).__name__
  return msg.split(". See full TensorStore details")[0][:200]


def _is_read_debris(e: BaseException | str | None) -> bool:
  """What Orbax's other reads or writes raise in background threads after one failed:
  Orbax's wrapped error, TensorStore's own (`OUT_OF_RANGE: Error reading "..." in OCDBT
  database`, also as the repr in asyncio's "Future exception was never retrieved"), or a
  closed loop."""
  text = str(e)
  return ((isinstance(e, RuntimeError) and text == "Event loop is closed")
          or "Encountered error while reading array index" in text
          or re.search(r"\b[A-Z_]{4,}: Error (reading|writing|opening) ", text) is not None)


# Orbax's reports, from its background threads, of a failed save: the same error reaches
# the main thread (`Checkpoints.save`/`wait`), which says it in one line.
_SAVE_FAILURE_LOG = re.compile(r"_SignalingThread\.run\(\) raised an exception|in background "
                               r"save thread|Save Finalize thread .* failed|Failed to "
                               r"(write|update) metadata=")

_QUIETED = False


def _quiet_background_failures() -> None:
  """When one read of a restore (or write of a save) fails, Orbax's others go on failing in
  background threads and each prints a traceback (thousands of lines for one corrupt file),
  some while the first error is still on its way up. Silence exactly those, from the first
  restore or save on."""
  global _QUIETED
  if _QUIETED:
    return
  _QUIETED = True
  import sys
  import threading
  excepthook, thread_hook, unraisable = sys.excepthook, threading.excepthook, sys.unraisablehook
  sys.excepthook = lambda t, e, tb: None if _is_read_debris(e) else excepthook(t, e, tb)
  threading.excepthook = lambda a: None if _is_read_debris(a.exc_value) else thread_hook(a)
  sys.unraisablehook = lambda u: None if _is_read_debris(u.exc_value) else unraisable(u)

  class _Filter(logging.Filter):
    def filter(self, record):
      exc = record.exc_info[1] if record.exc_info else None
      msg = record.getMessage()
      return not (_is_read_debris(exc) or _is_read_debris(msg)
                  or _SAVE_FAILURE_LOG.search(msg))
  logging.getLogger("asyncio").addFilter(_Filter())
  logging.getLogger("absl").addFilter(_Filter())


class _Corrupt(ValueError):
  """A checkpoint that reads back but not as it was written."""


class CheckpointWriteError(UserError):
  """A checkpoint could not be written (the disk is full, the directory not writable).
  The checkpoints saved before it are intact."""


def _is_structure_mismatch(e: BaseException) -> bool:
  """Orbax's error for a checkpoint whose tree differs from the one asked for: raised from
  its metadata, before any array is read, so the checkpoint itself is sound."""
  return isinstance(e, ValueError) and ("tree structures do not match" in str(e)
                                        or str(e).startswith("Structure mismatch: "))


class Checkpoints:
  """Orbax `CheckpointManager` over `<workdir>/checkpoints`: async saves, keep the last K,
  restore the newest checkpoint that reads back and matches its checksums, skipping broken
  ones with a warning."""

  def __init__(self, workdir: Workdir | str | os.PathLike, keep: int = 3,
               async_save: bool = True, read_only: bool = False):
    wd = Workdir.of(workdir)
    self.directory = wd.checkpoints.absolute()
    self.unreadable_directory = wd.unreadable_checkpoints.absolute()
    self.read_only = read_only
    self._saving: int | None = None   # the step of the last save started
    self._failed = False              # a save failed: its threads are not waited for
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only,
        enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))
    if not read_only:
      self._move_aside_unfinished()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> None:
    """Starts writing `step` (async); a failure of it, or of the save before it, raises
    CheckpointWriteError here or in `wait`."""
    _quiet_background_failures()
    meta = dict(meta, checksums=checksum_lib.record(state))
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:   # e.g. the previous async save failed: the disk is full
      self._failed = True
      raise self._write_error(e) from None
    self._saving = step

  def _write_error(self, e: Exception) -> "CheckpointWriteError":
    # The failed save's other writes are dropped unfinished: Python would warn of each.
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    code = re.search(r"os_error_code='(\d+)'", str(e))
    missing = re.match(r"NOT_FOUND: |Checkpoint directory does not exist: ", str(e))
    why = (os.strerror(int(code.group(1))) if code else
           e.strerror if isinstance(e, OSError) and e.strerror else
           os.strerror(errno.ENOENT) if missing else _first_line(e))
    where = self.directory if self._saving is None else self.directory / str(self._saving)
    return CheckpointWriteError(f"cannot write checkpoint {where}: {why} (the checkpoints "
                                f"saved before it are intact)")

  def restore(self, abstract_state, step: int | None = None, params_only: bool = False):
    """(state, meta) of `step`, or of the newest readable checkpoint; None if there is none.

    With `params_only`, `abstract_state` is the parameters' tree and only they are read (as
    decoding needs: whatever optimizer state the checkpoint holds). A checkpoint that cannot
    be read is skipped, with a warning, for the one before it; one that reads but holds a
    tree of another structure than asked for (another optimizer) is an error instead."""
    candidates = [step] if step is not None else self.steps()[::-1]
    if step is not None and step not in self.steps():
      raise UserError(f"{self.directory}: no checkpoint at step {step} "
                      f"(have: {', '.join(map(str, self.steps())) or 'none'})")
    if params_only:
      to_read = ocp.args.PyTreeRestore(
          item={"params": abstract_state}, partial_restore=True,
          restore_args=jax.tree_util.tree_map(
              lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
              {"params": abstract_state}))
    else:
      to_read = ocp.args.StandardRestore(abstract_state)
    _quiet_background_failures()
    for s in candidates:
      try:
        restored = self.manager.restore(s, args=ocp.args.Composite(
            state=to_read, meta=ocp.args.JsonRestore()))
        state, meta = restored["state"], restored["meta"]
        bad = checksum_lib.mismatch(state, meta.get("checksums"))
        if bad:
          raise _Corrupt(f"the checksum of {bad} does not match (the file changed after it "
                         f"was written)")
        return (state["params"] if params_only else state), meta
      except Exception as e:  # a partial or corrupt checkpoint: fall back to the previous one
        msg = _first_line(e)
        if _is_structure_mismatch(e):
          raise UserError(f"checkpoint {self.directory / str(s)} holds a training state of "
                          f"another structure than this run's (is the optimizer configured "
                          f"as when it was saved, e.g. train.clip_grad_norm and "
                          f"train.weight_decay on or off?)") from None
        if step is not None:
          raise UserError(f"checkpoint {self.directory / str(s)} is unreadable: {msg}") from None
        where = self._move_aside(self.directory / str(s))
        warnings.warn(f"skipping unreadable checkpoint {self.directory / str(s)}"
                      + (f" (moved to {where})" if where else "") + f": {msg}")
    return None

  def _move_aside(self, path: Path) -> Path | None:
    """A writable run moves an unreadable step out of the manager's sight, so that the run
    can save that step again; nothing is deleted. Read-only readers leave it in place."""
    if self.read_only or jax.process_index() != 0:
      return None
    dest = self.unreadable_directory / path.name
    n = 1
    while dest.exists():
      dest, n = self.unreadable_directory / f"{path.name}.{n}", n + 1
    dest.parent.mkdir(exist_ok=True)
    os.replace(path, dest)
    self.manager.reload()
    return dest

  def _move_aside_unfinished(self) -> None:
    """A save cut short (killed while Orbax wrote it, a full disk) leaves a temporary
    directory that no run reads: moved aside with a warning, like an unreadable step."""
    if jax.process_index() != 0 or not self.directory.is_dir():
      return
    for path in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
      where = self._move_aside(path)
      warnings.warn(f"moved the unfinished checkpoint {path} to {where}")

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      self._failed = True
      raise self._write_error(e) from None

  def close(self) -> None:
    """Waits for the last save and closes; after a failed save, returns at once: Orbax's
    threads of a failed save can wait minutes for writes that never come."""
    if self._failed:
      return
    try:
      self.wait()
    finally:
      if not self._failed:
        self.manager.close()


def local_abstract_state(cfg: Config):
  """The TrainState of `cfg` as restore targets on this host's first device."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      state_lib.abstract_state(cfg))


def average_checkpoints(workdir: Workdir | str | os.PathLike, last: int = 5):
  """Mean of the parameters of the last `last` checkpoints (the paper averaged 5)."""
  wd = Workdir.of(workdir)
  cfg = wd.read_config()
  if cfg is None:
    raise UserError(f"{workdir} holds no {wd.config.name}")
  ckpts = Checkpoints(wd, read_only=True)
  steps = ckpts.steps()[-last:]
  if not steps:
    raise UserError(f"{workdir} holds no checkpoint")
  target = local_abstract_state(cfg).params
  total = None
  for s in steps:
    params, _ = ckpts.restore(target, s, params_only=True)
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    total = p if total is None else jax.tree_util.tree_map(np.add, total, p)
  return steps, jax.tree_util.tree_map(lambda x: (x / len(steps)).astype(np.float32), total)


def write_averaged_workdir(workdir: Workdir | str | os.PathLike,
                           output: Workdir | str | os.PathLike, last: int = 5) -> list[int]:
  """A new workdir whose one checkpoint holds the mean parameters of the last `last`
  checkpoints of `workdir` (config and vocabulary copied), ready for decode.py.
  Refuses to write into an existing checkpoint directory; `workdir` is only read."""
  import shutil
  source, out = Workdir.of(workdir), Workdir.of(output)
  if out.checkpoints.exists():
    raise UserError(f"{out} already holds checkpoints; choose a new --output")
  steps, params = average_checkpoints(workdir, last)
  cfg = source.read_config()
  try:
    out.path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source.vocab, out.vocab)
    out.write_config(cfg)
  except OSError as e:
    raise UserError(f"cannot write {out}: {e.strerror or e}") from None
  full = state_lib.init_state(cfg, jax.random.key(0))  # optimizer state: fresh (unused by decoding)
  full = full.replace(step=np.asarray(steps[-1], np.int32), params=params)
  ckpts = Checkpoints(out, keep=1, async_save=False)
  ckpts.save(steps[-1], full, {"step": steps[-1], "averaged_steps": steps,
                               "source_workdir": str(source.path.absolute())})
  ckpts.close()
  return steps


def main(argv=None) -> int:
  """python -m seq2seq.checkpoint average --workdir W --output W_avg [--last 5]"""
  import sys
  from seq2seq.errors import ArgumentParser
  p = ArgumentParser(prog="python -m seq2seq.checkpoint",
                     description="Average the last checkpoints of a workdir.")
  p.add_argument("command", choices=["average"])
  p.add_argument("--workdir", required=True)
  p.add_argument("--output", required=True, help="new workdir for the averaged model")
  p.add_argument("--last", type=int, default=5, help="how many checkpoints (default 5)")
  args = p.parse_args(argv)
  import absl.logging  # Orbax logs through absl: keep its chatter out of the way
  absl.logging.set_verbosity(absl.logging.ERROR)
  from seq2seq.errors import one_line_warnings
  one_line_warnings()
  try:
    if args.last < 1:
      raise UserError(f"--last must be >= 1, got {args.last}")
    Workdir.checked(args.workdir)
    refuse_url(args.output)
    steps = write_averaged_workdir(args.workdir, args.output, args.last)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"averaged steps {', '.join(map(str, steps))} into {args.output}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
