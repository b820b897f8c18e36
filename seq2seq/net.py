"""The net under cuDNN's attention: a failure of cuDNN's attention does not end a run.

kernels/accelerator.py records which forms of attention a program gave cuDNN. A program
that gave it any and failed (a cuDNN call raised while it was traced, its compile or run
raised, its results were non-finite) is done again with those forms on XLA's attention, in
every role: the train step, the evaluation and decoding (`accelerator.move_to_xla`). One
line says so. The move is stored for later runs on this machine only where the evidence
names cuDNN: the error's text names cudnn or fmha, a cuDNN call raised while traced, or a
probe at the run's own form (its batch) fails now. An out-of-memory or a timeout is never
such evidence: it is raised as it is.

  `step_with_fallback`  a train step watched (the first CUDNN_WATCH_STEPS of a run): its
      state is kept on the host while cuDNN is in it (the step donates it), so a step that
      fails while it runs is redone on XLA's attention from the state it started from.
      Every host compiles the step before any runs it, and they agree on what failed
      through a vector of fixed size (`accelerator.agree`).
  `netted`              the evaluation and decoding (training's, decode.py's and the
      translation API's: translate.translate_nbest), done again on XLA's attention.
  `run_failures`        the run itself: an error in one line (out of memory; a failure with
      cuDNN's attention in the programs, after the watched steps, naming
      SEQ2SEQ_ATTENTION=xla), a step that fails on one of several devices or hangs
      stopping the run (seq2seq/watchdog.py), and on several hosts one host's failure
      stops every host within seconds (a host that cannot redo a step alone stops them all).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from seq2seq import steps, watchdog
from seq2seq.errors import UserError
from seq2seq.kernels import accelerator as acc

POLL_S = 0.5          # how often a host looks for another's failure
SEEN_TIMEOUT_S = 5.0  # how long a failing host waits for the others to see its failure
_STOP, _SEEN, _SAID = "seq2seq/net/stop/", "seq2seq/net/seen/", "seq2seq/net/said/"
_STOPPING = threading.Event()   # this host has told the others it stops
_NETTED = [0]   # > 0: inside `netted`, which does again what fails in it


class HostsStopped(UserError):
  """A host could not go on alone: every host of the run stops."""


# --- the train step ---------------------------------------------------------------------------

def step_with_fallback(trainer: steps.Trainer, state, batch: dict, watch: bool = True) -> tuple:
  """`trainer.step(state, batch)` under the net (unless not `watch`): returns (trainer,
  state, m, the lines saying what moved to XLA's attention). With nothing on cuDNN, or
  SEQ2SEQ_ATTENTION set (cudnn: its errors surface), this is the plain step."""
  watchdog.starting(state)
  if not watch or acc.requested() != "auto":
    state, m = trainer.step(state, batch)
    watchdog.dispatched(m)
    return trainer, state, m, []
  failure = _failed_before_running(trainer, state, batch)
  if failure is not None:
    forms, why, evidence = failure
    number = int(state.step) + 1
    return _redo(trainer, state, batch, forms, number, False,
                 f"step {number}: cuDNN's attention failed ({why}; query x key lengths "
                 f"{acc.lengths(forms)})", evidence)
  traced = trainer.attention
  forms = traced.forms()
  kept = _host_copy(state) if forms and jax.process_count() == 1 else None
  number = int(state.step) + 1 if forms else 0
  try:
    new, m = trainer.step(state, batch)
    watchdog.dispatched(m, number or None)
    if forms:
      jax.block_until_ready(m)   # (runs out or fails here)
  except Exception as e:
    if not forms or acc.not_a_verdict(e):
      raise
    line = (f"step {number}: cuDNN's attention failed while the step ran ("
            f"{acc.first_line(e)}; query x key lengths {acc.lengths(forms)})")
    if kept is None:   # several hosts: the others wait inside the step
      stop_every_host(line, forms, acc.names_cudnn(e))
    return _redo(trainer, jax.device_put(kept, trainer.state_sharding), batch, forms, number,
                 False, line, lambda e=e: _named(traced, e) or acc.failing_probes(traced, forms))
  training = traced.training()
  if not training or not acc.agree(non_finite=int(m["first_bad_step"]) < steps.NO_STEP)[
      "non_finite"]:
    return trainer, new, m, []
  number = int(m["first_bad_step"])
  return _redo(trainer, new.replace(step=new.step - 1), batch, training, number, True,
               f"step {number}: non-finite loss or gradient with cuDNN's attention "
               f"(query x key lengths {acc.lengths(training)})",
               lambda: acc.failing_probes(traced, training))


def _host_copy(state):
  """The state as host arrays (copies: the step donates the device's)."""
  return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), state)


