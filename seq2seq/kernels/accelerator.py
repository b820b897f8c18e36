"""Attention on GPU/TPU: `jax.nn.dot_product_attention`, with its implementation named.

Left to itself (`implementation=None`), jax.nn runs XLA's own attention, never cuDNN's. Here
the choice is made per form of call (dtype, heads, head size, query and key lengths, mask
form) and per role (a plain forward, or a differentiated call: forward and backward), once
per machine: the verdicts are kept beside the compile cache (attention_verdicts.json, by
device, JAX and cuDNN versions and `PROBE_VERSION`), so a later run probes nothing, and a
later run's first step comes from the compile cache alone.

  cudnn  cuDNN's fused (flash) attention, on an NVIDIA GPU, for bf16/fp16 inputs whose head
         size is a multiple of 8 (at most 256), when a probe of that form (its own query and
         key lengths, a small batch of random inputs with padding and packed rows) compiled,
         ran and matched XLA's attention: relative difference under 2% in the output, and in
         dq, dk, dv for a call that is differentiated. The boolean mask goes in as an
         additive bias broadcast to [B or 1, 1, Q, K].
  xla    XLA's attention: everywhere else, and wherever the probe raised or disagreed.

A form's backward is probed only when a differentiated call of it is traced (a train step):
decoding, evaluation and a model's init never pay for it. A model's init chooses nothing
(`plain`: XLA's attention; its output is never read). On several hosts every verdict is
agreed (cuDNN only where every host's passed), so that every host compiles the same program.

No implementation is given a query with no allowed key (a padding position): such a row
may attend to every key instead (`open_empty_rows`). Nothing reads its output, and a fused
kernel never meets a softmax over nothing (cuDNN's backward returns NaN for such rows at
lengths of 64 mod 128 on H100s: its logsumexp of about -1e12 overflows the padded half of
the last key tile). A cuDNN call that raises while a program is traced gives way to XLA's
in that program. What a program gave cuDNN is recorded while it is traced (`recording`):
the training loop's net (steps.step_with_fallback) moves a form whose train step failed
(non-finite, or raised in its trace, compile or run) to XLA's attention (`move_to_xla`),
redoes the step, and stores the move only once the redo has shown cuDNN was the cause.

A call that is differentiated uses cuDNN only if the probe's backward passed too; its
plain forward (decoding, evaluation) may use cuDNN when only the forward passed
(e.g. cuDNN refuses the backward of an odd length with a bias). A refused or failed cuDNN
is never an error: the run goes on with XLA, and `verdicts()` says what was chosen and why.

SEQ2SEQ_ATTENTION=auto (default) | xla (never cuDNN) | cudnn (cuDNN without probing; its
errors surface: for checking it on a new machine).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import warnings
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
# Part of every stored verdict's key: a changed probe (its inputs, tolerance or what it
# runs) must raise it, so that verdicts of an older probe are probed again, not reused.
PROBE_VERSION = 2
ROLES = ("forward", "train")
AGREE_TIMEOUT_MS = 600_000   # how long a host waits for the others' verdict on a form

# signature -> {"forward": (ok, reason), "train": (ok, reason)}: the verdicts in use (agreed
# by every host). "train" is there once a differentiated call of the form was traced.
_VERDICTS: dict = {}
_RECORDINGS: list = []     # the recordings open (`recording`), innermost last
_PLAIN = [0]               # > 0: every call takes XLA's attention and chooses nothing
_WARNED: set = set()
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


def _form(key: tuple) -> dict:
  return dict(zip(("dtype", "heads", "head_dim", "q_len", "k_len", "mask_batch"), key))


def verdicts() -> list[dict]:
  """What this process chose for each form of attention it traced, and why (a form's
  "train" is not probed until a differentiated call of it is traced)."""
  unprobed = (None, "not probed: no differentiated call of this form was traced")
  return [dict(signature=_form(key),
               **{role: dict(zip(("ok", "reason"), v.get(role, unprobed))) for role in ROLES})
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


def lengths(forms) -> str:
  """"QxK, ..." of forms (signatures), each once, in order."""
  return ", ".join(dict.fromkeys(f"{key[3]}x{key[4]}" for key in forms))


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


def first_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


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
    return False, first_line(e)


def _agreed(key: tuple, role: str, verdict: tuple[bool, str]) -> tuple[bool, str]:
  """`verdict` if every host's passed too, else refused, saying where. Called while a
  program is traced (no collective can run there): the hosts exchange their verdicts
  through jax.distributed's key-value store, each under its own key, so a host that
  reaches a form first waits for the others to reach it."""
  if jax.process_count() == 1:
    return verdict
  from jax._src import distributed
  client = distributed.global_state.client
  name = f"seq2seq/attention/{PROBE_VERSION}/{role}/{_key_text(key)}/"
  client.key_value_set(name + str(jax.process_index()), json.dumps(verdict[0]),
                       allow_overwrite=True)
  ok = [json.loads(client.blocking_key_value_get(name + str(i), AGREE_TIMEOUT_MS))
        for i in range(jax.process_count())]
  if all(ok) or not verdict[0]:
    return verdict
  others = ", ".join(str(i) for i, passed in enumerate(ok) if not passed)
  return False, f"refused on process {others}"


def _choose(key: tuple, role: str, q, k, mask) -> str:
  """The implementation of `role` ("forward" or "train") for calls of form `key`: the
  agreed verdict of the stored or probed one (a differentiated call's only once its forward
  passed)."""
  v = _VERDICTS.setdefault(key, {})
  if role not in v:
    local = _stored().get(_key_text(key), {}).get(role)
    if local is None:
      if role == "train" and not v["forward"][0]:
        local = (False, "forward failed")
      else:
        local = _probe(q, k, mask, train=role == "train")
      _store(key, {role: local})
    v[role] = _agreed(key, role, tuple(local))
  return "cudnn" if v[role][0] else "xla"


def _choose_forward(q, k, mask) -> str:
  want = requested()
  if _PLAIN[0] or want == "xla" or (want == "auto" and unqualified(q, mask) is not None):
    return "xla"
  return "cudnn" if want == "cudnn" else _choose(_signature(q, k, mask), "forward", q, k, mask)


def choose(q_BxQxHxD, k_BxKxHxD, mask=None) -> tuple[str, str]:
  """(implementation of a plain forward call, implementation of a differentiated call)
  for inputs of this form, probing what is not known yet."""
  forward = _choose_forward(q_BxQxHxD, k_BxKxHxD, mask)
  if forward == "xla" or requested() == "cudnn":
    return forward, forward
  key = _signature(q_BxQxHxD, k_BxKxHxD, mask)
  return forward, _choose(key, "train", q_BxQxHxD, k_BxKxHxD, mask)


@contextlib.contextmanager
def plain():
  """Inside: every call takes XLA's attention and chooses (probes) nothing: for programs
  whose attention outputs nobody reads, such as a model's init."""
  _PLAIN[0] += 1
  try:
    yield
  finally:
    _PLAIN[0] -= 1


