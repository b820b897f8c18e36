"""The project on one GPU: correctness, training and decoding speed, a real run, and an
out-of-memory run, each stage ending in a JSON file, in one command.

    bench/gpu/run.sh compile --deadline_s 450                       # first device call
    bench/gpu/run.sh correctness,train_speed --deadline_s 380 --pytest_k ...   # second
    bench/gpu/run.sh decode_speed,bible,oom --deadline_s 420        # a later session
    bench/gpu/run.sh all --dry_run          # every stage, tiny, on a CPU: catches typos

(A session has 15 device minutes: docs/performance.md, "GPU", says what the first run
took and what to run next. --skip STAGE/STEP,... leaves steps out; --pytest_k narrows the
correctness tests.)

Writes to --out (default $OUT, else bench/results/gpu):
  run.json      the machine (nvidia-smi, versions, JAX's devices), the wheels installed,
                every stage's status; rewritten after each step
  <stage>.json  one per stage: each step's exit code, time, the tail of its output and
                what was parsed from it, and the stage's summary; rewritten after each step
  log.txt       every step's output, in order
so that a run cut off by its time limit still leaves what finished. Nothing else goes
there (a device machine sends back 8 files at most); workdirs, data builds and the
benchmarks' own JSON go under --work (default /tmp/seq2seq-gpu).

Stages (see docs/performance.md, "GPU"):
  correctness   the kernel-equality, attention and decoding tests (tests/test_kernels.py
                with its slow cases: reference against accelerator, f32 and bf16, training
                and decoding), the checkpoint save/restore/resume tests of
                tests/test_train.py, all on the GPU (f32 matmuls at full precision:
                JAX_DEFAULT_MATMUL_PRECISION=highest, else TF32 would break the f32
                tolerances); then checks.py attention: cuDNN's fused attention
                (`__cudnn$fmha`) in the compiled train step and decode loops, or not
  compile       XLA's account of a cold compile of `small`'s bf16 train step (128 x 256;
                checks.py compile_profile: a host trace, its events summed: HLO passes,
                autotuning, LLVM, PTX, cuDNN), then that step four ways, a few steps each:
                with XLA's autotuning off (--xla_gpu_autotune_level=0), as it is with
                JAX's compile log (seconds tracing, lowering, in XLA), with
                SEQ2SEQ_ATTENTION=xla, and with cuBLAS for every matmul
                (--xla_gpu_enable_triton_gemm=false); last, cold compiles of three tiny
                programs (checks.py compile_probe: a cost per program?)
  train_speed   bench_train.py --workload gpu (bible_gpu at 128 x 64, base and big at 256
                tokens a row; bf16) on train.py's packed rows of the Bible corpus (a step
                with a non-finite loss fails it) and, where torch is installed,
                bench_peers_torch.py's nn.Transformer on the same GPU and the same batches
                (eager, then torch.compile for base)
  decode_speed  bench_decode.py --workload gpu (base, batch 128, greedy and beam 4, bf16)
                and, where transformers is installed, MarianMT generate (bf16 and fp16)
  bible         train.py --config bible_gpu on --bible_dir (the corpus of
                `python -m seq2seq.data.bible`), then decode.py beam 4 on its test split,
                a second run's first step (the compile cache), and the CPU's recipe
                (small_cpu, bf16) whose validation loss on a CPU is known (CPU_RECIPE)
  oom           a resume of that run with a batch too large for the GPU: exit code, last
                line of standard error (does it name the batch and the memory?), and
                whether every checkpoint still loads
Every step runs under its own time limit; --deadline_s bounds the whole command (a step
that cannot start with 20 s left is skipped, and a step's limit is cut to what is left).

--dry_run: the same steps on tiny models and few tokens (JAX_PLATFORMS=cpu is set), on
the first lines of each file of the corpus (DRY_LINES), the pytest selections only
collected, torch peers only where torch imports (else recorded as skipped), no
torch.compile (minutes on a CPU): tests/test_gpu_script.py runs it.

A stage's status (run.json, <stage>.json): failed where a step that ran failed (an exit
code other than its own, its time limit, output its parser could not read); partial where a
step was left out for the deadline or by --skip; skipped where none ran; else ok (with the
steps this machine cannot run, and why, in `skipped_steps`). The command exits 1 where a
stage failed, else 0.

Before the first import of the project, carried wheels (--wheels, default .whl: see
bench/gpu/fetch_wheels.sh) are installed with pip into --site (/tmp/site) for the
packages that do not import; the project itself runs from this tree (PYTHONPATH).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("correctness", "compile", "train_speed", "decode_speed", "bible", "oom")
# The packages the device image lacks (imported by the project, by module name).
NEEDED_MODULES = ("tensorflow_datasets", "array_record", "tensorboardX", "num2words")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
            "orbax-checkpoint", "numpy", "torch", "transformers", "tensorflow-datasets",
            "array-record", "protobuf", "sentencepiece", "sacrebleu")
MIN_STEP_S = 20.0
# `train.py --config small_cpu --config.model.dtype=bfloat16` on the Bible, on a CPU (AMD
# EPYC, docs/performance.md, "The realistic run"): its validation split at step 2,300.
CPU_RECIPE = dict(validation_loss=2.205, bleu_greedy=16.3)
TAIL_LINES = 40

# The goals of the first GPU run (docs/performance.md, "GPU").
GOALS = dict(train_big_tokens_per_s=250_000, train_base_tokens_per_s=500_000,
             train_vs_torch=1.3, decode_greedy_tokens_per_s=68_000,
             decode_beam4_tokens_per_s=40_000, decode_vs_marian=3.0, bible_bleu=25.0,
             bible_train_s=300.0, bible_first_step_s=30.0, bible_first_step_cached_s=10.0,
             oom_exit_code=2)

# Kernel equality, attention and decoding tests; the checkpoint tests.
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_attention.py", "tests/test_decoding.py"]
CHECKPOINT_TESTS = ["tests/test_train.py", "-k",
                    "complete_workdir or sigkill_then_resume or broken_latest_checkpoint "
                    "or average_checkpoints"]
# Tiny models for --dry_run (a few seconds of compiling each on a CPU), with a vocabulary
# that holds the Bible's characters (~90, beside 4 specials and 256 bytes).
DRY_MODEL = ["--config.model.d_model=32", "--config.model.num_heads=2",
             "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
             "--config.model.d_ff=64", "--config.data.vocab_size=512",
             "--config.data.max_src_len=32", "--config.data.max_tgt_len=32",
             "--config.train.seq_len=32", "--config.train.batch_size=4",
             "--config.train.warmup_steps=1", "--config.train.cooldown_steps=0",
             "--config.train.eval_every=1000", "--config.train.checkpoint_every=1",
             "--config.train.log_every=1", "--config.train.num_eval_examples=4",
             "--config.train.eval_batch_size=4"]
# The dry run's slice of the corpus: lines of each split.
DRY_LINES = dict(train=2000, validation=16, test=16)


# --- installing the carried wheels -------------------------------------------------------------

def _version(text: str) -> tuple:
  return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _wheel_meta(path: Path) -> tuple[str, list[str]]:
  """(distribution name, Requires-Dist lines) of a wheel file."""
  with zipfile.ZipFile(path) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode("utf-8", "replace").splitlines()
  name = next(l.split(":", 1)[1].strip() for l in lines if l.startswith("Name:"))
  return name, [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:")]


def _installed(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def wheels_to_install(wheels: list[Path], installed: Callable[[str], str | None]) -> tuple:
  """(wheels to install, why each other one is left out): a wheel whose distribution is
  installed already stays out, except protobuf, which goes in only where the installed
  one is older than the newest lower bound (`protobuf>=X`) the wheels going in ask for."""
  keep, left, protobuf, need = [], {}, None, ()
  for w in sorted(wheels):
    name, requires = _wheel_meta(w)
    norm = name.lower().replace("_", "-")
    if norm == "protobuf":
      protobuf = w
      continue
    have = installed(norm)
    if have is not None:
      left[w.name] = f"{norm} {have} is installed"
      continue
    keep.append(w)
    for r in requires:
      m = re.match(r"protobuf\s*([^;]*)", r)
      if m and ";" in r and "extra ==" in r:
        continue
      if m:
        for bound in re.findall(r">=\s*([\d.]+)", m.group(1)):
          need = max(need, _version(bound))
  if protobuf is not None:
    have = installed("protobuf")
    if have is None or (need and _version(have) < need):
      keep.append(protobuf)
    else:
      left[protobuf.name] = (f"protobuf {have} is installed (the wheels need >= "
                             f"{'.'.join(map(str, need)) or 'any'})")
  return keep, left


def install_wheels(wheel_dir: Path, site: Path, log) -> dict:
  """Installs the carried wheels the machine needs into `site`; what it did."""
  missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
  if not missing:
    return dict(done=False, reason="every needed package imports already")
  wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
  if not wheels:
    return dict(done=False, reason=f"{', '.join(missing)} missing and no wheels in {wheel_dir}")
  keep, left = wheels_to_install(wheels, _installed)
  cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
         *map(str, keep)]
  p = subprocess.run(cmd, capture_output=True, text=True)
  log(f"$ {' '.join(cmd[:12])} ... ({len(keep)} wheels)\n{p.stdout}{p.stderr}")
  return dict(done=p.returncode == 0, returncode=p.returncode, missing=missing,
              installed=[w.name for w in keep], left_out=left, site=str(site))


# --- running steps -------------------------------------------------------------------------------

@dataclasses.dataclass
class Step:
  name: str
  argv: list[str]
  timeout: float
  env: dict = dataclasses.field(default_factory=dict)   # XLA_FLAGS: added to the run's
  parse: Callable[[str, int], dict] | None = None   # (output, returncode) -> fields
  stdout_to: Path | None = None                     # stdout to this file, not the log
  skip: str = ""                                    # why it is not run ("" = run it)
  ok_codes: tuple = (0,)                            # the exit codes of a step that worked


def result_lines(text: str) -> list[dict]:
  """The JSON of every `RESULT {...}` line of a step's output."""
  return [json.loads(l[len("RESULT "):]) for l in text.splitlines() if l.startswith("RESULT ")]