def _failed_before_running(trainer: steps.Trainer, state, batch) -> tuple | None:
  """Traces and compiles the step if it is not yet, for the verdicts in use (on every host,
  before any runs it). None if nothing failed on cuDNN on any host; else (the forms to move,
  why, this host's evidence: a function giving the forms whose move it stores)."""
  error = None
  if trainer.attention is None or trainer.attention.generation != acc.generation():
    try:
      trainer.step.lower(state, batch).compile()
    except Exception as e:
      error = e
  traced = trainer.attention
  if traced is None or not traced.uses:   # nothing on cuDNN (alike on every host)
    if error is not None:
      raise error
    return None
  seen = acc.agree(failed=error is not None or bool(traced.failed),
                   not_a_verdict=error is not None and acc.not_a_verdict(error))
  if not seen["failed"]:
    return None
  if seen["not_a_verdict"]:   # out of memory or a timeout, here or on another host
    if error is None:
      raise HostsStopped("the train step ran out of memory or timed out on another host")
    if "RESOURCE_EXHAUSTED" in str(error):
      raise error   # (said in one line by `run_failures`)
    raise UserError(f"the train step failed: {acc.first_line(error)}") from None
  forms = traced.forms()
  if error is not None:
    why = acc.first_line(error)
  else:
    why = (f"{next(iter(traced.failed.values()))}, while traced" if traced.failed else
           "on another host")
  return forms, why, lambda: _named(traced, error) or acc.failing_probes(traced, forms)


def _redo(trainer, state, batch, forms, number: int, nonfinite: bool, line: str,
          evidence) -> tuple:
  """The step redone from `state` by a new trainer with `forms` on XLA's attention; the move
  stored for the forms `evidence()` gives, undone if the redo fails too."""
  moved = acc.move_to_xla(forms, f"a train step with it was non-finite (step {number})"
                          if nonfinite else f"a train step with it failed (step {number})")
  watchdog.redoing(number)
  try:
    redo, state, m, said = step_with_fallback(
        steps.Trainer(trainer.cfg, trainer.mesh, trainer.bos_id), state, batch)
  except Exception:
    acc.undo(moved)   # it fails without them too: not their doing
    raise
  if nonfinite and int(m["first_bad_step"]) < steps.NO_STEP:
    # The run diverged: not cuDNN's doing. Its verdicts stay as they were; this run, which
    # stops at its next log, goes on with the redo's trainer (no further redo).
    acc.undo(moved)
    return redo, state, m, [line + ": non-finite with XLA's attention too on the same batch, "
                            "so not cuDNN's doing (its verdicts kept)", *said]
  return redo, state, m, [line + ": moved to XLA's attention and redid the step"
                          + _kept(moved, forms, evidence()), *said]


def _kept(moved: dict, forms, stored) -> str:
  """Stores the moves of `stored` (the forms the evidence names); says which."""
  acc.keep(moved, stored)
  if set(stored) >= set(forms):
    return " (kept for later runs)"
  if stored:
    return f" (kept for later runs: {acc.lengths(stored)})"
  return (" (not kept for later runs: nothing names cuDNN, and its probe at the run's form "
          "passes)")


# --- evaluation and decoding --------------------------------------------------------------

def netted(what: str, run: Callable, finite: Callable = lambda out: True) -> tuple:
  """`run()` (an evaluation, decoding) under the net: returns (its result, the lines saying
  what moved). If a program it runs gave cuDNN a form and failed with it (raised while
  traced, compiling or running; `finite(result)` false), those forms move to XLA's
  attention for every role and `run` is done again. On several hosts no host redoes alone:
  every host stops (`stop_every_host`), the move stored where the evidence names cuDNN.
  Inside another `netted` (translations in an evaluation) this is `run()`: the outer one
  does it again."""
  if acc.requested() != "auto" or _NETTED[0]:
    return run(), []
  _NETTED[0] += 1
  try:
    return _netted(what, run, finite)
  finally:
    _NETTED[0] -= 1