# --- what a program gave cuDNN, and moving forms to XLA ----------------------------------

@dataclasses.dataclass
class Recording:
  """What the programs traced inside `recording()` gave cuDNN (SEQ2SEQ_ATTENTION=auto):
  `uses`, the (form, role) pairs in the order first traced (the same on every host), and
  `failed`, those whose cuDNN call raised while traced (their call took XLA's): (form,
  role) -> the error's first line."""
  uses: list = dataclasses.field(default_factory=list)
  failed: dict = dataclasses.field(default_factory=dict)

  def use(self, key: tuple, role: str) -> None:
    if (key, role) not in self.uses:
      self.uses.append((key, role))

  def training(self) -> list[tuple]:
    """The forms whose differentiated calls took cuDNN."""
    return [key for key, role in self.uses if role == "train"]

  def in_programs(self) -> list[tuple]:
    """The (form, role) pairs whose cuDNN calls the programs hold: differentiated calls,
    and plain forward calls of forms never differentiated (a differentiated call's plain
    forward, traced inside a loop's body before its derivative was taken, is not run)."""
    training = set(self.training())
    return [(key, role) for key, role in self.uses if role == "train" or key not in training]


@contextlib.contextmanager
def recording():
  """Records what the programs traced inside give cuDNN (a `Recording`)."""
  r = Recording()
  _RECORDINGS.append(r)
  try:
    yield r
  finally:
    _RECORDINGS.remove(r)


def _use(key: tuple, role: str) -> None:
  for r in _RECORDINGS:
    r.use(key, role)


def _attempt(key: tuple, role: str, q, k, v, mask):
  """cuDNN's attention; XLA's if cuDNN raises while traced (SEQ2SEQ_ATTENTION=auto), the
  failure recorded (or, outside any recording, warned of once)."""
  if requested() != "auto":   # cudnn: its errors surface
    return _call("cudnn", q, k, v, mask)
  _use(key, role)
  try:
    return _call("cudnn", q, k, v, mask)
  except Exception as e:   # noqa: BLE001 - whatever cuDNN or its lowering raised
    for r in _RECORDINGS:
      r.failed.setdefault((key, role), first_line(e))
    if not _RECORDINGS and (key, role) not in _WARNED:
      _WARNED.add((key, role))
      warnings.warn(f"cuDNN's attention raised {first_line(e)} (query x key lengths "
                    f"{lengths([key])}, {role}): XLA's attention instead", stacklevel=2)
    return _call("xla", q, k, v, mask)


