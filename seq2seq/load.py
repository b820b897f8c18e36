"""A trained model from its workdir alone: `load_workdir(workdir)` gives config, parameters
and tokenizer, with no flags."""
from __future__ import annotations

import contextlib
import logging
import os

import jax
import orbax.checkpoint as ocp

from seq2seq.checkpoint import Checkpoints, local_abstract_state
from seq2seq.errors import UserError
from seq2seq.workdir import Workdir


def load_workdir(workdir: Workdir | str | os.PathLike, step: int | None = None):
  """(config, params, tokenizer) from a workdir written by train.py, on the default device.
  The parameters are laid out as the config says: each stack's layers stacked on a leading
  axis (model.scan_layers) or one module per layer (`layout.unroll_layers` gives the
  latter; decoding takes either). The tokenizer normalises sources as the run's data
  config says (data.lowercase_source)."""
  with _quiet_orbax():
    return _load(Workdir.checked(workdir), step)


def _load(wd: Workdir, step: int | None):
  from seq2seq.data import Tokenizer
  cfg = wd.read_config()
  if cfg is None:
    raise UserError(f"{wd} holds no {wd.config.name}: is it a train.py workdir?")
  if not wd.vocab.exists():
    raise UserError(f"{wd} holds no {wd.vocab.name}")
  ckpts = Checkpoints(wd, read_only=True)
  if not ckpts.steps():
    raise UserError(f"{wd} holds no checkpoint")
  target = local_abstract_state(cfg).params
  _check_param_shapes(wd, ckpts, step, target)
  try:
    restored = ckpts.restore(target, step, params_only=True)
  except (ValueError, TypeError) as e:
    if isinstance(e, UserError):
      raise
    raise UserError(f"{wd}: checkpoint does not match its config.json "
                    f"({str(e).splitlines()[0][:160]})") from None
  if restored is None:
    raise UserError(f"{wd}: no readable checkpoint (all were skipped)")
  params, _ = restored
  return cfg, params, Tokenizer.load(str(wd.vocab), lowercase_source=cfg.data.lowercase_source)


def _check_param_shapes(wd: Workdir, ckpts: Checkpoints, step: int | None, params) -> None:
  """UserError if the stored parameters of `step` (default: the newest) differ in names or
  shapes from `params` (those config.json describes), e.g. after config.json was edited.
  Checked from the checkpoint's metadata before restoring, so the user sees one line rather
  than Orbax's per-array errors and a fallback through every older checkpoint."""
  s = step if step is not None else ckpts.steps()[-1]
  try:
    with ocp.StandardCheckpointer() as reader:
      stored = reader.metadata(ckpts.directory / str(s) / "state").item_metadata["params"]
  except Exception:  # unreadable metadata: restore() reports (or skips) this checkpoint
    return

  def shapes(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  want, have = shapes(params), shapes(stored)
  if want == have:
    return
  diff = [f"{k}: stored {have[k]}, config {want[k]}" for k in want
          if k in have and have[k] != want[k]]
  diff += [f"{k} not in the checkpoint" for k in want if k not in have]
  diff += [f"{k} not in the config" for k in have if k not in want]
  config = wd.config.name
  raise UserError(f"{wd}: checkpoint {s} does not match its {config} "
                  f"({'; '.join(diff[:2])}{'; ...' if len(diff) > 2 else ''}); was "
                  f"{config} edited?")


class _BelowError(logging.Filter):
  """Orbax's records below ERROR (it logs through absl)."""

  def filter(self, record):
    return record.levelno >= logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax():
  """A read-only restore makes Orbax log four warnings of routine facts (read-only options,
  no metadata file of old checkpoints); silence those, only while the block runs."""
  logger, quiet = logging.getLogger("absl"), _BelowError()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)
