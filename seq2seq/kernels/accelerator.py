"""Attention on GPU/TPU: `jax.nn.dot_product_attention`, with its implementation named.

Left to itself (`implementation=None`), jax.nn runs XLA's own attention, never cuDNN's. Here
the choice is made per form of call (dtype, heads, head size, query and key lengths, mask
form) and per role (a plain forward, or a differentiated call: forward and backward), once
per machine: the verdicts are kept beside the compile cache (attention_verdicts.json, by
device, JAX and cuDNN versions and `PROBE_VERSION`), so a later run probes nothing, and a
later run's first step comes from the compile cache alone.

  cudnn  cuDNN's fused (flash) attention, on an NVIDIA GPU of compute capability 8.0 or more
         (`cudnn_refusal`), for bf16/fp16 inputs whose head size is a multiple of 8 (at most
         256), when a probe of that form compiled, ran and matched XLA's attention. The
         probe runs at the form's own query and key lengths and at the batch of the call
         that met it first, on random inputs with packed examples, padding, an empty row,
         and rows whose logits are large (a spread of about ±90, and all near -200); its
         output and, for a call that is differentiated, dq, dk and dv must be finite, within
         2% relative L2 of XLA's over the tensor, and in every real row (a query or key of
         an example) no further from attention computed in float32 than twice XLA's own
         error plus 5% of the row's size. The boolean mask goes in as an additive bias
         broadcast to [B or 1, 1, Q, K].
  xla    XLA's attention: everywhere else, and wherever the probe raised or disagreed.

A probe that ran out of memory or timed out says nothing of cuDNN: that form takes XLA's
attention in this process, and nothing is stored. A form's backward is probed only when a
differentiated call of it is traced (a train step): decoding, evaluation and a model's init
never pay for it. A model's init chooses nothing (`plain`: XLA's attention; its output is
never read). On several hosts every verdict is agreed (cuDNN only where every host's
passed), so that every host compiles the same program.

No implementation is given a query with no allowed key (a padding position): such a row
may attend to every key instead (`open_empty_rows`). Nothing reads its output, and a fused
kernel never meets a softmax over nothing (cuDNN's backward returns NaN for such rows at
lengths of 64 mod 128 on H100s: its logsumexp of about -1e12 overflows the padded half of
the last key tile). A cuDNN call that raises while a program is traced gives way to XLA's
in that program. What a program gave cuDNN is recorded while it is traced (`recording`):
the net (seq2seq/net.py) moves a form that failed in a program to XLA's attention for every
role (`move_to_xla`: train step, evaluation and decoding alike, every program traced again)
and stores the move only where the evidence names cuDNN (`names_cudnn`, `failing_probes`).

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
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from seq2seq.attention import dot_product_attention
from seq2seq.errors import UserError

ENV = "SEQ2SEQ_ATTENTION"
CHOICES = ("auto", "xla", "cudnn")
MAX_HEAD_DIM = 256
MIN_COMPUTE_CAPABILITY = (8, 0)   # cuDNN's fused attention: Ampere and later
# Part of every stored verdict's key: a changed probe (its inputs, tolerances or what it
# runs: the section "the probe" below) must raise it, so that verdicts of an older probe
# are probed again, not reused. tests/test_attention_guard.py holds a hash of that section
# for each version.
PROBE_VERSION = 3
ROLES = ("forward", "train")
AGREE_TIMEOUT_MS = 600_000   # how long a host waits for the others' verdict on a form
# What the hosts tell each other after a program failed (`agree`): the same flags, in this
# order, from every host, whatever each saw.
AGREED = ("failed", "names_cudnn", "not_a_verdict", "non_finite")

# signature -> {"forward": (ok, reason), "train": (ok, reason)}: the verdicts in use (agreed
# by every host). "train" is there once a differentiated call of the form was traced.
_VERDICTS: dict = {}
_RECORDINGS: list = []     # the recordings open (`recording`), innermost last
_IN_USE: set = set()       # (form, role) pairs given to cuDNN in a program traced since
_GENERATION = [0]          # moves so far (`move_to_xla`): programs traced before are stale
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


# --- which devices may run cuDNN's attention at all ------------------------------------------

def cudnn_refusal(platform: str, platform_version: str, compute_capability) -> str | None:
  """Why a device with these attributes (JAX's: `device.platform`,
  `device.client.platform_version`, `device.compute_capability`) cannot run cuDNN's fused
  attention; None: it may (a probe decides). Nothing is probed on a refused device: a GPU
  below compute capability 8.0 (a T4 is 7.5) or a ROCm one would reach cuDNN's graph build,
  whose crash ends the process."""
  if platform != "gpu":
    return f"backend {platform}"
  if "cuda" not in (platform_version or "").lower():
    return f"a GPU without CUDA ({' '.join(str(platform_version).split())[:60]})"
  try:
    major, minor = (int(x) for x in str(compute_capability).split(".")[:2])
  except ValueError:
    return f"compute capability {compute_capability!r} unknown"
  if (major, minor) < MIN_COMPUTE_CAPABILITY:
    return (f"compute capability {major}.{minor} (cuDNN's fused attention needs "
            f"{'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} or more)")
  return None


def _device_attributes() -> tuple:
  """(platform, platform_version, compute_capability) of this process's first device."""
  device = jax.devices()[0]
  return (device.platform, device.client.platform_version,
          getattr(device, "compute_capability", None))


