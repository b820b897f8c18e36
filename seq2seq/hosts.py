"""The hosts of a multi-host run agree on every refusal before the first step, and leave
together.

Each stage before the first step (the workdir and its lock, the vocabulary, the token ids,
the state) ends in an agreement (`stage`): every host posts to jax.distributed's key-value
store that it goes on, or the line that refuses the run, and reads every other host's post
with a blocking read (the store answers once the post is there: nothing polls). So a
refusal on any host reaches every host as it ends the stage, and hosts that wait for
another's work (the vocabulary process 0 trains) learn at once that it failed. Every host
then raises it (`Refused`): its own line, or "process K stopped the run: ...".

The hosts of a refused run leave together (`leave`): jax.distributed.shutdown is a barrier,
and process 0 serves the key-value store: a host that outlives it aborts with a C++ stack
trace.

(Not an XLA collective, as a broadcast is: it carries a number, not the line, and runs a
program compiled for the mesh that waits at most XLA's limit, 30 minutes on CPUs, while
process 0 may be building a dataset.)
"""
from __future__ import annotations

import contextlib
import time

from seq2seq.errors import UserError

# How long a host waits for the others at an agreement (process 0 may build a TFDS dataset
# meanwhile). A host that dies ends the run sooner, through JAX's heartbeats.
WAIT_S = 6 * 3600
_KEY = "seq2seq/hosts/"
_GO = "go"


class Refused(UserError):
  """A refusal of the run that every host raises."""


_agreements = 0   # agreements this process has taken part in
_waited = 0.0     # seconds it waited in them for the other hosts
_started = False  # past the last agreement: the run trains (its failures are seq2seq.net's)


def _distributed():
  """jax.distributed's state where several processes run (None for one)."""
  from jax._src import distributed
  state = distributed.global_state
  return state if state.client is not None and (state.num_processes or 1) > 1 else None


def _post(state, number: int, word: str) -> str:
  """Posts this host's word at agreement `number` (counted alike on every host); its key."""
  key = f"{_KEY}{number}/"
  state.client.key_value_set(f"{key}{state.process_id}", word, allow_overwrite=True)
  return key


def agree(stage: str, error: UserError | None = None) -> None:
  """Every host's word at the end of `stage`: returns once all go on; raises Refused on every
  host if any refused it (`error`, on that host: it says its own line, the others the first
  refusing host's). On one host, raises `error`."""
  global _agreements, _waited
  state = _distributed()
  if state is None:
    if error is not None:
      raise error
    return
  number, _agreements = _agreements, _agreements + 1
  mine = None if error is None else (str(error) or type(error).__name__)
  key = _post(state, number, _GO if mine is None else f"refused: {mine}")
  first, since = None, time.perf_counter()
  for i in range(state.num_processes):
    if i == state.process_id:
      continue
    try:
      word = state.client.blocking_key_value_get(f"{key}{i}", WAIT_S * 1000)
    except Exception:   # noqa: BLE001 - the store's timeout (a host that died ends this one)
      word = f"refused: it did not end {stage} within {WAIT_S // 3600} h"
    if word != _GO and first is None:
      first = (i, word.removeprefix("refused: "))
  _waited += time.perf_counter() - since
  if mine is not None:
    raise Refused(mine) from error
  if first is not None:
    raise Refused(f"process {first[0]} stopped the run: {first[1]}")


@contextlib.contextmanager
def stage(name: str):
  """A stage of the run's start on this host, then the hosts' agreement on it: a UserError
  raised in it refuses the run on every host."""
  try:
    yield
  except Refused:
    raise
  except UserError as e:
    agree(name, e)
  else:
    agree(name)


def waited() -> float:
  """Seconds this process has waited for the other hosts at agreements."""
  return _waited


def started() -> None:
  """The hosts agreed on everything before the first step: from now on a failure on one host
  is seq2seq.net's to tell the others."""
  global _started
  _started = True


def leave(error: BaseException) -> None:
  """Before the process of a refused run exits: ends jax.distributed together with the other
  hosts where all of them leave now, so that none outlives process 0's key-value store. That
  is a refusal they agreed on (Refused), or one before the first step outside a stage (said
  to the others first, at the agreement they reach next: a refusal in train.py's flags or
  config, which every host makes alike)."""
  state = _distributed()
  if state is None or (_started and not isinstance(error, Refused)):
    return
  if not isinstance(error, Refused):
    _post(state, _agreements, f"refused: {error}")
  import jax
  jax.distributed.shutdown()
