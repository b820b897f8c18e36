"""Attention on GPU/TPU: `jax.nn.dot_product_attention`, with its implementation named.

Left to itself (`implementation=None`), jax.nn runs XLA's own attention, never cuDNN's. Here
the choice is made per form of call (dtype, heads, head size, query and key lengths, mask
form), once per machine: the verdicts are kept beside the compile cache
(attention_verdicts.json, by device and JAX and cuDNN versions), so a later run probes
nothing, and a later run's first step comes from the compile cache alone.

  cudnn  cuDNN's fused (flash) attention, on an NVIDIA GPU, for bf16/fp16 inputs whose head
         size is a multiple of 8 (at most 256), when a probe of that form (its own query and
         key lengths, a small batch of random inputs with padding and packed rows) compiled,
         ran and matched XLA's attention: relative difference under 2% in the output, and in
         dq, dk, dv for a call that is differentiated. The boolean mask goes in as an
         additive bias broadcast to [B or 1, 1, Q, K].
  xla    XLA's attention: everywhere else, and wherever the probe raised or disagreed.

No implementation is given a query with no allowed key (a padding position): such a row
may attend to every key instead (`open_empty_rows`). Nothing reads its output, and a fused
kernel never meets a softmax over nothing (cuDNN's backward returns NaN for such rows at
lengths of 64 mod 128 on H100s: its logsumexp of about -1e12 overflows the padded half of
the last key tile). If a train step with cuDNN's attention still turns out non-finite, the
training loop moves its forms to XLA (`move_training_to_xla`) and redoes the step.

A call that is differentiated uses cuDNN only if the probe's backward passed too; its
plain forward (decoding, evaluation) may use cuDNN when only the forward passed
(e.g. cuDNN refuses the backward of an odd length with a bias). A refused or failed cuDNN
is never an error: the run goes on with XLA, and `verdicts()` says what was chosen and why.

SEQ2SEQ_ATTENTION=auto (default) | xla (never cuDNN) | cudnn (cuDNN without probing; its
errors surface: for checking it on a new machine).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from seq2seq.attention import dot_product_attention
from seq2seq.errors import UserError

ENV = "SEQ2SEQ_ATTENTION"
CHOICES = ("auto", "xla", "cudnn")
TOLERANCE = 0.02           # relative L2 difference cuDNN vs XLA, bf16/fp16 inputs
MAX_HEAD_DIM = 256

# signature -> {"forward": (ok, reason), "train": (ok, reason)}
_VERDICTS: dict = {}
# What `_call` runs for each implementation name: jax.nn.dot_product_attention's own.
IMPLEMENTATIONS = {
    "xla": lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                              implementation="xla"),
    "cudnn": lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                                implementation="cudnn"),
}


def requested() -> str:
  """The SEQ2SEQ_ATTENTION setting (auto when unset)."""
  value = os.environ.get(ENV, "") or "auto"
  if value not in CHOICES:
    raise UserError(f"{ENV} must be auto, xla or cudnn, got {value!r}")
  return value


def verdicts() -> list[dict]:
  """What this process chose for each form of attention it traced, and why."""
  return [dict(signature=dict(zip(("dtype", "heads", "head_dim", "q_len", "k_len",
                                   "mask_batch"), key)),
               forward=dict(ok=v["forward"][0], reason=v["forward"][1]),
               train=dict(ok=v["train"][0], reason=v["train"][1]))
          for key, v in _VERDICTS.items()]


def unqualified(q_BxQxHxD, mask=None) -> str | None:
  """Why cuDNN cannot take these inputs at all (None: it may; a probe decides)."""
  backend = jax.default_backend()
  if backend != "gpu":
    return f"backend {backend}"
  dtype = jnp.dtype(q_BxQxHxD.dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {dtype.name} (cuDNN takes bfloat16 and float16)"
  d = q_BxQxHxD.shape[-1]
  if d % 8 or d > MAX_HEAD_DIM:
    return f"head size {d} (cuDNN takes multiples of 8 up to {MAX_HEAD_DIM})"
  if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1):
    return f"mask of shape {tuple(mask.shape)} (expected [B or 1, 1, Q or 1, K])"
  return None


def _bias_mask(mask, q_len: int, k_len: int):
  """The mask broadcast to [B or 1, 1, Q, K], the form cuDNN's bias takes."""
  if mask is None:
    return None
  return jnp.broadcast_to(mask, (mask.shape[0], 1, q_len, k_len))


