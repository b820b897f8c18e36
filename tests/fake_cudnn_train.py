"""train.py with a cuDNN emulated to fail on some hosts (tests/test_attention_hosts.py):
XLA's attention whose backward fails as FAKE_CUDNN_FAILURE says:

  nan      dq is NaN on every call on the processes FAKE_CUDNN_FAILS_ON names (their probe
           refuses it) and, on the others, only at the run's batch (more rows than the
           probe's 3: their probe passes, their train step is non-finite);
  compile  on the processes FAKE_CUDNN_FAILS_ON names, at the run's batch, the backward is
           a call the compiler refuses (a kernel it does not have): their probe passes,
           their train step fails to compile; the others' runs.

Writes this process's attention verdicts to $FAKE_CUDNN_VERDICTS.<process index> when
train.py is done."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from seq2seq.kernels import accelerator as acc  # noqa: E402

FAILS_ON = {int(i) for i in os.environ.get("FAKE_CUDNN_FAILS_ON", "").split(",") if i}
FAILURE = os.environ.get("FAKE_CUDNN_FAILURE", "nan")


def _xla(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


@jax.custom_vjp
def fake_cudnn(q, k, v, mask):
  return _xla(q, k, v, mask)


def _fwd(q, k, v, mask):
  return jax.vjp(lambda q, k, v: _xla(q, k, v, mask), q, k, v)


def _bwd(vjp, g):
  dq, dk, dv = vjp(g)
  here, run = jax.process_index() in FAILS_ON, g.shape[0] > 3
  if FAILURE == "nan" and (here or run):
    dq = dq * jnp.nan
  if FAILURE == "compile" and here and run:
    dq = jax.ffi.ffi_call("__cudnn$fmhaBackwardEmulated",
                          jax.ShapeDtypeStruct(dq.shape, dq.dtype))(dq)
  return dq, dk, dv, None


fake_cudnn.defvjp(_fwd, _bwd)
acc.IMPLEMENTATIONS["cudnn"] = fake_cudnn
acc.unqualified = lambda q, mask=None: None   # cuDNN takes these inputs (here: the fake)

if __name__ == "__main__":
  import train
  code = train.main(sys.argv[1:])
  out = os.environ.get("FAKE_CUDNN_VERDICTS")
  if out:
    Path(f"{out}.{jax.process_index()}").write_text(json.dumps(acc.verdicts()))
  sys.exit(code)