def unqualified(q_BxQxHxD, mask=None) -> str | None:
  """Why cuDNN cannot take these inputs at all (None: it may; a probe decides)."""
  refusal = cudnn_refusal(*_device_attributes())
  if refusal is not None:
    return refusal
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


def first_line(e: BaseException) -> str:
  """"Type: the error's first line" (with the last line of a Python traceback it holds)."""
  lines = [line for line in _said(e).strip().splitlines() if line.strip()] or [""]
  head, traceback = lines[0], "Traceback (most recent call last):"
  if head.endswith(traceback) and len(lines) > 1:
    head = f"{head[:-len(traceback)].rstrip(': ')}: {lines[-1].strip()}"
  return f"{type(e).__name__}: {head[:300]}"


def _said(e: BaseException) -> str:
  """An error's text without the frames of a Python traceback in it (their file and
  function names are the caller's, not what failed)."""
  return "\n".join(line for line in str(e)[:20_000].splitlines()
                   if not re.match(r'\s*File "', line))


def names_cudnn(e: BaseException) -> bool:
  """Whether an error's text names cuDNN or its fused attention (the evidence a move is
  stored on)."""
  return re.search(r"cudnn|fmha", _said(e), re.IGNORECASE) is not None


def not_a_verdict(e: BaseException) -> bool:
  """Whether an error says nothing of cuDNN: out of memory (another process may hold the
  device) or a timeout (another host may be late)."""
  return re.search(r"RESOURCE_EXHAUSTED|out of memory|DEADLINE_EXCEEDED|timed out",
                   _said(e), re.IGNORECASE) is not None


# --- the probe: tests/test_attention_guard.py holds a hash of this section for each
# PROBE_VERSION, so that a change here without a new version fails there -------------------

TOLERANCE = 0.02        # relative L2 difference cuDNN vs XLA over a tensor, bf16/fp16 inputs
ROW_TOLERANCE = 0.05    # a real row's error past twice XLA's, in parts of the row's size
WIDE_LOGITS = 30.0      # the logits' standard deviation in a third of the (row, head)s
SHIFTED_LOGITS = -200.0  # their mean in another third


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


def _probe_inputs(key: tuple, batch: int, seed: int = 0):
  """Random inputs of form `key` (a signature) on `batch` rows: q, k, v [B, L, H, D] in its
  dtype, its mask as `_probe_mask` makes them (shared by every row: causal) opened as every
  call's is, a cotangent g like q, and which queries [B, Q] and keys [B, K] are real (of an
  example). The (row, head)s take turns: logits about N(0, 1), logits of standard deviation
  WIDE_LOGITS, logits near SHIFTED_LOGITS (a direction added to q and taken from k)."""
  dtype, heads, d, q_len, k_len, mask_batch = key
  rng = np.random.default_rng(seed)
  q, g = (rng.normal(size=(batch, q_len, heads, d)) for _ in range(2))
  k, v = (rng.normal(size=(batch, k_len, heads, d)) for _ in range(2))
  turn = ((np.arange(batch)[:, None] * heads + np.arange(heads)) % 3)[:, None, :, None]
  wide = np.where(turn == 1, np.sqrt(WIDE_LOGITS), 1.0)
  u = rng.normal(size=(batch, 1, heads, d))
  u *= np.where(turn == 2, np.sqrt(-SHIFTED_LOGITS * np.sqrt(d)), 0.0) / np.linalg.norm(
      u, axis=-1, keepdims=True)
  q, k = q * wide + u, k * wide - u
  m = None
  if mask_batch == "1":     # shared by every row: the causal mask
    m = np.tri(q_len, k_len, k_len - q_len, dtype=bool)[None, None]
  elif mask_batch == "B":
    m = _probe_mask(batch, q_len, k_len, rng)
  real_q = np.ones((batch, q_len), bool) if m is None else np.broadcast_to(
      m.any(-1)[:, 0], (batch, q_len))
  real_k = np.ones((batch, k_len), bool) if m is None else np.broadcast_to(
      m.any(-2)[:, 0], (batch, k_len))
  mask = None if m is None else open_empty_rows(jnp.asarray(m))
  q, k, v, g = (jnp.asarray(x, dtype) for x in (q, k, v, g))
  return q, k, v, mask, g, real_q, real_k