def _netted(what: str, run: Callable, finite: Callable) -> tuple:
  result, failure, traced = _attempted(run, finite)
  if failure is None and not traced.failed:
    return result, []
  if not traced.uses:   # its programs were traced before: again, to learn their forms
    if not acc.in_use():
      return _as_it_is(result, failure)
    jax.clear_caches()
    result, failure, traced = _attempted(run, finite)
    if (failure is None and not traced.failed) or not traced.uses:
      return _as_it_is(result, failure)
  forms = traced.forms()
  named = _named(traced, failure)
  why = (acc.first_line(failure) if isinstance(failure, BaseException) else
         f"{next(iter(traced.failed.values()))}, while traced" if failure is None else failure)
  line = f"{what}: cuDNN's attention failed ({why}; query x key lengths {acc.lengths(forms)})"
  if jax.process_count() > 1:
    stop_every_host(line, named, True)
  moved, tried = {}, []
  while forms:   # until nothing left on cuDNN fails (a form moved takes XLA's from now on)
    moved = {**acc.move_to_xla(forms, f"{what} with it failed"), **moved}
    tried += forms
    try:
      result, failure, again = _attempted(run, finite)
    except Exception:
      acc.undo(moved)
      raise
    forms = again.forms() if failure is not None or again.failed else []
    named += _named(again, failure)
    if failure is not None and not forms:
      acc.undo(moved)
      if isinstance(failure, BaseException):
        raise failure
      return result, [line + ": non-finite with XLA's attention too, so not cuDNN's doing"]
  stored = named or acc.failing_probes(traced, traced.forms())
  return result, [line + f": moved to XLA's attention and did the {what} again"
                  + _kept(moved, tried, stored)]


def _attempted(run: Callable, finite: Callable) -> tuple:
  """(the result, None or why it failed: an exception, or "non-finite results", what its
  programs gave cuDNN while traced). An out-of-memory or a timeout is raised."""
  with acc.recording() as traced:
    try:
      result = jax.block_until_ready(run())
    except Exception as e:
      if acc.not_a_verdict(e):
        raise
      return None, e, traced
  return result, (None if finite(result) else "non-finite results"), traced


def _named(traced: acc.Recording, failure) -> list:
  """The forms the evidence names: those whose cuDNN call raised while traced, or all the
  programs gave cuDNN where the error's text names cuDNN."""
  raised = list(dict.fromkeys(key for key, _ in traced.failed))
  if isinstance(failure, BaseException) and acc.names_cudnn(failure):
    return list(dict.fromkeys(raised + traced.forms()))
  return raised


def _as_it_is(result, failure) -> tuple:
  """The error raised, or the result returned (non-finite, with nothing on cuDNN: not
  cuDNN's doing)."""
  if isinstance(failure, BaseException):
    raise failure
  return result, []


def finite_metrics(m: dict) -> bool:
  return all(math.isfinite(v) for v in m.values() if isinstance(v, (int, float)))


# --- the run: one line, and every host stops --------------------------------------------------

def divergence_hint() -> str:
  """What a message on a non-finite train step advises: cuDNN named where the train step
  gives its attention differentiated calls."""
  forms = acc.in_use("train") if acc.requested() == "auto" else []
  if not forms:
    return "lower the learning rate?"
  return (f"cuDNN's attention trains in it, query x key lengths {acc.lengths(forms)}: rerun "
          f"with SEQ2SEQ_ATTENTION=xla to resume on XLA's attention; if that diverges too, "
          f"lower the learning rate")


@contextlib.contextmanager
def run_failures(cfg, devices: int):
  """Around a run's steps: an out-of-memory, or a failure while cuDNN's attention is in the
  run's programs (after the watched steps: the state was donated, nothing is redone), in
  one line; a step that fails on one device while the others wait for it, or hangs, stops
  the run (`watchdog`, `_step_stopped`); on several hosts, a thread that ends this host
  within seconds of another's failure, and this host's failure told to the others."""
  done = threading.Event()
  hosts = threading.Thread(target=_watch, args=(done,), daemon=True, name="seq2seq-hosts")
  if jax.process_count() > 1:
    hosts.start()
  try:
    try:
      with watchdog.watching(_step_stopped):
        yield
    except jax.errors.JaxRuntimeError as e:
      steps.raise_if_out_of_memory(e, cfg, devices)
      _raise_if_cudnn_failed(e)
      raise
  except BaseException as e:
    if jax.process_count() > 1:
      _tell_the_others(str(e).splitlines()[0] if isinstance(e, UserError) else
                       acc.first_line(e))
    raise
  finally:
    done.set()
    if hosts.is_alive():   # (as watchdog.watching's: out of jaxlib before the exit)
      hosts.join(timeout=watchdog.JOIN_S)


def _raise_if_cudnn_failed(e: BaseException) -> None:
  forms = acc.in_use() if acc.requested() == "auto" else []
  if forms and not acc.not_a_verdict(e):
    raise UserError(f"{acc.first_line(e)} with cuDNN's attention in the run's programs "
                    f"(query x key lengths {acc.lengths(forms)}): the checkpoints saved "
                    f"before it are intact; rerun with SEQ2SEQ_ATTENTION=xla to resume on "
                    f"XLA's attention") from None