def open_empty_rows(mask):
  """`mask` with every query that may attend to no key allowed to attend to all of them."""
  if mask is None:
    return None
  return mask | ~jnp.any(mask, axis=-1, keepdims=True)


def _call(implementation: str, q, k, v, mask):
  """`implementation`'s attention on [B, L, H, D] inputs."""
  if implementation == "cudnn":
    mask = _bias_mask(mask, q.shape[1], k.shape[1])
  return IMPLEMENTATIONS[implementation](q, k, v, mask)


def _signature(q, k, mask) -> tuple:
  b, q_len, h, d = q.shape
  mask_batch = None if mask is None else ("1" if mask.shape[0] == 1 else "B")
  return (jnp.dtype(q.dtype).name, h, d, q_len, k.shape[1], mask_batch)


def _probe_mask(rows: int, q_len: int, k_len: int, rng) -> np.ndarray:
  """[rows, 1, Q, K] masks of the forms the model makes at these lengths, before
  `open_empty_rows`: each row's tokens packed as examples with padding after them (real
  queries see the real keys of their own example; causal too where Q == K, in every other
  row), padding queries see nothing, and the last of 3+ rows is all padding."""
  m = np.zeros((rows, 1, q_len, k_len), bool)
  for r in range(rows - (rows > 2)):
    q_seg, k_seg = (np.zeros(n, int) for n in (q_len, k_len))
    for seg, n in ((q_seg, q_len), (k_seg, k_len)):
      used = max(1, int(n * rng.uniform(0.5, 0.9)))   # a packed row's fill
      cut = max(1, used // 2)
      seg[:cut], seg[cut:used] = 1, 2
    m[r, 0] = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] > 0)
    if q_len == k_len and r % 2:
      m[r, 0] &= np.tri(q_len, dtype=bool)
  return m


def _probe_inputs(q, k, mask, seed: int = 0):
  """Random inputs of the same form as (q, k, mask): its lengths, head size and dtype, a
  batch of 3 rows (1 for a mask shared by every row), masks as `_probe_mask` makes them,
  opened as every call's are."""
  rng = np.random.default_rng(seed)
  b = 3 if mask is not None and mask.shape[0] > 1 else 1
  dtype = q.dtype
  qs = jnp.asarray(rng.normal(size=(b,) + q.shape[1:]), dtype)
  ks, vs = (jnp.asarray(rng.normal(size=(b,) + k.shape[1:]), dtype) for _ in range(2))
  ms = None
  if mask is not None:
    q_len, k_len = mask.shape[2], k.shape[1]
    if mask.shape[0] == 1:     # shared by every row: the causal mask (or none)
      m = np.tri(q_len, k_len, k_len - q_len, dtype=bool)[None, None]
    else:
      m = _probe_mask(b, q_len, k_len, rng)
    ms = open_empty_rows(jnp.asarray(m))
  g = jnp.asarray(rng.normal(size=qs.shape), dtype)
  return qs, ks, vs, ms, g