def _relative_difference(a, b) -> float:
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _worst_row(got, want, exact, real_BxL) -> tuple[float, str]:
  """The real row (one head's D values at a real query or key) where cuDNN's error from
  attention in float32 most exceeds twice XLA's plus ROW_TOLERANCE of the row's size (its
  largest value, at least the tensor's RMS): (that excess, which row). Within: <= 0."""
  err_cudnn, err_xla = (np.abs(x - exact).max(-1) for x in (got, want))   # [B, L, H]
  size = np.maximum(np.abs(exact).max(-1), max(np.sqrt(np.mean(np.square(exact))), 1e-30))
  excess = np.where(real_BxL[:, :, None], (err_cudnn - 2 * err_xla) / size - ROW_TOLERANCE,
                    -np.inf)
  i = np.unravel_index(np.argmax(excess), excess.shape)
  return float(excess[i]), (f"row {i[0]}, position {i[1]}, head {i[2]}: "
                            f"{err_cudnn[i] / size[i]:.3g} of its size from float32, "
                            f"XLA's {err_xla[i] / size[i]:.3g}")


def _probe(key: tuple, batch: int, train: bool) -> tuple[bool, str, bool]:
  """(cuDNN ran and matched XLA, what was seen, whether that is a verdict on cuDNN: an
  out-of-memory or a timeout is not) for calls of form `key` on `batch` rows."""
  try:
    with jax.ensure_compile_time_eval():
      q, k, v, mask, g, real_q, real_k = _probe_inputs(key, batch)

      def run(implementation, dtype=None):
        q_, k_, v_, g_ = (x if dtype is None else x.astype(dtype) for x in (q, k, v, g))
        if not train:
          return (jax.jit(functools.partial(_call, implementation))(q_, k_, v_, mask),)
        f = lambda q, k, v, m, g: jax.vjp(
            lambda q, k, v: _call(implementation, q, k, v, m), q, k, v)[1](g)
        return jax.jit(f)(q_, k_, v_, mask, g_)

      got, want, exact = run("cudnn"), run("xla"), run("xla", jnp.float32)
      names, rows = (("dq", "dk", "dv"), (real_q, real_k, real_k)) if train else (
          ("out",), (real_q,))
      worst = 0.0
      for name, a, b, e, real in zip(names, got, want, exact, rows):
        a, b, e = (np.asarray(x, np.float64) for x in (a, b, e))
        if not np.isfinite(a).all():
          return False, f"cuDNN gave non-finite {name}", True
        worst = max(worst, _relative_difference(a, b))
        if worst > TOLERANCE:
          return False, f"cuDNN differs from XLA: {name} {worst:.3g} relative", True
        excess, where = _worst_row(a, b, e, real)
        if excess > 0:
          return False, f"cuDNN's {name} is off in {where}", True
      return True, f"matched XLA on {batch} rows ({worst:.2g} relative)", True
  except Exception as e:   # noqa: BLE001 - whatever cuDNN or its lowering raised
    return False, first_line(e), not not_a_verdict(e)