def last_result(text: str, returncode: int) -> dict:
  """A step's parsed fields: its last `RESULT {...}` line (None if it printed none)."""
  return dict(result=(result_lines(text) or [None])[-1])


class Runner:
  """Runs steps under a deadline, logging to log.txt and writing JSON as each ends."""

  def __init__(self, out: Path, work: Path, deadline_s: float, env: dict, dry_run: bool):
    self.out, self.work, self.env, self.dry_run = out, work, env, dry_run
    self.end = time.monotonic() + deadline_s
    self.log_path = out / "log.txt"
    self.run = dict(started=datetime.datetime.now().isoformat(timespec="seconds"),
                    dry_run=dry_run, deadline_s=deadline_s, stages={})
    self.proc = None   # the step running now

  def stop(self, signum, frame) -> None:
    """SIGTERM/SIGINT: the running step's process group goes too; run.json says so."""
    if self.proc is not None and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.run["stopped_by_signal"] = signum
    self.write("run.json", self.run)
    sys.exit(128 + signum)

  def log(self, text: str) -> None:
    with open(self.log_path, "a") as f:
      f.write(text if text.endswith("\n") else text + "\n")

  def say(self, text: str) -> None:
    print(text, flush=True)
    self.log(text)

  def write(self, name: str, data: dict) -> None:
    tmp = self.out / f".{name}.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, self.out / name)

  def left(self) -> float:
    return self.end - time.monotonic()

  def step(self, step: Step) -> dict:
    rec = dict(name=step.name, argv=step.argv, **({"env": step.env} if step.env else {}))
    if step.skip:
      self.say(f"--- {step.name}: skipped ({step.skip})")
      return dict(rec, skipped=step.skip)
    if self.left() < MIN_STEP_S:
      self.say(f"--- {step.name}: skipped (only {self.left():.0f} s left of the deadline)")
      return dict(rec, skipped="deadline")
    timeout = min(step.timeout, self.left() - 5.0)
    self.say(f"--- {step.name}: {' '.join(step.argv)}  (limit {timeout:.0f} s)")
    env = dict(self.env, **step.env)
    if "XLA_FLAGS" in step.env:
      env["XLA_FLAGS"] = f"{self.env.get('XLA_FLAGS', '')} {step.env['XLA_FLAGS']}".strip()
    t = time.monotonic()
    out_f = open(step.stdout_to, "w") if step.stdout_to else None
    # Its own process group (so that a time limit ends pytest's workers and train.py's
    # threads too), but not its own Unix session (no setsid): whatever ends this command's
    # processes ends it too.
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, text=True, preexec_fn=os.setpgrp,
                            stdout=out_f or subprocess.PIPE,
                            stderr=subprocess.STDOUT if out_f is None else subprocess.PIPE)
    self.proc = proc
    lines, timed_out = [], False
    try:
      stream = proc.stdout if out_f is None else proc.stderr
      deadline = t + timeout
      for line in _lines_until(stream, deadline):
        lines.append(line)
        self.log(line)
      proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      timed_out = True
    finally:
      if proc.poll() is None:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)   # the step's own process group
        proc.wait()
      if out_f:
        out_f.close()
    text = "".join(lines)
    rec.update(returncode=proc.returncode, timed_out=timed_out,
               seconds=round(time.monotonic() - t, 1), tail=lines[-TAIL_LINES:])
    if step.parse is not None:
      try:
        rec.update(step.parse(text, proc.returncode))
      except Exception as e:   # noqa: BLE001 - a parser's failure is recorded, not fatal
        rec["parse_error"] = f"{type(e).__name__}: {e}"
    rec["ok"] = proc.returncode in step.ok_codes and not timed_out and "parse_error" not in rec
    self.say(f"--- {step.name}: exit {proc.returncode}{' (TIMED OUT)' if timed_out else ''} "
             f"in {rec['seconds']} s{'' if rec['ok'] else ': FAILED'}")
    return rec


