"""train.py with a cuDNN emulated to fail on some hosts (tests/test_attention_hosts.py):
XLA's attention whose backward fails as FAKE_CUDNN_FAILURE says, on the processes
FAKE_CUDNN_FAILS_ON names:

  nan      dq is NaN on every call: their probe refuses it;
  compile  in the run's programs (not the probe's), the backward is a call the compiler
           refuses (a kernel it does not have): their probe passes, their train step
           fails to compile;
  run      in the run's programs, the backward raises while the step runs (as cuDNN's
           "CUDNN_STATUS_EXECUTION_FAILED") on the last device of the last process: their
           probe passes, their first step fails there while the other devices, of this
           process and the others, wait for it inside it;
  hang     the same, but the backward never returns (a device that hangs);
  late     in the run's programs, the backward times out while the step is traced (a host
           late to agree): their probe passes, their step never compiles;
  eval_run, eval_hang
           as run and hang, in the forward of the evaluation's loss (a program with
           collectives) where the train step is well;
  decode_hang
           the forward of a decoding step (one query) never returns on their devices.

Writes this process's attention verdicts to $FAKE_CUDNN_VERDICTS.<process index> when
train.py is done. FAKE_STEP_WATCH="MIN_S,FACTOR" sets the step watch's bound
(seq2seq/watchdog.py)."""
import json
import logging
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

from seq2seq import watchdog  # noqa: E402
from seq2seq.kernels import accelerator as acc  # noqa: E402

FAILS_ON = {int(i) for i in os.environ.get("FAKE_CUDNN_FAILS_ON", "").split(",") if i}
FAILURE = os.environ.get("FAKE_CUDNN_FAILURE", "nan")


def _xla(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _in_probe() -> bool:
  frame = sys._getframe()
  while frame is not None:
    if frame.f_code.co_name == "_probe" and frame.f_code.co_filename == acc.__file__:
      return True
    frame = frame.f_back
  return False


def _check(_):
  if jax.process_index() in FAILS_ON and FAILURE.endswith("hang"):
    threading.Event().wait()
  if jax.process_index() in FAILS_ON:
    raise RuntimeError(f"CUDNN_STATUS_EXECUTION_FAILED: fmha "
                       f"{'forward' if FAILURE.startswith('eval') else 'backward'} (emulated)")
  return np.bool_(False)


def _checked(x, last_device: bool = True):
  """x, where a call to `_check` returned: the last device's (run by the last process), or
  (not `last_device`) the program's own device's."""
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1]) if last_device else None
  failed = io_callback(_check, jax.ShapeDtypeStruct((), jnp.bool_), x.reshape(-1)[0],
                       ordered=False, sharding=sharding)
  return jnp.where(failed, jnp.nan, x).astype(x.dtype)


@jax.custom_vjp
def fake_cudnn(q, k, v, mask):   # (the forward outside a train step: evaluation, decoding)
  out = _xla(q, k, v, mask)
  if FAILURE in ("eval_run", "eval_hang") and q.shape[1] > 1 and not _in_probe():
    out = _checked(out)
  if FAILURE == "decode_hang" and q.shape[1] == 1 and not _in_probe():
    out = _checked(out, last_device=False)
  return out


def _fwd(q, k, v, mask):
  return jax.vjp(lambda q, k, v: _xla(q, k, v, mask), q, k, v)


def _bwd(vjp, g):
  dq, dk, dv = vjp(g)
  here, run = jax.process_index() in FAILS_ON, not _in_probe()
  if FAILURE == "nan" and here:
    dq = dq * jnp.nan
  if FAILURE == "compile" and here and run:
    dq = jax.ffi.ffi_call("__cudnn$fmhaBackwardEmulated",
                          jax.ShapeDtypeStruct(dq.shape, dq.dtype))(dq)
  if FAILURE in ("run", "hang") and run:   # (the same program on every process)
    dq = _checked(dq)
  if FAILURE == "late" and here and run:
    raise jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: Barrier timed out (emulated)")
  return dq, dk, dv, None


fake_cudnn.defvjp(_fwd, _bwd)
acc.IMPLEMENTATIONS["cudnn"] = fake_cudnn
acc.unqualified = lambda q, mask=None: None   # cuDNN takes these inputs (here: the fake)
if os.environ.get("FAKE_STEP_WATCH"):
  watchdog.MIN_S, watchdog.FACTOR = map(float, os.environ["FAKE_STEP_WATCH"].split(","))
logging.getLogger("jax._src.callback").setLevel(logging.CRITICAL)   # (the emulated raise)

if __name__ == "__main__":
  import train
  code = train.main(sys.argv[1:])
  out = os.environ.get("FAKE_CUDNN_VERDICTS")
  if out:
    Path(f"{out}.{jax.process_index()}").write_text(json.dumps(acc.verdicts()))
  sys.exit(code)