def _relative_difference(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _probe(q, k, mask, train: bool) -> tuple[bool, str]:
  """(cuDNN ran and matched XLA, what was seen) for inputs of this form."""
  try:
    with jax.ensure_compile_time_eval():
      qs, ks, vs, ms, g = _probe_inputs(q, k, mask)

      def run(implementation):
        if not train:
          return (jax.jit(functools.partial(_call, implementation))(qs, ks, vs, ms),)
        f = lambda q, k, v, m, g: jax.vjp(
            lambda q, k, v: _call(implementation, q, k, v, m), q, k, v)[1](g)
        return jax.jit(f)(qs, ks, vs, ms, g)

      got, want = run("cudnn"), run("xla")
      worst = 0.0
      for name, a, b in zip(("out",) if not train else ("dq", "dk", "dv"), got, want):
        if not np.isfinite(np.asarray(a, np.float32)).all():
          return False, f"cuDNN gave non-finite {name}"
        worst = max(worst, _relative_difference(a, b))
        if worst > TOLERANCE:
          return False, f"cuDNN differs from XLA: {name} {worst:.3g} relative"
      return True, f"matched XLA ({worst:.2g} relative)"
  except Exception as e:   # noqa: BLE001 - whatever cuDNN or its lowering raised
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return False, f"{type(e).__name__}: {first}"


def choose(q_BxQxHxD, k_BxKxHxD, mask=None) -> tuple[str, str]:
  """(implementation of a plain forward call, implementation of a differentiated call)."""
  want = requested()
  if want != "auto":
    return want, want
  if unqualified(q_BxQxHxD, mask) is not None:
    return "xla", "xla"
  key = _signature(q_BxQxHxD, k_BxKxHxD, mask)
  if key not in _VERDICTS:
    _VERDICTS[key] = _stored().get(_key_text(key)) or {}
  if not _VERDICTS[key]:
    fwd = _probe(q_BxQxHxD, k_BxKxHxD, mask, train=False)
    train = _probe(q_BxQxHxD, k_BxKxHxD, mask, train=True) if fwd[0] else \
        (False, "forward failed")
    _VERDICTS[key] = {"forward": fwd, "train": train}
    _store(key)
  v = _VERDICTS[key]
  return ("cudnn" if v["forward"][0] else "xla"), ("cudnn" if v["train"][0] else "xla")


def training_on_cudnn() -> list[tuple]:
  """The forms whose differentiated calls this process gave cuDNN (auto only)."""
  return [key for key, v in _VERDICTS.items() if v["train"][0]] if requested() == "auto" \
      else []


def move_training_to_xla(reason: str) -> list[tuple]:
  """Every form whose differentiated calls took cuDNN takes XLA's attention from the next
  trace on (its plain forward keeps its choice); returns those forms."""
  moved = training_on_cudnn()
  for key in moved:
    _VERDICTS[key] = dict(_VERDICTS[key], train=(False, reason))
    _store(key)
  return moved


# --- verdicts kept beside the compile cache: a later run on this machine probes nothing -----

def _verdicts_file() -> Path | None:
  """attention_verdicts.json in the compile cache's directory (none without one)."""
  where = jax.config.jax_compilation_cache_dir
  return Path(where) / "attention_verdicts.json" if where else None


def _machine() -> str:
  """What a verdict holds for: the device, JAX's versions and cuDNN's."""
  try:
    from jax._src.lib import cuda_versions
    cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:   # noqa: BLE001 - no CUDA build
    cudnn = None
  import jaxlib
  return (f"{jax.devices()[0].device_kind}; jax {jax.__version__}, jaxlib {jaxlib.__version__},"
          f" cuDNN {cudnn}")


def _key_text(key: tuple) -> str:
  return json.dumps(list(key))


def _stored() -> dict:
  """This machine's stored verdicts, by form ({} when there are none or they are unreadable)."""
  path = _verdicts_file()
  try:
    return json.loads(path.read_text()).get(_machine(), {}) if path else {}
  except (OSError, ValueError, AttributeError):
    return {}


def _store(key: tuple) -> None:
  """Writes `key`'s verdict for this machine (atomically; a cache that cannot be written is
  no error)."""
  path = _verdicts_file()
  if path is None:
    return
  try:
    every = json.loads(path.read_text()) if path.exists() else {}
    every.setdefault(_machine(), {})[_key_text(key)] = _VERDICTS[key]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(every, indent=1))
    os.replace(tmp, path)
  except (OSError, ValueError, AttributeError):
    pass


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split(forward: str, train: str, q, k, v, mask):
  """`forward`'s attention; differentiated, `train`'s forward and backward."""
  return _call(forward, q, k, v, mask)


def _split_fwd(forward, train, q, k, v, mask):
  y, vjp = jax.vjp(lambda q, k, v: _call(train, q, k, v, mask), q, k, v)
  return y, vjp


def _split_bwd(forward, train, vjp, g):
  return (*vjp(g), None)


_split.defvjp(_split_fwd, _split_bwd)


def attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask=None, *, dropout_rate: float = 0.0,
              dropout_rng=None):
  """`attention.dot_product_attention` through jax.nn (no dropout there: with attention
  dropout in training, the reference answers). A query with no allowed key attends to
  every key here (`open_empty_rows`), not to none: only padding queries are such, and
  nothing reads them."""
  if dropout_rate > 0.0 and dropout_rng is not None:
    return dot_product_attention(q_BxHxQxD, k_BxHxKxD, v_BxHxKxD, mask,
                                 dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  to_BxLxHxD = lambda x: x.swapaxes(1, 2)
  q = to_BxLxHxD(q_BxHxQxD)
  k, v = (to_BxLxHxD(x).astype(q.dtype) for x in (k_BxHxKxD, v_BxHxKxD))
  mask = open_empty_rows(mask)
  forward, train = choose(q, k, mask)
  if forward == train:
    y_BxQxHxD = _call(forward, q, k, v, mask)
  else:
    y_BxQxHxD = _split(forward, train, q, k, v, mask)
  return y_BxQxHxD.swapaxes(1, 2)