def _lines_until(stream, deadline: float):
  """The lines of `stream` until it ends or the deadline passes (raises TimeoutExpired)."""
  import selectors
  sel = selectors.DefaultSelector()
  sel.register(stream, selectors.EVENT_READ)
  buf = ""
  fd = stream.fileno()
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      raise subprocess.TimeoutExpired("step", 0)
    if not sel.select(timeout=min(left, 1.0)):
      continue
    chunk = os.read(fd, 65536).decode("utf-8", "replace")
    if not chunk:
      if buf:
        yield buf + "\n"
      return
    buf += chunk
    *done, buf = buf.split("\n")
    for line in done:
      yield line + "\n"


# Why a step did not run that leaves its stage short of what was asked (any other reason is
# the builder's: what this machine or a dry run cannot do).
CUT = ("deadline", "--skip")


def stage_status(steps: list[dict], summary_failed: bool = False) -> str:
  """failed: a step that ran failed (an exit code it should not have, its time limit, output
  its parser could not read) or the summary could not be made; skipped: none ran; partial:
  a step was left out for the deadline or by --skip; else ok (steps the builder left out,
  with their reasons, included)."""
  ran = [s for s in steps if "returncode" in s]
  if summary_failed or not all(s["ok"] for s in ran):
    return "failed"
  if not ran:
    return "skipped"
  return "partial" if any(s.get("skipped") in CUT for s in steps) else "ok"


def run_stage(runner: Runner, stage: str, steps: list[Step], summarize) -> dict:
  """Runs a stage's steps, rewriting <stage>.json after each; returns its record."""
  rec = dict(stage=stage, dry_run=runner.dry_run, steps=[], summary={})
  t = time.monotonic()
  summary_failed = False
  for step in steps:
    rec["steps"].append(runner.step(step))
    try:
      rec["summary"], summary_failed = summarize(rec["steps"]), False
    except Exception as e:   # noqa: BLE001
      rec["summary"], summary_failed = dict(error=f"{type(e).__name__}: {e}"), True
    rec["seconds"] = round(time.monotonic() - t, 1)
    runner.write(f"{stage}.json", rec)
  rec["status"] = stage_status(rec["steps"], summary_failed)
  rec["failed_steps"] = [s["name"] for s in rec["steps"] if s.get("ok") is False]
  rec["skipped_steps"] = {s["name"]: s["skipped"] for s in rec["steps"] if "skipped" in s}
  runner.write(f"{stage}.json", rec)
  runner.run["stages"][stage] = dict(status=rec["status"], seconds=rec["seconds"],
                                     summary=rec["summary"],
                                     **({"failed_steps": rec["failed_steps"]}
                                        if rec["failed_steps"] else {}))
  runner.write("run.json", runner.run)
  return rec


def by_name(steps: list[dict]) -> dict:
  return {s["name"]: s for s in steps}


# --- the stages ----------------------------------------------------------------------------------

def _junit(path: Path) -> dict:
  """Counts and failures of a pytest --junitxml file."""
  import xml.etree.ElementTree as ET
  if not path.exists():
    return dict(junit="missing")
  cases, failed, skipped = 0, [], []
  for case in ET.parse(path).getroot().iter("testcase"):
    cases += 1
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    for child in case:
      if child.tag in ("failure", "error"):
        failed.append(dict(test=name, kind=child.tag,
                           message=(child.get("message") or "")[:400]))
      elif child.tag == "skipped":
        skipped.append(dict(test=name, message=(child.get("message") or "")[:200]))
  return dict(tests=cases, failed=failed, skipped=skipped,
              passed=cases - len(failed) - len(skipped))


def _collected(text: str, returncode: int) -> dict:
  """Tests a `pytest --collect-only -q` run lists."""
  ids = [l.strip() for l in text.splitlines() if "::" in l and not l.startswith(" ")]
  return dict(collected=len(ids))