# --- choosing --------------------------------------------------------------------------------

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
  passed). A probe that is no verdict (out of memory, a timeout) holds in this process
  only."""
  v = _VERDICTS.setdefault(key, {})
  if role not in v:
    local = _stored().get(_key_text(key), {}).get(role)
    if local is None:
      if role == "train" and not v["forward"][0]:
        local = (False, "forward failed")
        _store(key, {role: local})
      else:
        *local, verdict = _probe(key, q.shape[0], train=role == "train")
        if verdict:
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


# --- what a program gave cuDNN, moving forms to XLA, the evidence ----------------------------

@dataclasses.dataclass
class Recording:
  """What the programs traced inside `recording()` gave cuDNN (SEQ2SEQ_ATTENTION=auto):
  `uses`, the (form, role) pairs in the order first traced (the same on every host);
  `rows`, each form's batch (its first call's); `failed`, those whose cuDNN call raised
  while traced (their call took XLA's): (form, role) -> the error's first line; and the
  `generation` of verdicts they were traced with."""
  uses: list = dataclasses.field(default_factory=list)
  rows: dict = dataclasses.field(default_factory=dict)
  failed: dict = dataclasses.field(default_factory=dict)
  generation: int = dataclasses.field(default_factory=lambda: _GENERATION[0])

  def use(self, key: tuple, role: str, rows: int) -> None:
    if (key, role) not in self.uses:
      self.uses.append((key, role))
    self.rows.setdefault(key, rows)

  def forms(self) -> list[tuple]:
    """Every form the programs gave cuDNN, once, in order."""
    return list(dict.fromkeys(key for key, _ in self.uses))

  def training(self) -> list[tuple]:
    """The forms whose differentiated calls took cuDNN."""
    return [key for key, role in self.uses if role == "train"]


@contextlib.contextmanager
def recording():
  """Records what the programs traced inside give cuDNN (a `Recording`)."""
  r = Recording()
  _RECORDINGS.append(r)
  try:
    yield r
  finally:
    _RECORDINGS.remove(r)


def _use(key: tuple, role: str, rows: int) -> None:
  _IN_USE.add((key, role))
  for r in _RECORDINGS:
    r.use(key, role, rows)


def generation() -> int:
  """How many moves this process made: a program traced before the last one is stale."""
  return _GENERATION[0]


def in_use(role: str | None = None) -> list[tuple]:
  """The forms this process's programs give cuDNN (for `role`, else any): those traced
  since the last move."""
  return list(dict.fromkeys(key for key, r in _IN_USE if role in (None, r)))


def _attempt(key: tuple, role: str, q, k, v, mask):
  """cuDNN's attention; XLA's if cuDNN raises while traced (SEQ2SEQ_ATTENTION=auto), the
  failure recorded (or, outside any recording, warned of once)."""
  if requested() != "auto":   # cudnn: its errors surface
    return _call("cudnn", q, k, v, mask)
  _use(key, role, q.shape[0])
  try:
    return _call("cudnn", q, k, v, mask)
  except Exception as e:   # noqa: BLE001 - whatever cuDNN or its lowering raised
    if not_a_verdict(e):   # (a timeout agreeing between hosts): the trace fails
      raise
    for r in _RECORDINGS:
      r.failed.setdefault((key, role), first_line(e))
    if not _RECORDINGS and (key, role) not in _WARNED:
      _WARNED.add((key, role))
      warnings.warn(f"cuDNN's attention raised {first_line(e)} (query x key lengths "
                    f"{lengths([key])}, {role}): XLA's attention instead", stacklevel=2)
    return _call("xla", q, k, v, mask)


def move_to_xla(forms, reason: str) -> dict:
  """Every role of each form takes XLA's attention in this process (nothing is stored:
  `keep` stores, `undo` reverts), in every program: JAX's caches are cleared, so the
  train step, the evaluation and decoding are traced again. Returns what they were."""
  before = {}
  for key in dict.fromkeys(forms):
    before[key] = dict(_VERDICTS.get(key, {}))
    _VERDICTS[key] = {role: (False, reason) for role in ROLES}
  _IN_USE.difference_update({(key, role) for key in before for role in ROLES})
  _GENERATION[0] += 1
  jax.clear_caches()
  return before


def keep(moved: dict, forms=None) -> None:
  """Stores the moves `move_to_xla` returned (of `forms` only, if given): the evidence
  names cuDNN."""
  for key in moved:
    if forms is None or key in forms:
      _store(key, _VERDICTS[key])


def undo(moved: dict) -> None:
  """Reverts the moves `move_to_xla` returned (cuDNN was not the cause)."""
  for key, verdicts in moved.items():
    if verdicts:
      _VERDICTS[key] = verdicts
    else:
      _VERDICTS.pop(key, None)


def failing_probes(traced: Recording, forms) -> list[tuple]:
  """The forms whose probe fails at the run's own form (its batch, each role it was traced
  in), probed again whatever is stored: the evidence for a failure whose error does not
  name cuDNN. An out-of-memory or a timeout fails no probe."""
  bad = []
  for key in forms:
    roles = [role for k, role in traced.uses if k == key]
    if any(not ok and verdict for ok, _, verdict in
           (_probe(key, traced.rows[key], train=role == "train") for role in roles)):
      bad.append(key)
  return bad


def agree(**flags: bool) -> dict:
  """`flags` (names from AGREED) OR-ed over the hosts. Every host sends the same vector,
  AGREED's flags in order, whatever it saw, so that no host waits in a gather of another
  size."""
  unknown = set(flags) - set(AGREED)
  if unknown:
    raise ValueError(f"not agreed on: {sorted(unknown)}")
  vector = np.array([bool(flags.get(name)) for name in AGREED], np.int32)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(vector))
    vector = every.reshape(-1, len(AGREED)).any(0)
  return {name: bool(x) for name, x in zip(AGREED, vector)}


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
