"""The workdir: what a run writes, and all that decoding and export read back.

    <workdir>/config.json               the whole Config of the run
    <workdir>/vocab.model               the SentencePiece vocabulary
    <workdir>/vocab.json                what it was built from (data/dataset.py)
    <workdir>/data_cache/               tokenized splits
    <workdir>/train_sources.json        what the training sources were (data/sources.py)
    <workdir>/checkpoints/<step>/       Orbax checkpoints (checkpoint.py)
    <workdir>/checkpoints_unreadable/   checkpoints that did not read back, moved aside
    <workdir>/metrics.jsonl, <workdir>/tensorboard/
    <workdir>/train.lock                held by the run training in it (lock.py)

`Workdir` knows this layout, and the other modules ask it for their paths. It also creates
and checks the directory, takes its lock, and removes what a refused run wrote.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from seq2seq.config import Config, ConfigError
from seq2seq.errors import UserError
from seq2seq.lock import LOCK_FILE, WorkdirLock

CONFIG_FILE = "config.json"
VOCAB_FILE = "vocab.model"
VOCAB_RECORD_FILE = "vocab.json"
DATA_CACHE_DIR = "data_cache"
TRAIN_SOURCES_FILE = "train_sources.json"
CKPT_DIR = "checkpoints"
UNREADABLE_DIR = "checkpoints_unreadable"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# What a run writes into its workdir before it trains: removed again if it is refused.
RUN_FILES = (CONFIG_FILE, VOCAB_FILE, VOCAB_RECORD_FILE, TRAIN_SOURCES_FILE, DATA_CACHE_DIR,
             CKPT_DIR, METRICS_FILE, TENSORBOARD_DIR)


def refuse_url(path) -> None:
  """Workdirs are written through the file system: a URL would become a local directory
  named like it (and leave a run's checkpoints on this machine)."""
  if "://" in str(path):
    raise UserError(f"workdir {path} is a URL: give a file system path (a bucket mounted "
                    f"with e.g. gcsfuse works)")


class Workdir:
  """One run's directory and the paths of what it holds."""

  def __init__(self, path):
    self.path = Path(path)

  @classmethod
  def of(cls, workdir) -> Workdir:
    """`workdir` if it is a Workdir already, else the Workdir at that path."""
    return workdir if isinstance(workdir, Workdir) else cls(workdir)

  @classmethod
  def checked(cls, workdir, must_exist: bool = True) -> Workdir:
    """The Workdir at `workdir`, or a one-line UserError for "", a URL, a file, or (if it
    must exist) a missing one."""
    if not str(workdir).strip():   # Path("") is the current directory
      raise UserError("workdir is empty: give a directory (--workdir DIR)")
    refuse_url(workdir)
    wd = cls.of(workdir)
    if wd.path.exists() and not wd.path.is_dir():
      raise UserError(f"workdir {workdir} is a file, not a directory")
    if must_exist and not wd.path.exists():
      raise UserError(f"workdir {workdir} does not exist")
    return wd

  def __str__(self) -> str:
    return str(self.path)

  def __fspath__(self) -> str:
    return str(self.path)

  def __repr__(self) -> str:
    return f"Workdir({str(self.path)!r})"

  # --- the layout -----------------------------------------------------------------------

  @property
  def config(self) -> Path:
    return self.path / CONFIG_FILE

  @property
  def vocab(self) -> Path:
    return self.path / VOCAB_FILE

  @property
  def vocab_record(self) -> Path:
    return self.path / VOCAB_RECORD_FILE

  @property
  def data_cache(self) -> Path:
    return self.path / DATA_CACHE_DIR

  @property
  def train_sources(self) -> Path:
    return self.path / TRAIN_SOURCES_FILE

  @property
  def checkpoints(self) -> Path:
    return self.path / CKPT_DIR

  @property
  def unreadable_checkpoints(self) -> Path:
    return self.path / UNREADABLE_DIR

  @property
  def metrics(self) -> Path:
    return self.path / METRICS_FILE

  @property
  def tensorboard(self) -> Path:
    return self.path / TENSORBOARD_DIR

  @property
  def lock_file(self) -> Path:
    return self.path / LOCK_FILE

  # --- the config -----------------------------------------------------------------------

  def read_config(self) -> Config | None:
    path = self.config
    if not path.exists():
      return None
    try:
      return Config.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ConfigError) as e:
      raise UserError(f"{path}: unreadable config ({str(e).splitlines()[0]})") from None

  def write_config(self, cfg: Config) -> None:
    """Atomic write (temp file + rename): a crash never leaves half a config, nor does a
    full disk (a UserError; the config before it stays)."""
    path = self.config
    tmp = path.with_suffix(".json.tmp")
    try:
      tmp.write_text(cfg.to_json())
      os.replace(tmp, path)
    except OSError as e:
      with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
      raise UserError(f"cannot write {path}: {e.strerror or e}") from None

  # --- a run in it ----------------------------------------------------------------------

  def create(self) -> list[Path]:
    """Makes the directory and its missing parents; returns those it made, deepest first."""
    made = [d for d in (self.path, *self.path.parents) if not d.exists()]
    try:
      self.path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise UserError(f"workdir {self} is not writable: {e.strerror or e}") from None
    return made

  @staticmethod
  def remove_made(made: list[Path]) -> None:
    """Removes the directories `create` made, deepest first, up to the first that holds
    something."""
    for d in made:
      try:
        d.rmdir()
      except OSError:
        break

  def prepare(self, cfg: Config) -> Config:
    """Creates/validates the workdir. A workdir that already holds a run must be resumed with
    the same model and data config (the run's train section may change, e.g. more steps)."""
    self.create()
    # The workdir, and what a run there writes into: each probed by writing, not by its mode
    # bits (root, read-only mounts, immutable files).
    for path, is_dir in ((self.path, True), (self.checkpoints, True), (self.data_cache, True),
                         (self.metrics, False)):
      try:
        if is_dir and path.exists():   # a probe of its own: processes probe it at once
          with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe"):
            pass
        elif path.exists():
          open(path, "a").close()
      except OSError as e:
        raise UserError(f"{'workdir ' if path == self.path else ''}{path} is not writable: "
                        f"{e.strerror or e}") from None
    old = self.read_config()
    return cfg if old is None else self._resumed_config(old, cfg)

  def _resumed_config(self, old: Config, cfg: Config) -> Config:
    """`cfg` for resuming the run of `old`: its model and data config, `cfg`'s train
    section; UserError if `cfg` changes what the checkpoints hold."""
    if _optimizer_structure(old) != _optimizer_structure(cfg):
      changed = [f"train.{k}: {getattr(old.train, k)} -> {getattr(cfg.train, k)}"
                 for k in ("clip_grad_norm", "weight_decay")
                 if (getattr(old.train, k) > 0) != (getattr(cfg.train, k) > 0)]
      raise UserError(f"workdir {self} holds a run whose optimizer state has another form "
                      f"({'; '.join(changed) or 'train section'}): turning clipping or weight "
                      f"decay on or off needs a new --workdir")
    for section in ("model", "data"):
      a, b = getattr(old, section), getattr(cfg, section)
      if section == "model":  # the vocabulary size is derived from the data; the kernels
        # compute the same model; the layers keep the layout the checkpoints hold
        b = b.replace(vocab_size=a.vocab_size, kernels=a.kernels, scan_layers=a.scan_layers)
      else:                   # a run stored before paths were made absolute
        a = a.with_absolute_paths()
      if a != b:
        diff = [f"{f.name}: {getattr(a, f.name)!r} -> {getattr(b, f.name)!r}"
                for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
        raise UserError(f"workdir {self} holds a run with a different {section} config "
                        f"({'; '.join(diff[:3])}); resume without changing it or use a new "
                        f"--workdir")
    return old.replace(model=old.model.replace(kernels=cfg.model.kernels),
                       data=old.data.with_absolute_paths(), train=cfg.train)

  def lock(self) -> WorkdirLock:
    """Takes the workdir's lock (lock.py); WorkdirLocked if another run holds it."""
    lock = WorkdirLock(self.path)
    lock.acquire()
    return lock

  def run_files(self) -> set[str]:
    """What a run writes (RUN_FILES, and each file of the data cache) that is there now."""
    names = {n for n in RUN_FILES if (self.path / n).exists()}
    if self.data_cache.is_dir():
      names |= {f"{DATA_CACHE_DIR}/{f.name}" for f in self.data_cache.iterdir()}
    return names

  def remove_new_run_files(self, before: set[str]) -> None:
    """Removes what this attempt wrote (the workdir is locked: no one else wrote it). Only the
    run's own files: anything else, e.g. checkpoints moved aside, stays."""
    for name in sorted(self.run_files() - before, key=lambda n: -n.count("/")):
      path = self.path / name
      if name == CKPT_DIR and any(path.iterdir()):
        continue
      if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
      else:
        path.unlink(missing_ok=True)


def _optimizer_structure(cfg: Config):
  """The tree structure of the optimizer's state (what a checkpoint must match)."""
  import jax   # here, not above: the layout and the lock need no JAX
  import numpy as np
  from seq2seq.state import optimizer
  return jax.tree_util.tree_structure(optimizer(cfg).init({"w": np.zeros(1, np.float32)}))


# The same for a path, as the modules that held them before offer them.

def read_config(workdir) -> Config | None:
  return Workdir.of(workdir).read_config()


def write_config(workdir, cfg: Config) -> None:
  Workdir.of(workdir).write_config(cfg)


def prepare_workdir(cfg: Config, workdir) -> Config:
  return Workdir.checked(workdir, must_exist=False).prepare(cfg)