def move_to_xla(uses, reason: str) -> dict:
  """Every (form, role) of `uses` takes XLA's attention from the next trace on, in this
  process only (nothing is stored: `keep` stores, `undo` reverts). Returns what they were."""
  before = {}
  for key, role in uses:
    if key in _VERDICTS and role not in before.get(key, {}):
      before.setdefault(key, {})[role] = _VERDICTS[key].get(role)
      _VERDICTS[key] = dict(_VERDICTS[key], **{role: (False, reason)})
  return before


def keep(moved: dict) -> None:
  """Stores the moves `move_to_xla` returned (the redo showed cuDNN was the cause)."""
  for key, roles in moved.items():
    _store(key, {role: _VERDICTS[key][role] for role in roles})


def undo(moved: dict) -> None:
  """Reverts the moves `move_to_xla` returned (the redo showed cuDNN was not the cause)."""
  for key, roles in moved.items():
    for role, verdict in roles.items():
      if verdict is None:
        _VERDICTS[key].pop(role, None)
      else:
        _VERDICTS[key][role] = verdict


def agree_any(flags) -> np.ndarray:
  """`flags` (booleans, the same number on every host) OR-ed over the hosts."""
  flags = np.asarray(flags, bool)
  if jax.process_count() == 1:
    return flags
  from jax.experimental import multihost_utils
  every = np.asarray(multihost_utils.process_allgather(flags.astype(np.int32)))
  return every.reshape(-1, flags.size).any(0)


# --- verdicts kept beside the compile cache: a later run on this machine probes nothing -----

def _verdicts_file() -> Path | None:
  """attention_verdicts.json in the compile cache's directory (none without one)."""
  where = jax.config.jax_compilation_cache_dir
  return Path(where) / "attention_verdicts.json" if where else None


def _machine() -> str:
  """What a verdict holds for: the probe's version, the device, JAX's and cuDNN's versions."""
  try:
    from jax._src.lib import cuda_versions
    cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:   # noqa: BLE001 - no CUDA build
    cudnn = None
  import jaxlib
  return (f"probe {PROBE_VERSION}; {jax.devices()[0].device_kind}; jax {jax.__version__}, "
          f"jaxlib {jaxlib.__version__}, cuDNN {cudnn}")


def _key_text(key: tuple) -> str:
  return json.dumps(list(key))


def _stored() -> dict:
  """This machine's stored verdicts, by form ({} when there are none or they are unreadable)."""
  path = _verdicts_file()
  try:
    return json.loads(path.read_text()).get(_machine(), {}) if path else {}
  except (OSError, ValueError, AttributeError):
    return {}


def _store(key: tuple, roles: dict) -> None:
  """Writes `roles`' verdicts ({role: (ok, reason)}) of form `key` for this machine
  (atomically; a cache that cannot be written is no error)."""
  path = _verdicts_file()
  if path is None:
    return
  try:
    every = json.loads(path.read_text()) if path.exists() else {}
    every.setdefault(_machine(), {}).setdefault(_key_text(key), {}).update(roles)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{jax.process_index()}.tmp")
    tmp.write_text(json.dumps(every, indent=1))
    os.replace(tmp, path)
  except (OSError, ValueError, AttributeError):
    pass


# --- the call ------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _on_cudnn(key: tuple, q, k, v, mask):
  """cuDNN's forward; differentiated, the form's differentiated implementation, chosen (its
  backward probed) only here, when a differentiated call of the form is traced."""
  return _attempt(key, "forward", q, k, v, mask)


def _on_cudnn_fwd(key, q, k, v, mask):
  train = "cudnn" if requested() == "cudnn" else _choose(key, "train", q, k, mask)
  if train == "cudnn":
    return jax.vjp(lambda q, k, v: _attempt(key, "train", q, k, v, mask), q, k, v)
  return jax.vjp(lambda q, k, v: _call("xla", q, k, v, mask), q, k, v)


def _on_cudnn_bwd(key, vjp, g):
  return (*vjp(g), None)


_on_cudnn.defvjp(_on_cudnn_fwd, _on_cudnn_bwd)


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
  if _choose_forward(q, k, mask) == "xla":
    y_BxQxHxD = _call("xla", q, k, v, mask)
  else:
    y_BxQxHxD = _on_cudnn(_signature(q, k, mask), q, k, v, mask)
  return y_BxQxHxD.swapaxes(1, 2)
