"""Compiled for hardware that is not here: every program a run uses, built by XLA for a named
GPU or TPU with no device present (as MaxText's train_compile.py does), so that a config that
cannot fit, or an attention that cuDNN is not handed, shows on a laptop and not on the cluster.

  python -m seq2seq.aot --target h100 --config bible_gpu
  python -m seq2seq.aot --target h200 --config base --devices 8 --config.train.fsdp=true \\
      --config.train.mesh_shape=fsdp=8
  python -m seq2seq.aot --target v5e --devices 4 --config bible_gpu

Programs: the train step, the evaluation step, and decoding (greedy and beam 4, at the
evaluation's batch, on one device as the training run's evaluation decodes). For each: the
seconds XLA took, the StableHLO ops, the peak memory XLA plans per device (arguments +
outputs - donated + temporaries + code) beside what JAX lets a program use, and cuDNN's
fused attention calls by form, as lowered and as kept in the optimized program.

What it needs: for a GPU, the CUDA plugin of the installed JAX and NVIDIA's cuDNN
(`pip install "jax-cuda13-plugin==<jax version>" "nvidia-cudnn-cu13==9.19.*"`); JAX needs
cuDNN's library to lower cuDNN's attention at all. The GPU is described by XLA's target
config of it (targets/*.txtpb, shipped here). For a TPU, the `libtpu` wheel that matches JAX
(`pip install "jax[tpu]==<jax version>"`): libtpu compiles for a TPU topology without one.

What it cannot show: numbers, whether cuDNN accepts a plan on the device (it builds its
graphs when a program first runs there), XLA's autotuning (skipped with no device: the
compile times here are not a GPU's), and what the attention's net (kernels/accelerator.py)
would move to XLA's attention on the device. The attention is chosen here, not probed:
--attention cudnn (what the net keeps when every probe passes; the default on a GPU) or xla.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

from seq2seq.errors import UserError

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
# A GPU: XLA's target config of it (a GpuTargetConfigProto as text, in targets/).
GPU_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
# A TPU: libtpu's topology for each number of chips (as MaxText names them), and the HBM
# of one chip (Google Cloud's TPU pages): a compile-only topology device reports none.
TPU_TARGETS = {
    "v5e": dict(memory=16 * 2 ** 30,
                topologies={1: ("v5e:1x1", (1, 1, 1)), 4: ("v5e:2x2", (2, 2, 1)),
                            8: ("v5e:2x4", (2, 2, 1))}),
    "v6e": dict(memory=32 * 2 ** 30,
                topologies={1: ("v6e:1x1", (1, 1, 1)), 4: ("v6e:2x2", (2, 2, 1)),
                            8: ("v6e:2x4", (2, 2, 1))}),
}
TARGETS = tuple(GPU_TARGETS) + tuple(TPU_TARGETS)
# The share of a GPU's memory a JAX program may use: JAX's allocator takes 75% of what is
# free when it starts (XLA_PYTHON_CLIENT_MEM_FRACTION changes it). On an H200 with 141 GB,
# 112.58e9 bytes (memory_stats' bytes_limit, XLA_PYTHON_CLIENT_PREALLOCATE=false): 74.4% of
# 151.4e9, the CUDA context holding the rest. A TPU program may use its whole HBM.
GPU_MEMORY_FRACTION = 0.75
PROGRAMS = ("train", "eval", "greedy", "beam")
DEVICE_ONLY_FLAGS = ("--xla_gpu_autotune_level", "--xla_gpu_deterministic_ops")
BEAM = dict(size=4, alpha=0.6)
FMHA = re.compile(r"__cudnn\$fmha\w*")


class AotError(UserError):
  """What stops an offline compile before XLA runs: a missing wheel, a bad target."""


@dataclasses.dataclass
class Target:
  """The devices of a named GPU or TPU, built with no device present."""
  name: str
  platform: str           # "cuda" or "tpu"
  devices: list
  memory: int             # bytes of one device
  fraction: float         # the share of it a program may use

  @property
  def usable(self) -> int:
    return int(self.memory * self.fraction)

  @property
  def kind(self) -> str:
    return self.devices[0].device_kind


def gpu_target_config(name: str) -> str:
  """The shipped GpuTargetConfigProto text of GPU `name` (h100, h200)."""
  return (TARGETS_DIR / GPU_TARGETS[name]).read_text()


def use_compile_only_backends() -> None:
  """JAX starts its CPU backend only: the CUDA plugin then registers (its topologies are
  what a GPU compile needs) without looking for a GPU, which, absent, it reports at every
  start; libtpu likewise. Before JAX starts any backend."""
  import jax
  from jax._src import xla_bridge
  if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
  # With no device, XLA:GPU takes default configs instead of autotuning; told not to
  # autotune (--xla_gpu_autotune_level=0) or to use deterministic ops only, the XLA of JAX
  # 0.12 finds none for its Triton matmuls ("CublasLtBackend cannot enumerate configs in
  # deviceless mode"): those flags are left out here.
  flags = os.environ.get("XLA_FLAGS", "").split()
  kept = [f for f in flags if not f.startswith(DEVICE_ONLY_FLAGS)]
  if kept != flags:
    print(f"XLA_FLAGS: {' '.join(sorted(set(flags) - set(kept)))} left out (they need a "
          f"device)", file=sys.stderr)
    os.environ["XLA_FLAGS"] = " ".join(kept)


def make_target(name: str, devices: int = 1, memory_fraction: float | None = None) -> Target:
  """`devices` compile-only devices of target `name` (h100, h200, v5e, v6e)."""
  from jax.experimental import topologies
  if name in GPU_TARGETS:
    text = gpu_target_config(name)
    try:
      topo = topologies.get_topology_desc(platform="cuda", target_config=text,
                                          topology=f"1x1x{devices}")
    except (NotImplementedError, RuntimeError) as e:
      raise AotError(f"no CUDA plugin to compile for {name} ({_first_line(e)}): pip install "
                     f"\"jax-cuda13-plugin=={_jax_version()}\" \"nvidia-cudnn-cu13==9.19.*\"")
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text)[1])
    fraction = GPU_MEMORY_FRACTION
    env = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if env:
      try:
        fraction = float(env)
      except ValueError:
        raise AotError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number, got {env!r}") from None
    return Target(name, "cuda", list(topo.devices), memory,
                  fraction if memory_fraction is None else memory_fraction)
  check_devices(name, devices)
  topology, per_host = TPU_TARGETS[name]["topologies"][devices]
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                        chip_config_name="default",
                                        chips_per_host_bounds=per_host, num_slices=1,
                                        wrap=(False, False, False))
  except RuntimeError as e:
    raise AotError(f"no libtpu to compile for {name} ({_first_line(e)}): pip install "
                   f"\"jax[tpu]=={_jax_version()}\"")
  return Target(name, "tpu", list(topo.devices), TPU_TARGETS[name]["memory"],
                1.0 if memory_fraction is None else memory_fraction)


def check_devices(name: str, devices: int) -> None:
  """Whether target `name` comes with `devices` devices (a GPU: any number; a TPU: its
  slices' chips)."""
  if devices < 1:
    raise AotError(f"--devices must be >= 1, got {devices}")
  chips = TPU_TARGETS.get(name, {}).get("topologies")
  if chips and devices not in chips:
    raise AotError(f"{name}: --devices must be one of {', '.join(map(str, chips))}, got "
                   f"{devices}")


def _jax_version() -> str:
  import jax
  return jax.__version__


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# --- what a program holds -----------------------------------------------------------------

def fmha_calls(stablehlo: str) -> list[dict]:
  """cuDNN's fused attention calls of a lowered program, in order: {"call": the custom
  call's name, "operands": their shapes and dtypes, "q", "k", "bias" (or None)}."""
  calls = []
  for line in stablehlo.splitlines():
    name = re.search(r"stablehlo\.custom_call @(__cudnn\$fmha\w*)\(", line)
    if not name:
      continue
    signature = line.rsplit(" : (", 1)[1].split(") ->")[0]
    operands = re.findall(r"tensor<([^>]*)>", signature)
    calls.append(dict(call=name[1], operands=operands, q=operands[0], k=operands[1],
                      bias=operands[3] if "Bias" in name[1] else None))
  return calls


def form(call: dict) -> str:
  """A call's form: query x key lengths, and the bias's batch (B: per row, 1: shared)."""
  q, k = (call[x].split("x") for x in ("q", "k"))
  bias = call["bias"].split("x")[0] if call["bias"] else None
  rows = q[0]
  return f"{q[1]}x{k[1]}" + ("" if bias is None else f" bias {'B' if bias == rows else bias}")


def stablehlo_ops(stablehlo: str) -> int:
  return len(re.findall(r"\bstablehlo\.[a-z_]+", stablehlo))


def peak_bytes(compiled) -> int:
  """The memory XLA plans for a program on one device: arguments + outputs - the outputs
  that reuse donated arguments + temporaries + generated code."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes + m.generated_code_size_in_bytes)


# --- the programs of a run --------------------------------------------------------------

def _abstract(tree, sharding):
  import jax
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _tokens(rows: int, length: int, sharding):
  import jax
  import jax.numpy as jnp
  return jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)


def per_device_bytes(abstract_tree) -> int:
  """The bytes each device holds of a tree of sharded ShapeDtypeStructs."""
  import jax
  total = 0
  for x in jax.tree_util.tree_leaves(abstract_tree):
    shard = x.sharding.shard_shape(x.shape)
    total += int(jax.numpy.dtype(x.dtype).itemsize * _prod(shard))
  return total


def _prod(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


def lowered_programs(cfg, devices, programs=PROGRAMS):
  """{name: (the lowered program, the bytes of the training state each device holds beside
  it)} of `cfg` on `devices`: the train step on a batch of train.batch_size rows x seq_len,
  the evaluation step on eval_batch_size rows of max_src_len / max_tgt_len tokens, greedy
  and beam-4 decoding of eval_batch_size sources on the first device."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from seq2seq import decoding, search
  from seq2seq import sharding as shd
  from seq2seq.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
  from seq2seq.steps import Trainer

  t, d = cfg.train, cfg.data
  mesh = shd.make_mesh(t.mesh_shape, devices)
  trainer = Trainer(cfg, mesh, bos_id=BOS_ID)
  state = trainer.abstract_state
  state_bytes = per_device_bytes(state)
  out = {}
  if "train" in programs:
    keys = ("src", "tgt") + (("src_segments", "tgt_segments", "src_positions",
                              "tgt_positions") if d.pack else ())
    batch = {k: _tokens(t.batch_size, t.seq_len, trainer.batch_sharding) for k in keys}
    out["train"] = (trainer.step.lower(state, batch), 0)
  eval_rows = -(-t.eval_batch_size // mesh.size) * mesh.size
  if "eval" in programs:
    batch = {"src": _tokens(eval_rows, d.max_src_len, trainer.batch_sharding),
             "tgt": _tokens(eval_rows, d.max_tgt_len, trainer.batch_sharding)}
    out["eval"] = (trainer.eval.lower(state.params, batch), state_bytes)
  one = NamedSharding(jax.sharding.Mesh(devices[:1], ("one",)), P())
  params = _abstract(jax.eval_shape(
      lambda p: decoding.decode_params(cfg.model, {"params": p}), state.params), one)
  src = _tokens(t.eval_batch_size, d.max_src_len, one)
  rng = _abstract(jax.eval_shape(lambda: jax.random.key(0)), one)
  # The training run's decoding holds a copy of the parameters beside its state.
  beside = state_bytes + per_device_bytes(_abstract(state.params, one))
  strategies = {"greedy": search.Greedy(), "beam": search.Beam(**BEAM)}
  for name in ("greedy", "beam"):
    if name in programs:
      lowered = decoding.decode_jit_for(cfg.model).lower(
          params, src, rng, cfg=cfg.model, strategy=strategies[name],
          max_len=min(d.max_src_len + decoding.EXTRA_LEN, cfg.model.max_len),
          per_row_limit=True, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID, min_len=0,
          full_recompute=False, return_logits=False)
      out[name] = (lowered, beside)
  return out


@dataclasses.dataclass
class Compiled:
  """One program compiled for a target: what the table says of it."""
  program: str
  devices: int
  seconds: float
  ops: int
  peak: int               # bytes XLA plans on each device
  beside: int             # bytes of the training state held beside it on each device
  usable: int             # bytes a program may use on one device
  lowered_fmha: list      # cuDNN's attention calls as lowered (fmha_calls)
  kept_fmha: int | None   # those in the optimized program (None: XLA gives no text)

  @property
  def total(self) -> int:
    return self.peak + self.beside

  @property
  def fits(self) -> bool:
    return self.total <= self.usable

  def to_dict(self) -> dict:
    return dict(dataclasses.asdict(self), total=self.total, fits=self.fits,
                forms=[form(c) for c in self.lowered_fmha])


def compile_programs(cfg, target: Target, programs=PROGRAMS, progress=None) -> list[Compiled]:
  """Lowers and compiles `programs` of `cfg` for `target`: a Compiled for each."""
  results = []
  t0 = time.perf_counter()
  with _said(f"lowering {', '.join(programs)} for {target.kind}"):
    lowered = lowered_programs(cfg, target.devices, programs)
  lower_s = (time.perf_counter() - t0) / max(len(lowered), 1)
  for name, (low, beside) in lowered.items():
    if progress:
      progress(f"compiling {name} for {target.kind} ...")
    text = low.as_text()
    t0 = time.perf_counter()
    with _said(f"compiling {name} for {target.kind}"):
      compiled = low.compile()
    seconds = time.perf_counter() - t0 + lower_s
    optimized = compiled.as_text()
    results.append(Compiled(
        program=name, devices=1 if name in ("greedy", "beam") else len(target.devices),
        seconds=seconds, ops=stablehlo_ops(text), peak=peak_bytes(compiled), beside=beside,
        usable=target.usable, lowered_fmha=fmha_calls(text),
        kept_fmha=None if optimized is None else len(FMHA.findall(
            "\n".join(re.findall(r'custom_call_target="([^"]+)"', optimized))))))
  return results


def cudnn_takes(cfg) -> str | None:
  """Why cuDNN's attention cannot take this model's calls at all (None: it may), as the
  attention's net decides it before any probe (kernels/accelerator.py, `unqualified`)."""
  from seq2seq.kernels import accelerator
  m = cfg.model
  if m.dtype not in ("bfloat16", "float16"):
    return f"dtype {m.dtype} (cuDNN takes bfloat16 and float16)"
  if m.head_dim % 8 or m.head_dim > accelerator.MAX_HEAD_DIM:
    return f"head size {m.head_dim} (cuDNN takes multiples of 8 up to {accelerator.MAX_HEAD_DIM})"
  return None


def default_attention(cfg, target: str) -> str:
  """cuDNN on a GPU wherever it may take the calls (what the net keeps when every probe
  passes); XLA's attention elsewhere."""
  return "cudnn" if target in GPU_TARGETS and cudnn_takes(cfg) is None else "xla"


@contextlib.contextmanager
def _said(what: str):
  """A lowering or compile that fails as one line (cuDNN's attention without cuDNN's
  library: how to get it)."""
  try:
    yield
  except Exception as e:   # noqa: BLE001 - whatever JAX or XLA raised
    line = _first_line(e)
    hint = ("; pip install \"nvidia-cudnn-cu13==9.19.*\" (or --attention xla)"
            if "cudnn" in line.lower() else "")
    raise AotError(f"{what} failed: {type(e).__name__}: {line}{hint}") from e


def run_config(cfg, attention: str):
  """`cfg` as a run on the target runs it: the accelerator kernels (what `auto` is on a GPU
  or TPU), the vocabulary the data's tokenizer is built to (data.vocab_size)."""
  model = cfg.model.replace(kernels="accelerator", vocab_size=cfg.data.vocab_size)
  os.environ["SEQ2SEQ_ATTENTION"] = attention
  return cfg.replace(model=model)


# --- the batch that fits --------------------------------------------------------------------

def state_bytes(cfg, devices) -> int:
  """The bytes of the training state each device holds."""
  from seq2seq import sharding as shd
  from seq2seq.steps import Trainer
  return per_device_bytes(Trainer(cfg, shd.make_mesh(cfg.train.mesh_shape, devices))
                          .abstract_state)


def train_peak(cfg, devices, batch_size: int) -> int:
  """The train step's planned peak per device at `batch_size` rows."""
  c = cfg.replace(train=cfg.train.replace(batch_size=batch_size))
  lowered, _ = lowered_programs(c, devices, ("train",))["train"]
  return peak_bytes(lowered.compile())


def fitting_batch(cfg, devices, usable: int, peak_at_batch: int, fixed: int) -> int | None:
  """A batch (a multiple of the devices and micro-batches, of 64 of them from 128 on) whose
  train step XLA plans within `usable` bytes per device: the peak at train.batch_size less
  the `fixed` bytes (the state, the same at any batch) grows about in proportion to the
  rows; the batch so estimated is compiled to check it, and stepped down until one fits.
  None: not even the smallest such batch fits."""
  t = cfg.train
  unit = len(devices) * t.grad_accum_steps
  per_row = max((peak_at_batch - fixed) / t.batch_size, 1.0)
  batch = _round_batch(min(int((usable - fixed) / per_row), t.batch_size - unit), unit)
  for _ in range(6):
    peak = train_peak(cfg, devices, batch)
    if peak <= usable:
      return batch
    if batch == unit:
      return None
    batch = _round_batch(int(batch * min(0.9, usable / peak)), unit)
  return None


def _round_batch(rows: int, unit: int) -> int:
  step = 64 * unit if rows >= 128 * unit else unit
  return max(unit, rows // step * step)


def memory_line(cfg, devices, usable: int, kind: str, peak: int | None = None) -> tuple[bool, str]:
  """(fits, one line): the train step's planned peak at train.batch_size beside the `usable`
  bytes of each `kind` device, and where it does not fit, a batch that does."""
  t = cfg.train
  if peak is None:
    peak = train_peak(cfg, devices, t.batch_size)
  what = (f"the train step on a batch of {t.batch_size} x {t.seq_len} tokens (vocabulary "
          f"{cfg.model.vocab_size:,}) needs {_gib(peak)} of the {_gib(usable)} a program may "
          f"use on each of {len(devices)} {kind}")
  if peak <= usable:
    return True, f"fits: {what}"
  fit = fitting_batch(cfg, devices, usable, peak, state_bytes(cfg, devices))
  advice = (f"a batch of {fit} rows fits (--config.train.batch_size={fit}, or raise "
            f"--config.train.grad_accum_steps to keep {t.batch_size})" if fit else
            "no batch fits: a smaller model or more devices (--config.train.fsdp)")
  return False, f"does not fit: {what}; {advice}"


def check_memory(cfg, target: str = "here", memory_fraction: float | None = None
                 ) -> tuple[bool, str]:
  """train.py --check_memory: (fits, one line) for the train step of `cfg` on the GPUs or
  TPUs here ("here": the memory JAX reports it may use) or compiled offline for `target`
  ("h100", or "h100:8" for 8 of them), at the vocabulary of data.vocab_size."""
  from seq2seq import sharding as shd
  if target == "here":
    import jax
    devices = jax.devices()
    if devices[0].platform == "cpu":
      raise UserError("--check_memory: no GPU or TPU here; name one to compile for offline: "
                      f"--check_memory h100 (or {', '.join(TARGETS[1:])}; h100:8 for 8)")
    usable = (devices[0].memory_stats() or {}).get("bytes_limit")
    if not usable:
      raise UserError(f"--check_memory: JAX reports no memory limit for "
                      f"{devices[0].device_kind}")
    cfg = cfg.replace(model=cfg.model.replace(vocab_size=cfg.data.vocab_size))
    kind = devices[0].device_kind
  else:
    name, _, count = target.partition(":")
    if name not in TARGETS or not (count == "" or count.isdigit() and int(count) > 0):
      raise UserError(f"--check_memory: unknown target {target!r}; choose one of "
                      f"{', '.join(TARGETS)} (h100:8 for 8 devices)")
    check_devices(name, int(count or 1))
    _check_batch(cfg, int(count or 1))
    use_compile_only_backends()
    t = make_target(name, int(count or 1), memory_fraction)
    cfg = run_config(cfg, default_attention(cfg, name))
    devices, usable, kind = t.devices, t.usable, t.kind
  shd.parse_mesh_shape(cfg.train.mesh_shape, len(devices))
  with _said(f"compiling the train step for {kind}"):
    return memory_line(cfg, devices, usable, kind)


def _check_batch(cfg, devices: int) -> None:
  from seq2seq import sharding as shd
  t = cfg.train
  shd.parse_mesh_shape(t.mesh_shape, devices)
  if t.batch_size % (devices * t.grad_accum_steps):
    raise UserError(f"batch_size {t.batch_size} must be divisible by the devices "
                        f"({devices}) times grad_accum_steps ({t.grad_accum_steps})")


def _gib(n: int) -> str:
  return f"{n / 2 ** 30:.2f} GiB"


# --- the table --------------------------------------------------------------------------

def table(rows: list[Compiled], target: Target, cfg_name: str) -> str:
  lines = [f"{cfg_name} on {target.kind} ({target.name}, {len(target.devices)} device(s); a "
           f"program may use {target.fraction:.0%} of {_gib(target.memory)} = "
           f"{_gib(target.usable)} of each)",
           "| program | devices | compile s | StableHLO ops | peak GiB (+ state beside) "
           "| fits | cuDNN attention calls (lowered; kept after optimization) |",
           "|---|---:|---:|---:|---:|---|---|"]
  for r in rows:
    beside = f" (+ {r.beside / 2 ** 30:.2f})" if r.beside else ""
    forms = {}
    for c in r.lowered_fmha:
      key = ("bwd " if "Backward" in c["call"] else "fwd ") + form(c)
      forms[key] = forms.get(key, 0) + 1
    calls = ", ".join(f"{n} {k}" for k, n in forms.items()) or "none"
    kept = "" if not r.lowered_fmha else (
        "; kept: not shown" if r.kept_fmha is None else f"; kept {r.kept_fmha}")
    lines.append(f"| {r.program} | {r.devices} | {r.seconds:.1f} | {r.ops:,} | "
                 f"{r.peak / 2 ** 30:.2f}{beside} | {'yes' if r.fits else 'NO'} | "
                 f"{calls}{kept} |")
  return "\n".join(lines)


def parse_args(argv):
  from seq2seq.config import EXPERIMENTS
  from seq2seq.errors import ArgumentParser
  p = ArgumentParser(description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="config overrides: --config.KEY=VALUE as train.py takes them")
  p.add_argument("--target", required=True, choices=TARGETS, help="the GPU or TPU to compile for")
  p.add_argument("--config", default="bible_gpu", help=f"one of {', '.join(EXPERIMENTS)} "
                 "(default: %(default)s)")
  p.add_argument("--devices", type=int, default=1, help="devices of the target (default 1)")
  p.add_argument("--programs", default=",".join(PROGRAMS),
                 help="which to compile, of " + ",".join(PROGRAMS) + " (default: all)")
  p.add_argument("--attention", default=None, choices=("cudnn", "xla"),
                 help="who computes attention (default: cudnn on a GPU where it takes the "
                      "model's dtype and head size, xla elsewhere)")
  p.add_argument("--memory_fraction", type=float, default=None,
                 help="the share of a device's memory a program may use (default: 0.75 on a "
                      "GPU, JAX's, or XLA_PYTHON_CLIENT_MEM_FRACTION; 1 on a TPU)")
  p.add_argument("--check_memory", action="store_true",
                 help="if the train step does not fit, also find a batch that does")
  p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
  return p.parse_with_overrides(argv)


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  programs = [p for p in args.programs.split(",") if p]
  try:
    bad = [p for p in programs if p not in PROGRAMS]
    if bad or not programs:
      raise UserError(f"--programs: expected some of {', '.join(PROGRAMS)}, got "
                      f"{args.programs!r}")
    check_devices(args.target, args.devices)
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
      raise UserError(f"--memory_fraction must be in (0, 1], got {args.memory_fraction}")
    if args.attention == "cudnn" and args.target not in GPU_TARGETS:
      raise UserError(f"--attention cudnn: cuDNN is NVIDIA's; {args.target} is a TPU")
    from seq2seq import config as config_lib
    if args.config not in config_lib.EXPERIMENTS:
      raise UserError(f"unknown config {args.config!r}; choose one of "
                      f"{', '.join(config_lib.EXPERIMENTS)}")
    cfg = config_lib.override(config_lib.get_experiment(args.config), overrides)
    if args.attention == "cudnn" and cudnn_takes(cfg):
      raise UserError(f"--attention cudnn: cuDNN cannot take this model's attention: "
                      f"{cudnn_takes(cfg)}")
    attention = args.attention or default_attention(cfg, args.target)
    cfg = run_config(cfg, attention)
    _check_batch(cfg, args.devices)
    use_compile_only_backends()
    target = make_target(args.target, args.devices, args.memory_fraction)
    say = lambda line: print(line, file=sys.stderr, flush=True)
    say(f"{args.config} for {target.kind} x {len(target.devices)}, attention {attention}, "
        f"no device present (XLA skips autotuning: compile times are not the device's)")
    rows = compile_programs(cfg, target, programs, progress=say)
    print(table(rows, target, args.config), flush=True)
    result = dict(config=args.config, overrides=overrides, target=args.target,
                  kind=target.kind, devices=len(target.devices), attention=attention,
                  memory=target.memory, fraction=target.fraction, usable=target.usable,
                  jax=_jax_version(), programs=[r.to_dict() for r in rows])
    train = next((r for r in rows if r.program == "train"), None)
    if args.check_memory and train is not None:
      with _said("compiling the train step at other batches"):
        fits, line = memory_line(cfg, target.devices, target.usable, target.kind, train.peak)
      print(line)
      result["memory_line"] = line
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