def correctness(args, work: Path) -> tuple[list[Step], Callable]:
  py = sys.executable
  pytest_env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}
  steps = []
  for name, sel, workers in (("kernel_and_decoding_tests", KERNEL_TESTS, 12),
                             ("checkpoint_tests", CHECKPOINT_TESTS, 4)):
    junit = work / f"{name}.xml"
    junit.unlink(missing_ok=True)   # an earlier call's on the same machine
    if args.dry_run:   # collect only: the selection exists and imports
      argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *sel]
      parse = _collected
    else:
      argv = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
              "--dist", "load", f"--junitxml={junit}", *sel]
      parse = (lambda j: lambda text, rc: _junit(j))(junit)
    if args.pytest_k:   # a narrower selection (e.g. the tests that failed last time)
      if "-k" in argv:
        i = argv.index("-k") + 1
        argv = argv[:i] + [f"({argv[i]}) and ({args.pytest_k})"] + argv[i + 1:]
      else:
        argv = argv + ["-k", args.pytest_k]
    steps.append(Step(name, argv, 240 if name.startswith("kernel") else 200, pytest_env,
                      parse))
  shape = (["--preset", "tiny", "--workload", "dry", "--batch", "2", "--length", "16",
            "--strategies", "greedy"]
           if args.dry_run else ["--preset", "base", "--batch", "16", "--length", "64"])
  steps.append(Step("attention_in_compiled_hlo", [py, "bench/gpu/checks.py", "attention",
                                                  *shape], 150,
                    parse=last_result))

  def summarize(done):
    s = by_name(done)
    out = {}
    for name in ("kernel_and_decoding_tests", "checkpoint_tests"):
      if name in s:
        r = s[name]
        out[name] = {k: r.get(k) for k in ("returncode", "tests", "passed", "collected")
                     if k in r}
        out[name]["failed"] = [f["test"] for f in r.get("failed", [])]
        out[name]["skipped"] = len(r.get("skipped", []))
    a = (s.get("attention_in_compiled_hlo") or {}).get("result")
    if a:
      out["cudnn_in_train_step"] = a["cudnn_in_train_step"]
      out["cudnn_in_decode"] = a["cudnn_in_decode"]
      out["fmha_calls"] = {k: a[k]["fmha"] for k in ("train_step", "decode_greedy",
                                                     "decode_beam4") if k in a}
      out["attention_verdicts"] = a["verdicts"]
    return out
  return steps, summarize


def _batches_from(args, work: Path) -> list[str]:
  """The speed benchmarks' flags for their batches: train.py's packed rows of the Bible
  corpus (bible_data), kept in work/bench_data for every step."""
  return ["--corpus", str(bible_data(args, work)), "--data_dir", str(work / "bench_data")]


def _torch_skip(need_transformers: bool = False) -> str:
  """Why the torch peer cannot run here ("" if it can)."""
  for m in ("torch",) + (("transformers",) if need_transformers else ()):
    if importlib.util.find_spec(m) is None:
      return f"{m} is not installed"
  return ""


def train_speed(args, work: Path) -> tuple[list[Step], Callable]:
  py = sys.executable
  steps = []
  if args.dry_run:
    presets, jax_kw = ["tiny"], ["--workload", "dry", "--steps", "1", "--warmup", "0",
                                 "--peak_n", "128"]
    torch_kw = ["--device", "cpu", "--workload", "dry", "--steps", "1", "--threads", "1",
                "--peak_n", "128"]
  else:
    presets, jax_kw = ["bible_gpu", "base", "big"], ["--workload", "gpu", "--steps", "6",
                                                     "--warmup", "2", "--peak_n", "8192"]
    torch_kw = ["--device", "cuda", "--workload", "gpu", "--steps", "6", "--peak_n", "8192"]
  data = _batches_from(args, work)
  skip = _torch_skip()
  for preset in presets:
    steps.append(Step(f"jax_{preset}", [py, "bench/bench_train.py", "--presets", preset,
                                        "--dtypes", "bfloat16", *jax_kw, *data,
                                        "--out", str(work / f"train_jax_{preset}.json")],
                      300 if preset == "big" else 240,   # the first run compiled small in 113 s
                      parse=(lambda p: lambda t, rc: _json_rows(p))(
                          work / f"train_jax_{preset}.json")))
    steps.append(Step(f"torch_{preset}", [py, "bench/bench_peers_torch.py", "--presets",
                                          preset, "--modes", "train", "--dtypes", "bfloat16",
                                          *torch_kw, *data, "--out",
                                          str(work / f"train_torch_{preset}.json")],
                      120, skip=skip,
                      parse=(lambda p: lambda t, rc: _json_rows(p))(
                          work / f"train_torch_{preset}.json")))
  compiled = presets[1] if len(presets) > 1 else presets[0]
  steps.append(Step(f"torch_compiled_{compiled}",
                    [py, "bench/bench_peers_torch.py", "--presets", compiled, "--modes",
                     "train_compiled", "--dtypes", "bfloat16", *torch_kw, *data, "--out",
                     str(work / "train_torch_compiled.json")], 240,
                    skip=skip or ("torch.compile takes minutes on a CPU" if args.dry_run
                                  else ""),
                    parse=lambda t, rc: _json_rows(work / "train_torch_compiled.json")))

  def summarize(done):
    rows = {}
    for s in done:
      for r in s.get("rows", []):
        if not r.get("failed"):
          rows[(r["preset"], r.get("mode", "jax"))] = r
    out = {}
    for (preset, mode), r in sorted(rows.items()):
      d = r.get("data") or {}
      out[f"{preset}/{mode}"] = dict({k: r.get(k) for k in (
          "tokens_per_s", "step_s", "mfu", "mfu_datasheet", "matmul_peak_flops_per_s",
          "compile_s", "first_step_s", "device_peak_bytes", "target_tokens_per_s",
          "final_loss")}, **{k: d.get(k) for k in ("tgt_fill", "pairs_per_row")},
          batch=f"{r.get('batch')} x {r.get('length')}")
    for preset in presets:
      j, tr, tc = rows.get((preset, "jax")), rows.get((preset, "train")), \
          rows.get((preset, "train_compiled"))
      if j and (tr or tc):
        best = max(x["tokens_per_s"] for x in (tr, tc) if x)
        out[f"{preset}/jax_vs_best_torch"] = j["tokens_per_s"] / best
    return out
  return steps, summarize