def _step_stopped(line: str, error: BaseException | None) -> None:
  """A step that failed on one device while the others waited for it, or hung
  (`watchdog`): every host stops. The move of cuDNN's forms to XLA's attention is stored
  where the error names cuDNN."""
  forms = acc.in_use() if acc.requested() == "auto" else []
  if forms:
    line += f", cuDNN's attention in the run's programs (query x key lengths " \
            f"{acc.lengths(forms)})"
  cleared = error is not None and acc.not_a_verdict(error)   # out of memory, a timeout
  stop_every_host(line, forms, error is not None and acc.names_cudnn(error) and not cleared,
                  cudnn=bool(forms) and not cleared)


def stop_every_host(line: str, forms=(), store: bool = False, cudnn: bool = True):
  """Ends this process (exit 2, `line` on standard error) once every other host has seen
  it (they end too): on several hosts a failure inside a program leaves the others waiting
  in its collectives, so no host may redo it alone, nor run the collectives of a clean exit
  (a checkpoint manager's) while the others are elsewhere. With `store`, the move of
  `forms` to XLA's attention is stored first (the evidence names cuDNN), and the rerun
  resumes on it; `cudnn` false: cuDNN's attention had no part in it."""
  who = "every host stops" if jax.process_count() > 1 else "the run stops"
  if forms and store:
    acc.keep(acc.move_to_xla(forms, "failed on this host"))
    line += f": {who}; rerun to resume from the last checkpoint on XLA's attention"
  elif cudnn:
    line += (f": {who}; rerun with SEQ2SEQ_ATTENTION=xla to resume from the last "
             "checkpoint on XLA's attention")
  else:
    line += f": {who}; rerun to resume from the last checkpoint"
  _tell_the_others(line)
  _leave(f"error: {line}")


def _client():
  from jax._src import distributed
  return distributed.global_state.client


def _tell_the_others(line: str) -> None:
  """Posts this host's failure for the others' watch (once), and waits up to SEEN_TIMEOUT_S
  until each has seen it: a host that ends first may take the key-value store with it."""
  if _STOPPING.is_set():
    return
  _STOPPING.set()
  me, client = jax.process_index(), _client()
  try:
    client.key_value_set(f"{_STOP}{me}", line, allow_overwrite=True)
    deadline = time.time() + SEEN_TIMEOUT_S
    for i in range(jax.process_count()):
      if i != me:
        client.blocking_key_value_get(f"{_SEEN}{i}", max(1, int(1000 * (deadline - time.time()))))
  except Exception:   # noqa: BLE001 - a host already gone, or one that did not answer in time
    pass


def _leave(line: str) -> None:
  """Says `line` and ends this process, exit 2. Process 0, which holds the key-value store,
  ends last (up to SEEN_TIMEOUT_S): its end takes the store along, and JAX aborts a host
  still connected to it, before that host has said its line."""
  print(line, file=sys.stderr, flush=True)
  if jax.process_count() > 1:
    me = jax.process_index()
    try:
      if me:
        _client().key_value_set(f"{_SAID}{me}", "1", allow_overwrite=True)
      else:
        deadline = time.time() + SEEN_TIMEOUT_S
        for i in range(1, jax.process_count()):
          _client().blocking_key_value_get(f"{_SAID}{i}",
                                           max(1, int(1000 * (deadline - time.time()))))
    except Exception:   # noqa: BLE001 - a host already gone, or one that did not answer in time
      pass
  os._exit(2)


def _watch(done: threading.Event) -> None:
  """Until `done`: ends this process (exit 2, one line) within POLL_S of another host posting
  its failure, unless this one is stopping too (then it only says it saw it)."""
  me, client = jax.process_index(), _client()
  while not done.wait(POLL_S):
    try:
      posted = [(int(k.rsplit("/", 1)[-1]), v) for k, v in client.key_value_dir_get(_STOP)]
    except Exception:   # noqa: BLE001 - no key-value store: JAX's heartbeats take over
      return
    others = [(who, line) for who, line in posted if who != me]
    if not others:
      continue
    try:
      client.key_value_set(f"{_SEEN}{me}", "1", allow_overwrite=True)
    except Exception:   # noqa: BLE001
      pass
    if not _STOPPING.is_set():
      who, line = others[0]
      _leave(f"error: process {who} stopped the run: {line}")
    return