COMPILE_LOG = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation "
                         r"of) (\S+).*? in ([\d.]+) sec")


def compile_log(text: str) -> dict:
  """JAX's compile log (JAX_LOG_COMPILES=1): seconds per phase, summed, and the slowest
  programs' XLA compilations."""
  phases, xla = {}, []
  for phase, name, secs in COMPILE_LOG.findall(text):
    key = {"tracing": "trace", "XLA compilation of": "xla"}.get(phase, "lower")
    phases[key] = round(phases.get(key, 0.0) + float(secs), 2)
    if key == "xla":
      xla.append((float(secs), name))
  return dict(phase_s=phases, slowest_xla=[dict(program=n, s=round(t, 2))
                                           for t, n in sorted(xla, reverse=True)[:5]])


def compile_time(args, work: Path) -> tuple[list[Step], Callable]:
  """Where the first train step's time goes on this machine: XLA's own account of a cold
  compile of `small`'s bf16 train step (a host trace: passes, autotuning, LLVM, PTX, cuDNN);
  then that step as it is (JAX's compile log: tracing, lowering, XLA), without XLA's
  autotuning, with XLA's attention instead of cuDNN's and with cuBLAS for every matmul, a
  few steps each (their speed too); last, cold compiles of tiny programs (a cost per
  program?)."""
  py = sys.executable
  preset, kw = (("tiny", ["--workload", "dry", "--steps", "1", "--warmup", "0", "--peak_n",
                          "128"]) if args.dry_run else
                ("small", ["--workload", "gpu", "--steps", "3", "--warmup", "1", "--peak_n",
                           "1024"]))
  shape = (["--workload", "dry", "--batch", "4", "--length", "8"] if args.dry_run else
           ["--workload", "gpu", "--batch", "128", "--length", "256"])
  steps = [Step("profile", [py, "bench/gpu/checks.py", "compile_profile", "--preset", preset,
                            *shape], 180,
                env={"XLA_FLAGS": "--xla_gpu_print_compilation_stats"},   # per-module passes
                parse=last_result)]
  variants = [("no_autotuning", {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}),
              ("as_is", {"JAX_LOG_COMPILES": "1"}),
              ("xla_attention", {"SEQ2SEQ_ATTENTION": "xla"}),
              ("cublas_only", {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"})]
  for name, env in variants:
    path = work / f"compile_{name}.json"
    steps.append(Step(name, [py, "bench/bench_train.py", "--presets", preset, "--dtypes",
                             "bfloat16", *kw, *_batches_from(args, work), "--out", str(path)],
                      150, env=env,
                      parse=(lambda p: lambda t, rc: dict(_json_rows(p), log=compile_log(t)))(
                          path)))
  # A cost per program, if any (XLA's per-phase log of PTX assembly in log.txt).
  steps.append(Step("tiny_programs", [py, "bench/gpu/checks.py", "compile_probe"], 60,
                    env={"TF_CPP_MIN_LOG_LEVEL": "0",
                         "TF_CPP_VMODULE": "gpu_compiler=1,nvptx_compiler=2"},
                    parse=last_result))

  def summarize(done):
    out = {}
    for s in done:
      if s["name"] == "tiny_programs" and s.get("result"):
        out["tiny_programs_compile_s"] = s["result"]["compile_s"]
      if s["name"] == "profile" and s.get("result"):
        r = s["result"]
        prof = r.get("profile") if isinstance(r.get("profile"), dict) else {}
        out["profile"] = dict({k: r.get(k) for k in ("trace_s", "lower_s", "compile_s")},
                              by_self=prof.get("by_self", [])[:12])
      rows = [r for r in s.get("rows", []) if not r.get("failed")]
      if rows:
        r = rows[0]
        out[s["name"]] = dict(compile_s=r.get("compile_s"), tokens_per_s=r.get("tokens_per_s"),
                              attention=[v.get("train", {}).get("ok") for v in
                                         (r.get("attention") or [])])
      if (s.get("log") or {}).get("phase_s"):
        out.setdefault(s["name"], {})["log"] = s["log"]
    return out
  return steps, summarize


def _json_rows(path: Path) -> dict:
  """The `results` rows (and `meta`) of a bench script's JSON."""
  if not path.exists():
    return dict(rows=[], json="missing")
  d = json.loads(path.read_text())
  return dict(rows=d.get("results", []), meta=d.get("meta", {}))


def decode_speed(args, work: Path) -> tuple[list[Step], Callable]:
  py = sys.executable
  if args.dry_run:
    jax_kw = ["--workload", "dry", "--models", "tiny", "--src_len", "8", "--new_tokens", "4",
              "--repeats", "1", "--peak_n", "128", "--bandwidth_mb", "8"]
    torch_kw = ["--device", "cpu", "--workload", "dry", "--presets", "tiny", "--steps", "1",
                "--threads", "1", "--peak_n", "128"]
  else:
    jax_kw = ["--workload", "gpu", "--models", "base", "--repeats", "3", "--peak_n", "8192"]
    torch_kw = ["--device", "cuda", "--workload", "gpu", "--presets", "base", "--steps", "3",
                "--peak_n", "8192"]
  steps = [
      Step("jax", [py, "bench/bench_decode.py", "--modes", "cached", "--strategies",
                   "greedy,beam4", "--dtype", "bfloat16", *jax_kw, "--out",
                   str(work / "decode_jax.json")], 200,
           parse=lambda t, rc: _json_rows(work / "decode_jax.json"))]
  for dtype in ("bfloat16", "float16"):   # one step each: a cut-off keeps the first
    path = work / f"decode_marian_{dtype}.json"
    steps.append(Step(f"marian_{dtype}", [py, "bench/bench_peers_torch.py", "--modes",
                                          "decode_cached", "--dtypes", dtype, "--strategies",
                                          "greedy,beam4", *torch_kw, "--out", str(path)], 150,
                      skip=_torch_skip(need_transformers=True),
                      parse=(lambda p: lambda t, rc: _json_rows(p))(path)))
  # The same loops with XLA's attention only: what cuDNN's (where it was chosen) brings.
  steps.append(Step("jax_xla_attention", [*steps[0].argv[:-1], str(work / "decode_xla.json")],
                    200, env={"SEQ2SEQ_ATTENTION": "xla"},
                    skip="the jax step's command again" if args.dry_run else "",
                    parse=lambda t, rc: _json_rows(work / "decode_xla.json")))

  def summarize(done):
    s = by_name(done)
    out = {}
    jax_rows = [(name, r) for name in ("jax", "jax_xla_attention")
                for r in (s.get(name) or {}).get("rows", [])]
    for name, r in jax_rows:
      c = r.get("cached") or {}
      out[f"{name}/{r['strategy']}"] = dict(tokens_per_s=c.get("tokens_per_s"),
                                            compile_s=c.get("compile_s"), run_s=c.get("run_s"),
                                            target=r.get("target_tokens_per_s"),
                                            limit=(c.get("roofline") or {}).get(
                                                "limit_tokens_per_s"))
    jax_meta = (s.get("jax") or {}).get("meta") or {}
    out["attention"] = jax_meta.get("attention")
    for r in [r for k, v in s.items() if k.startswith("marian_") for r in v.get("rows", [])]:
      if not r.get("failed"):
        out[f"marian/{r['strategy']}/{r['dtype']}"] = dict(
            tokens_per_s=r["tokens_per_s"], first_call_s=r["first_call_s"])
    for strategy in ("greedy", "beam4"):
      j = (out.get(f"jax/{strategy}") or {}).get("tokens_per_s")
      m = [v["tokens_per_s"] for k, v in out.items() if k.startswith(f"marian/{strategy}/")]
      if j and m:
        out[f"{strategy}/jax_vs_best_marian"] = j / max(m)
    return out
  return steps, summarize


def bible_data(args, work: Path) -> Path:
  """The corpus of the Bible stages and of the speed stages' batches: --bible_dir, or in a
  dry run the first DRY_LINES lines of each of its files (work/bible_dry: its real text,
  its characters and lengths, read in seconds)."""
  data = Path(args.bible_dir)
  if not args.dry_run or _no_corpus(args):
    return data
  out = work / "bible_dry"
  out.mkdir(parents=True, exist_ok=True)
  for split, n in DRY_LINES.items():
    for lang in ("en", "fr"):
      with open(ROOT / data / f"{split}.{lang}", encoding="utf-8") as f:
        head = "".join(itertools.islice(f, n))
      path = out / f"{split}.{lang}"
      if not path.exists() or path.read_text(encoding="utf-8") != head:   # same file, kept
        path.write_text(head, encoding="utf-8")
  return out


def _bible_train_argv(args, work: Path, extra=(), workdir: str = "bible",
                      config: str = "bible_gpu", test: bool = True) -> list[str]:
  data = bible_data(args, work)
  argv = [sys.executable, "train.py", "--workdir", str(work / workdir), "--config", config,
          "--train_files", str(data / "train"), "--validation_files", str(data / "validation"),
          *(["--test_files", str(data / "test")] if test else []), "--data_dir",
          str(work / "tfds"), "--no_progress"]
  if args.dry_run:
    argv += DRY_MODEL
    if not any(a == "--steps" for a in extra):
      argv += ["--steps", "2"]
  return argv + list(extra)


def _train_summary(text: str, rc: int) -> dict:
  """train.py's lines: its first step's seconds, what cuDNN's attention did (a step redone on
  XLA's attention), and its closing lines: step, seconds, validation and test metrics."""
  out = {}
  m = re.search(r"^first step in ([\d.]+) s", text, re.M)
  if m:
    out["first_step_s"] = float(m[1])
  redone = re.findall(r"^(?:step \d+|evaluation\S*|decoding\S*): (?:non-finite loss or "
                      r"gradient with )?cuDNN's attention.*$", text, re.M)
  if redone:
    out["redone_on_xla"] = redone
  m = re.search(r"trained to step (\d+) in (\d+) s", text)
  if m:
    out.update(step=int(m[1]), train_s=int(m[2]))
  for split in ("validation", "test"):
    m = re.search(rf"^{split}(?: \(at step \d+[^)]*\))?: loss ([\d.]+).*?BLEU ([\d.]+), chrF "
                  rf"([\d.]+)", text, re.M)
    if m:
      out[split] = dict(loss=float(m[1]), bleu_greedy=float(m[2]), chrf=float(m[3]))
  return out


def _metrics(workdir: Path) -> dict:
  """Median training tokens/s and the last train loss, from metrics.jsonl."""
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return {}
  rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
  train = [r for r in rows if r.get("split") == "train"]
  speeds = sorted(r["tokens_per_sec"] for r in train if "tokens_per_sec" in r)
  out = dict(train_rows=len(train))
  if speeds:
    out["median_tokens_per_s"] = speeds[len(speeds) // 2]
  if train:
    out["last_train_loss"] = train[-1].get("loss")
  return out


def _no_corpus(args) -> str:
  """Why the Bible stages cannot run ("" if the corpus is there)."""
  data = Path(args.bible_dir)
  missing = [f"{data}/{s}.{l}" for s in ("train", "validation", "test") for l in ("en", "fr")
             if not (ROOT / data / f"{s}.{l}").exists()]
  return f"no corpus: {missing[0]} (python -m seq2seq.data.bible {data})" if missing else ""


def bible(args, work: Path) -> tuple[list[Step], Callable]:
  data = bible_data(args, work)
  skip = _no_corpus(args)
  hyp = work / "bible_test.hyp.fr"
  if not skip:   # a new run each time (an earlier call's would only be evaluated again)
    shutil.rmtree(work / "bible", ignore_errors=True)
    shutil.rmtree(work / "bible_again", ignore_errors=True)
    shutil.rmtree(work / "bible_cpu_recipe", ignore_errors=True)
  steps = [
      # The CPU's own recipe first (~2 min): its validation loss on a CPU is known
      # (CPU_RECIPE), so a GPU that trains differently shows here.
      Step("cpu_recipe", _bible_train_argv(
          args, work, ["--config.model.dtype=bfloat16", "--config.train.eval_every=100000"],
          "bible_cpu_recipe", config="small_cpu", test=False), 240, skip=skip,
          parse=_train_summary),
      Step("train", _bible_train_argv(args, work), 420, skip=skip,   # 5 min + a cold compile
           parse=lambda t, rc: dict(_train_summary(t, rc), metrics=_metrics(work / "bible"))),
      Step("decode_test_beam4", [sys.executable, "decode.py", "--workdir", str(work / "bible"),
                                 "--input", str(data / "test.en"), "--reference",
                                 str(data / "test.fr"), "--beam_size", "4", "--no_progress"],
           150, skip=skip, stdout_to=hyp, parse=lambda t, rc: _bleu(t, hyp)),
      # The same shapes again in a new workdir: its first step from the compile cache.
      Step("train_again", _bible_train_argv(args, work, ["--steps", "2"], "bible_again"), 150,
           skip=skip, parse=_train_summary)]

  def summarize(done):
    s = by_name(done)
    tr, de = s.get("train") or {}, s.get("decode_test_beam4") or {}
    again = s.get("train_again") or {}
    out = {k: tr.get(k) for k in ("step", "train_s", "first_step_s", "redone_on_xla",
                                  "validation", "test") if k in tr}
    out.update((tr.get("metrics") or {}))
    out.update({k: de.get(k) for k in ("bleu", "chrf", "exact_match", "lines") if k in de})
    if "bleu" in out:
      out["meets_bleu_goal"] = out["bleu"] >= GOALS["bible_bleu"]
    if "first_step_s" in out:
      out["meets_first_step_goal"] = out["first_step_s"] <= GOALS["bible_first_step_s"]
    cpu = (s.get("cpu_recipe") or {}).get("validation")
    if cpu:
      out["cpu_recipe"] = dict(validation_loss=cpu["loss"], bleu_greedy=cpu["bleu_greedy"],
                               on_a_cpu=CPU_RECIPE)
    if "first_step_s" in again:
      out["first_step_cached_s"] = again["first_step_s"]
      out["meets_first_step_cached_goal"] = (again["first_step_s"]
                                             <= GOALS["bible_first_step_cached_s"])
    return out
  return steps, summarize


def _bleu(text: str, hyp: Path) -> dict:
  m = re.search(r"BLEU ([\d.]+), chrF ([\d.]+)(?:, exact match ([\d.]+))?", text)
  out = dict(lines=sum(1 for _ in open(hyp)) if hyp.exists() else 0)
  if m:
    out.update(bleu=float(m[1]), chrf=float(m[2]))
    if m[3]:
      out["exact_match"] = float(m[3])
  return out


def oom(args, work: Path) -> tuple[list[Step], Callable]:
  workdir = work / "bible"
  ckpt_dir = workdir / "checkpoints"
  have_run = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
  corpus = _no_corpus(args)
  steps = []
  if not have_run:   # the bible stage did not run here: a short run to resume
    steps.append(Step("first_run", _bible_train_argv(
        args, work, [] if args.dry_run else ["--steps", "20",
                                             "--config.train.checkpoint_every=10"]), 200,
        skip=corpus))
  check = [sys.executable, "bench/gpu/checks.py", "checkpoints", str(workdir)]
  parse_check = last_result
  steps.append(Step("checkpoints_before", check, 90, parse=parse_check, skip=corpus))
  # A batch no GPU holds: the base model at 8192 rows of 64 tokens needs hundreds of GB
  # of activations. The dry run keeps its tiny batch (a CPU must not run out; its programs
  # are then in the compile cache).
  batch = "4" if args.dry_run else "8192"
  latest = max([int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()], default=0) \
      if have_run else (2 if args.dry_run else 20)
  steps.append(Step("too_large_batch", _bible_train_argv(
      args, work, ["--steps", str(latest + (1 if args.dry_run else 10)),
                   f"--config.train.batch_size={batch}"]), 180, skip=corpus,
      parse=_last_lines, ok_codes=(0,) if args.dry_run else (0, 2)))   # 2: the goal's one line
  steps.append(Step("checkpoints_after", check, 90, parse=parse_check, skip=corpus))

  def summarize(done):
    s = by_name(done)
    run = s.get("too_large_batch") or {}
    before = ((s.get("checkpoints_before") or {}).get("result") or {})
    after = ((s.get("checkpoints_after") or {}).get("result") or {})
    out = dict(batch_size=int(batch), exit_code=run.get("returncode"),
               last_line=run.get("last_line"), traceback=run.get("traceback"),
               lines_of_stderr=run.get("lines"),
               names_batch_and_memory=names_batch_and_memory(run.get("last_line"), int(batch)))
    if before and after:
      b, a = before.get("checkpoints", {}), after.get("checkpoints", {})
      out["checkpoints_before"] = before.get("steps")
      out["checkpoints_after"] = after.get("steps")
      out["all_load_after"] = after.get("all_load")
      out["checkpoints_intact"] = bool(b) and all(
          a.get(k, {}).get("sha256") == v.get("sha256") for k, v in b.items())
    out["meets_goal"] = (out["exit_code"] == GOALS["oom_exit_code"] and not out["traceback"]
                         and out["names_batch_and_memory"]
                         and bool(out.get("checkpoints_intact")))
    return out
  return steps, summarize


def names_batch_and_memory(line: str | None, batch: int) -> bool:
  """Whether `line` is train.py's one line for a batch too large for the device
  (seq2seq.steps.raise_if_out_of_memory) naming `batch` rows and a size it could not get."""
  return re.match(rf"error: out of memory: .*\bbatch of {batch} × \d+ tokens .*could not "
                  rf"allocate [\d.]+ ?[KMGT]", line or "") is not None


def _last_lines(text: str, rc: int) -> dict:
  lines = [l for l in text.splitlines() if l.strip()]
  return dict(last_line=lines[-1] if lines else "", lines=len(lines),
              traceback="Traceback (most recent call last)" in text)


STAGE_BUILDERS = dict(correctness=correctness, compile=compile_time, train_speed=train_speed,
                      decode_speed=decode_speed, bible=bible, oom=oom)


# --- the machine ---------------------------------------------------------------------------------

ENV_SCRIPT = r"""
import importlib, json, sys
out = {"python": sys.version.split()[0], "imports": {}}
for m in %r:
  try:
    importlib.import_module(m)
    out["imports"][m] = "ok"
  except Exception as e:
    out["imports"][m] = f"{type(e).__name__}: {e}"
import jax
out.update(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
           device_kind=jax.devices()[0].device_kind)
try:
  from jax._src.lib import cuda_versions
  out["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
except Exception as e:
  out["cudnn"] = f"{type(e).__name__}: {e}"
try:
  out["memory_stats"] = {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                         if k in ("bytes_limit", "bytes_in_use")}
except Exception:
  pass
print("RESULT " + json.dumps(out), flush=True)
"""


def machine(runner: Runner, dry_run: bool) -> dict:
  out = dict(versions={n: _installed(n) for n in VERSIONS})
  smi = shutil.which("nvidia-smi")
  if smi:
    p = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.sm,"
                        "clocks.max.sm,temperature.gpu,power.draw,power.limit",
                        "--format=csv"], capture_output=True, text=True, timeout=30)
    out["nvidia_smi"] = p.stdout.strip() or p.stderr.strip()
    runner.say(out["nvidia_smi"])
  else:
    out["nvidia_smi"] = "absent"
  rec = runner.step(Step("jax_devices", [sys.executable, "-c",
                                         ENV_SCRIPT % (("seq2seq",) + NEEDED_MODULES,)], 120,
                         parse=last_result))
  out["jax"] = rec.get("result") or dict(returncode=rec.get("returncode"), tail=rec.get("tail"))
  runner.say("versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items() if v))
  return out


def parse(argv=None) -> tuple[argparse.Namespace, list[str], set[str]]:
  """(arguments, stages, STAGE/STEP names to skip); ValueError for an unknown stage or
  step, before anything runs."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("stages", help=f"comma-separated: {', '.join(STAGES)}, or all")
  ap.add_argument("--dry_run", action="store_true", help="tiny sizes on the CPU")
  ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench/results/gpu"))
  ap.add_argument("--work", default="/tmp/seq2seq-gpu")
  ap.add_argument("--deadline_s", type=float, default=3600.0,
                  help="the whole command's time; steps that cannot start are skipped")
  ap.add_argument("--bible_dir", default="data/bible")
  ap.add_argument("--wheels", default=str(ROOT / ".whl"))
  ap.add_argument("--site", default="/tmp/site")
  ap.add_argument("--pytest_k", default="",
                  help="correctness: only the tests pytest -k selects with this expression")
  ap.add_argument("--skip", default="",
                  help="comma-separated STAGE/STEP names not to run (e.g. "
                       "train_speed/torch_compiled_base,decode_speed/jax_xla_attention)")
  args = ap.parse_args(argv)
  stages = list(STAGES) if args.stages == "all" else args.stages.split(",")
  bad = [s for s in stages if s not in STAGES]
  if bad:
    raise ValueError(f"unknown stage {bad[0]!r}; choose from {', '.join(STAGES)} or all")
  skips = {s for s in args.skip.split(",") if s}
  if skips:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:   # the builders' paths, thrown away
      known = {f"{stage}/{step.name}" for stage in STAGES
               for step in STAGE_BUILDERS[stage](args, Path(tmp))[0]}
    unknown = sorted(skips - known)
    if unknown:
      raise ValueError(f"--skip: no step {unknown[0]!r}; the steps: {', '.join(sorted(known))}")
  return args, stages, skips


def main(argv=None) -> int:
  try:
    args, stages, skips = parse(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out, work = Path(args.out), Path(args.work)
  out.mkdir(parents=True, exist_ok=True)
  work.mkdir(parents=True, exist_ok=True)
  env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
             HF_HUB_OFFLINE="1", TFDS_DATA_DIR=str(work / "tfds"))
  if args.dry_run:   # XLA:CPU's quicker compiles: the dry run times nothing
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                 "--xla_llvm_disable_expensive_passes=true"]).strip()
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"   # a resume's programs: cached
  runner = Runner(out, work, args.deadline_s, env, args.dry_run)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, runner.stop)
  installed = install_wheels(Path(args.wheels), Path(args.site), runner.log)
  runner.say(f"wheels: {json.dumps(installed)}")
  paths = [str(ROOT)] + ([args.site] if installed.get("done") else [])
  if installed.get("done"):   # so that run.json's versions see them too
    sys.path.insert(0, args.site)
    importlib.invalidate_caches()
  env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
  runner.run.update(stages_asked=stages, wheels=installed, machine=machine(runner,
                                                                           args.dry_run))
  runner.write("run.json", runner.run)
  for stage in stages:
    runner.say(f"=== {stage}")
    steps, summarize = STAGE_BUILDERS[stage](args, work)
    for step in steps:
      if f"{stage}/{step.name}" in skips and not step.skip:
        step.skip = "--skip"
    rec = run_stage(runner, stage, steps, summarize)
    runner.say(f"=== {stage}: {rec['status']} in {rec['seconds']} s: "
               f"{json.dumps(rec['summary'], default=str)[:1500]}")
  runner.run["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
  runner.write("run.json", runner.run)
  runner.say("\n".join(f"{s}: {v['status']} ({v['seconds']} s)"
                       for s, v in runner.run["stages"].items()))
  return 1 if any(v["status"] == "failed" for v in runner.run["stages"].values()) else 0


if __name__ == "__main__":
  sys.exit(main())
