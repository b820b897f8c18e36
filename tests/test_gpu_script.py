"""bench/gpu/run.sh, the one command a GPU machine runs, dry-run on this CPU: every stage
on tiny models, so that the minutes on a GPU are never spent on a typo (slow: it trains,
decodes and benchmarks in subprocesses). Then the parts a dry run cannot reach: the real
commands' flags, the real pytest results (JUnit XML), train.py's and decode.py's closing
lines, which carried wheels get installed, the deadline, a step's time limit, a SIGTERM."""
import json
import math
import string
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import run as gpu_run  # noqa: E402

TEST_LINES = 8


# Real text's characters: more than a vocabulary of 300 pieces holds beside its 4 specials
# and 256 bytes (SentencePiece refuses such a vocabulary, as it did the Bible's).
CHARACTERS = (string.ascii_uppercase + string.digits + string.punctuation,
              "ÀÂÇÉÈÊËÎÏÔÙÛÜŒàâçéèêëîïôùûüœ«»’—")


def _corpus(d: Path) -> Path:
  """A tiny English-French corpus in the Bible corpus's layout ({split}.{en,fr}): number
  words, and one line of the characters of real text."""
  from num2words import num2words
  d.mkdir()
  for split, numbers in (("train", range(0, 200)), ("validation", range(200, 208)),
                         ("test", range(208, 208 + TEST_LINES))):
    en, fr = ([num2words(n, lang=lang) for n in numbers] for lang in ("en", "fr"))
    if split == "train":
      en[100], fr[100] = (f"{num2words(100, lang=lang)} {chars}"
                          for lang, chars in zip(("en", "fr"), CHARACTERS))
    (d / f"{split}.en").write_text("".join(line + "\n" for line in en))
    (d / f"{split}.fr").write_text("".join(line + "\n" for line in fr))
  return d


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  """`bench/gpu/run.sh all --dry_run` once: (process, $OUT, work directory)."""
  root = tmp_path_factory.mktemp("gpu_dry_run")
  out, work = root / "out", root / "work"
  env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
  p = subprocess.run([str(ROOT / "bench/gpu/run.sh"), "all", "--dry_run", "--out", str(out),
                      "--work", str(work), "--bible_dir", str(_corpus(root / "corpus")),
                      "--deadline_s", "400"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
  return p, out, work


def _stage(out: Path, name: str) -> dict:
  return json.loads((out / f"{name}.json").read_text())


def _step(stage: dict, name: str) -> dict:
  (step,) = [s for s in stage["steps"] if s["name"] == name]
  return step


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_every_stage_of_the_dry_run_succeeds(dry_run):
  """Every step that ran exited as it should (the command exits 1 otherwise: the fixture
  checks it); the steps left out are those a CPU cannot run (no torch here, torch.compile,
  the same command again), each with its reason; the Bible stages ran train.py on the
  corpus's own text, whose characters a too small vocabulary would refuse."""
  _, out, work = dry_run
  run = json.loads((out / "run.json").read_text())
  assert {s: v["status"] for s, v in run["stages"].items()} == dict.fromkeys(gpu_run.STAGES,
                                                                            "ok")
  for stage in gpu_run.STAGES:
    s = _stage(out, stage)
    assert s["status"] == "ok" and s["failed_steps"] == [], stage
    assert all(x["ok"] for x in s["steps"] if "returncode" in x), stage
    for name, why in s["skipped_steps"].items():
      assert why in ("torch is not installed", "transformers is not installed",
                     "torch.compile takes minutes on a CPU",
                     "the jax step's command again"), (stage, name, why)
  text = "".join((work / "bible_dry" / f"train.{lang}").read_text() for lang in ("en", "fr"))
  assert len(set(text) - {"\n"}) > 300 - 4 - 256


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_the_dry_run_leaves_what_a_device_machine_sends_back(dry_run):
  """At most 8 plain files, no folder: run.json, log.txt and one JSON per stage; run.json
  names the machine and every stage."""
  p, out, _ = dry_run
  names = sorted(f.name for f in out.iterdir())
  assert names == sorted(["run.json", "log.txt"] + [f"{s}.json" for s in gpu_run.STAGES])
  assert all(f.is_file() for f in out.iterdir()) and len(names) <= 8
  run = json.loads((out / "run.json").read_text())
  assert run["dry_run"] and run["stages_asked"] == list(gpu_run.STAGES)
  assert run["machine"]["versions"]["jax"] == jax.__version__
  assert run["machine"]["jax"]["backend"] == "cpu"
  assert set(run["machine"]["jax"]["imports"].values()) == {"ok"}
  assert run["wheels"] == dict(done=False, reason="every needed package imports already")
  assert set(run["stages"]) == set(gpu_run.STAGES) and "finished" in run
  log = (out / "log.txt").read_text()
  for stage in gpu_run.STAGES:
    for step in _stage(out, stage)["steps"]:
      if "returncode" in step:
        assert f"--- {step['name']}: exit {step['returncode']}" in log
  assert "oom: " in p.stdout.splitlines()[-1]   # the closing table is the output's end


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_the_dry_run_collects_the_real_test_selections_and_reads_the_compiled_hlo(dry_run):
  _, out, _ = dry_run
  c = _stage(out, "correctness")
  assert c["status"] == "ok"
  assert c["summary"]["kernel_and_decoding_tests"]["collected"] > 60
  assert c["summary"]["checkpoint_tests"]["collected"] == 4   # the -k names exist
  hlo = _step(c, "attention_in_compiled_hlo")["result"]
  assert hlo["backend"] == "cpu" and hlo["kernels"] == "auto"
  assert hlo["train_step"]["fmha"] == {} and hlo["decode_greedy"]["fmha"] == {}
  assert c["summary"]["cudnn_in_train_step"] is False and hlo["verdicts"] == []


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_the_dry_run_profiles_the_compile_and_tries_its_variants(dry_run):
  """compile: XLA's own events from a host trace of the train step's compile (on a CPU,
  XLA:CPU's), then the step under each variant's flags, in order."""
  _, out, _ = dry_run
  c = _stage(out, "compile")
  assert c["status"] == "ok"
  assert [s["name"] for s in c["steps"]] == ["profile", "no_autotuning", "as_is",
                                             "xla_attention", "cublas_only", "tiny_programs"]
  r = _step(c, "profile")["result"]
  assert r["backend"] == "cpu" and r["compile_s"] > 0
  names = {e["name"] for e in r["profile"]["by_total"]}
  assert any("CpuCompiler" in n for n in names), names   # XLA's events, not only JAX's
  assert all(e["s"] <= r["trace_s"] + r["lower_s"] + r["compile_s"] + 1
             for e in r["profile"]["by_total"] if e["count"] == 1)
  assert c["summary"]["profile"]["compile_s"] == r["compile_s"]
  assert _step(c, "no_autotuning")["env"]["XLA_FLAGS"].endswith("--xla_gpu_autotune_level=0")
  for name in ("no_autotuning", "as_is", "xla_attention", "cublas_only"):
    assert c["summary"][name]["tokens_per_s"] > 0, name
  assert c["summary"]["as_is"]["log"]["phase_s"]["xla"] > 0


def test_trace_events_are_summed_by_name_in_all_and_without_what_they_contain():
  """Against a count by hand: per thread, an event's own time is its duration less the
  events directly inside it; numbered instances (fusion.12) and program names fold."""
  import checks
  ev = lambda name, ts, dur, tid=1: dict(ph="X", name=name, ts=ts, dur=dur, pid=1, tid=tid)
  events = [ev("compile", 0, 100e6), ev("autotune (jit_step)", 10e6, 30e6),
            ev("fusion.3", 15e6, 5e6), ev("fusion.12", 50e6, 10e6), ev("compile", 200e6, 10e6),
            ev("autotune", 0, 30e6, tid=2), ev("fusion.7", 0, 30e6, tid=2),
            dict(ph="i", name="instant", ts=5e6, pid=1, tid=1)]
  t = checks.trace_totals(events)
  total = {e["name"]: (e["s"], e["count"]) for e in t["by_total"]}
  own = {e["name"]: e["s"] for e in t["by_self"]}
  assert total == {"compile": (110, 2), "autotune": (60, 2), "fusion": (45, 3)}
  assert own == {"compile": 110 - 30 - 10, "autotune": 25 + 0, "fusion": 45}
  assert [e["name"] for e in t["by_self"]] == ["compile", "fusion", "autotune"]


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_the_dry_run_measures_speed_and_records_missing_peers_as_skipped(dry_run):
  """Training speed on train.py's packed rows of the corpus (the dry run's slice of it),
  every step's loss finite; the compile stage's steps on the same batches."""
  _, out, work = dry_run
  t, d = _stage(out, "train_speed"), _stage(out, "decode_speed")
  (row,) = _step(t, "jax_tiny")["rows"]
  assert row["tokens_per_s"] > 0 and row["preset"] == "tiny" and row["workload"] == "dry"
  assert t["summary"]["tiny/jax"]["tokens_per_s"] == row["tokens_per_s"]
  data = row["data"]
  assert data["source"] == f"parallel_text {work / 'bible_dry'}" and data["pairs"] == 200
  assert data["pairs_per_row"] > 1 and data["rows_with_padding"] > 0 and "error" not in row
  assert row["target_tokens_per_step"] in data["target_tokens_per_batch"]
  assert all(map(math.isfinite, row["losses"])) and len(row["losses"]) == 2
  assert t["summary"]["tiny/jax"]["final_loss"] == row["final_loss"] == row["losses"][-1]
  (as_is,) = _step(_stage(out, "compile"), "as_is")["rows"]
  assert as_is["data"] == data
  jax_rows = _step(d, "jax")["rows"]
  assert [r["strategy"] for r in jax_rows] == ["greedy", "beam4"]
  assert all(r["cached"]["tokens_per_s"] > 0 for r in jax_rows)
  assert d["summary"]["attention"] == [] and d["summary"]["jax/beam4"]["tokens_per_s"] > 0
  xla = _step(d, "jax_xla_attention")
  assert xla["skipped"] and xla["argv"][:-1] == _step(d, "jax")["argv"][:-1]
  try:
    import torch  # noqa: F401
  except ImportError:
    assert _step(t, "torch_tiny")["skipped"] == "torch is not installed"
    assert _step(d, "marian_bfloat16")["skipped"].endswith("is not installed")
  else:
    (peer,) = _step(t, "torch_tiny")["rows"]
    assert peer["data"] == data and all(map(math.isfinite, peer["losses"]))
    assert peer["target_tokens_per_step"] in data["target_tokens_per_batch"]
  assert t["status"] == d["status"] == "ok"


@pytest.mark.slow   # the whole command: ~50 s of CPU time
def test_the_dry_run_trains_decodes_and_resumes_with_another_batch(dry_run):
  """bible: train.py --config bible_gpu (shrunk), its first step's time, decode.py beam 4
  with BLEU, and a second run's first step (from the compile cache); oom: the resume's exit
  code and last line, and every checkpoint loading alike before and after."""
  _, out, work = dry_run
  b = _stage(out, "bible")
  assert b["status"] == "ok" and b["summary"]["step"] == 2
  assert b["summary"]["first_step_s"] > 0 and b["summary"]["first_step_cached_s"] > 0
  assert "redone_on_xla" not in b["summary"]
  assert {"validation", "test"} <= set(b["summary"]) and b["summary"]["lines"] == TEST_LINES
  assert isinstance(b["summary"]["bleu"], float) and b["summary"]["meets_bleu_goal"] is False
  assert json.loads((work / "bible" / "config.json").read_text())["model"]["dtype"] == \
      "bfloat16"
  cpu = json.loads((work / "bible_cpu_recipe" / "config.json").read_text())
  assert cpu["model"]["dtype"] == "bfloat16" and cpu["model"]["ffn_dropout_rate"] == 0.1
  assert set(b["summary"]["cpu_recipe"]) == {"validation_loss", "bleu_greedy", "on_a_cpu"}
  o = _stage(out, "oom")["summary"]
  assert (o["exit_code"], o["traceback"]) == (0, False)
  assert o["last_line"].startswith("translate with: python decode.py")
  assert o["checkpoints_before"] == [1, 2] and o["checkpoints_after"] == [1, 2, 3]
  assert o["checkpoints_intact"] and o["all_load_after"]
  assert o["meets_goal"] is False          # exit 0 is not the one-line exit 2 asked for
  assert o["names_batch_and_memory"] is False


def test_the_oom_stage_knows_train_pys_line_for_a_batch_too_large():
  """What the oom stage looks for in the last line is what train.py says (on a GPU: XLA's
  "Out of memory while trying to allocate N bytes")."""
  from seq2seq.config import get_experiment, override
  from seq2seq.steps import OutOfMemory, raise_if_out_of_memory
  cfg = override(get_experiment("bible_gpu"), ["train.batch_size=8192"])
  said = []
  for message in ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 "
                  "bytes.", "RESOURCE_EXHAUSTED: out of something"):
    with pytest.raises(OutOfMemory) as e:
      raise_if_out_of_memory(jax.errors.JaxRuntimeError(message), cfg, devices=1)
    said.append(f"error: {e.value}")
  assert gpu_run.names_batch_and_memory(said[0], 8192)
  assert not gpu_run.names_batch_and_memory(said[0], 4096)
  assert not gpu_run.names_batch_and_memory(said[1], 8192)   # no size: not what was asked
  assert not gpu_run.names_batch_and_memory("translate with: python decode.py ...", 8192)
  assert not gpu_run.names_batch_and_memory(None, 8192)


# --- what the dry run cannot reach ------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_kernels" name="test_a"/>
<testcase classname="tests.test_kernels" name="test_b"><failure message="AssertionError: x">
</failure></testcase>
<testcase classname="tests.test_train" name="test_c"><skipped message="root"/></testcase>
<testcase classname="tests.test_train" name="test_d"><error message="fixture"/></testcase>
</testsuite></testsuites>"""


def test_pytest_results_and_the_closing_lines_are_parsed(tmp_path):
  (tmp_path / "j.xml").write_text(JUNIT)
  r = gpu_run._junit(tmp_path / "j.xml")
  assert (r["tests"], r["passed"]) == (4, 1)
  assert [f["test"] for f in r["failed"]] == ["tests.test_kernels::test_b",
                                             "tests.test_train::test_d"]
  assert r["failed"][0]["message"] == "AssertionError: x" and len(r["skipped"]) == 1
  assert gpu_run._junit(tmp_path / "none.xml") == dict(junit="missing")
  summary = gpu_run._train_summary(
      "trained to step 4000 in 212 s; workdir w\n"
      "validation: loss 2.101, perplexity 5.1, token accuracy 0.61, BLEU 24.5, chrF 50.1, "
      "exact match 0.0 on 303 examples\n"
      "test (at step 3000, the last evaluation): loss 2.2, perplexity 5.3, token accuracy "
      "0.6, BLEU 23.0, chrF 49.0, exact match 0.0 on 1007 examples\n", 0)
  assert summary == dict(step=4000, train_s=212,
                         validation=dict(loss=2.101, bleu_greedy=24.5, chrf=50.1),
                         test=dict(loss=2.2, bleu_greedy=23.0, chrf=49.0))
  moved = ["step 3: cuDNN's attention failed while the step ran (X; query x key lengths 64x64)",
           "evaluation: cuDNN's attention failed (Y; query x key lengths 64x64)",
           "decoding: cuDNN's attention failed (Z; query x key lengths 1x64)"]
  assert gpu_run._train_summary("\n".join(["first step in 9.5 s", *moved, "step 4: ok"]),
                                0) == dict(first_step_s=9.5, redone_on_xla=moved)
  hyp = tmp_path / "h"
  hyp.write_text("a\nb\n")
  assert gpu_run._bleu("BLEU 26.41, chrF 52.10, exact match 1.2% against f", hyp) == \
      dict(lines=2, bleu=26.41, chrf=52.1, exact_match=1.2)


def _wheel(d: Path, file: str, name: str, requires=()) -> Path:
  path = d / file
  with zipfile.ZipFile(path, "w") as z:
    z.writestr(f"{name}-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: "
               f"{name}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
  return path


def test_only_missing_packages_are_installed_and_protobuf_only_where_too_old(tmp_path):
  tfds = _wheel(tmp_path, "tensorflow_datasets-4.9.10-py3-none-any.whl",
                "tensorflow-datasets", ["protobuf>=3.20", "absl-py"])
  gcp = _wheel(tmp_path, "googleapis_common_protos-1.76.0-py3-none-any.whl",
               "googleapis-common-protos", ["protobuf<8.0.0,>=6.33.5"])
  extra = _wheel(tmp_path, "x-1.0-py3-none-any.whl", "x", ['protobuf>=9; extra == "dev"'])
  termcolor = _wheel(tmp_path, "termcolor-3.3.0-py3-none-any.whl", "termcolor")
  proto = _wheel(tmp_path, "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", "protobuf")
  wheels = [tfds, gcp, extra, termcolor, proto]
  have = {"termcolor": "2.4.0", "protobuf": "6.31.1"}
  keep, left = gpu_run.wheels_to_install(wheels, have.get)
  assert sorted(w.name for w in keep) == sorted([tfds.name, gcp.name, extra.name, proto.name])
  assert left == {termcolor.name: "termcolor 2.4.0 is installed"}
  have["protobuf"] = "6.33.5"
  keep, left = gpu_run.wheels_to_install(wheels, have.get)
  assert proto not in keep and "protobuf 6.33.5 is installed" in left[proto.name]


def test_a_step_past_its_limit_is_killed_and_what_it_printed_is_kept(tmp_path):
  runner = gpu_run.Runner(tmp_path, tmp_path, 60.0, {}, dry_run=True)
  t = time.monotonic()
  r = runner.step(gpu_run.Step("sleepy", [sys.executable, "-c",
                                          "import time; print('started', flush=True); "
                                          "time.sleep(60)"], timeout=1.5))
  assert r["timed_out"] and r["returncode"] != 0 and time.monotonic() - t < 10
  assert r["tail"] == ["started\n"]
  assert "--- sleepy: exit" in (tmp_path / "log.txt").read_text()


def test_sigterm_ends_the_running_step_and_says_so_in_run_json(tmp_path):
  import signal
  runner = gpu_run.Runner(tmp_path, tmp_path, 60.0, {}, dry_run=True)
  runner.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 preexec_fn=__import__("os").setpgrp)
  with pytest.raises(SystemExit) as e:
    runner.stop(signal.SIGTERM, None)
  assert e.value.code == 128 + signal.SIGTERM
  assert runner.proc.wait(timeout=10) == -signal.SIGKILL
  assert json.loads((tmp_path / "run.json").read_text())["stopped_by_signal"] == signal.SIGTERM


@pytest.mark.slow   # starts the GPU script
def test_a_failing_step_fails_its_stage_and_the_command(tmp_path, monkeypatch):
  """A step that exits with a code not its own, passes its time limit or prints what its
  parser cannot read fails its stage, which run.json names, and the command exits 1; a
  step left out for the deadline or by --skip leaves its stage partial; one the stage
  leaves out (what this machine cannot run) leaves it ok."""
  py = sys.executable
  def builder(*steps):
    return lambda args, work: (list(steps), lambda done: {"steps": len(done)})
  fine, two = gpu_run.Step("fine", [py, "-c", ""], 30), \
      gpu_run.Step("two", [py, "-c", "exit(2)"], 30, ok_codes=(0, 2))
  cases = {"ok": [fine, two, gpu_run.Step("peer", [py, "-c", "exit(1)"], 30, skip="no peer")],
           "exit": [fine, gpu_run.Step("exit", [py, "-c", "exit(2)"], 30)],
           "limit": [gpu_run.Step("slow", [py, "-c", "import time; time.sleep(30)"], 1)],
           "parse": [gpu_run.Step("parse", [py, "-c", "print('RESULT {')"], 30,
                                  parse=gpu_run.last_result)]}
  for name, steps in cases.items():
    monkeypatch.setitem(gpu_run.STAGE_BUILDERS, "compile", builder(*steps))
    out = tmp_path / name
    rc = gpu_run.main(["compile", "--dry_run", "--out", str(out), "--work", str(tmp_path)])
    run = json.loads((out / "run.json").read_text())["stages"]["compile"]
    if name == "ok":
      assert (rc, run["status"], run["summary"]) == (0, "ok", {"steps": 3})
      assert _stage(out, "compile")["skipped_steps"] == {"peer": "no peer"}
    else:
      assert (rc, run["status"], run["failed_steps"]) == (1, "failed", [steps[-1].name]), name
  assert "--- exit: exit 2 in" in (tmp_path / "exit" / "log.txt").read_text()
  monkeypatch.setitem(gpu_run.STAGE_BUILDERS, "compile", builder(fine, fine))
  assert gpu_run.main(["compile", "--dry_run", "--out", str(tmp_path / "cut"), "--work",
                       str(tmp_path), "--skip", "compile/fine"]) == 0
  assert _stage(tmp_path / "cut", "compile")["status"] == "skipped"
  done = [dict(name="a", returncode=0, ok=True), dict(name="b", skipped="deadline")]
  assert gpu_run.stage_status(done) == "partial"
  assert gpu_run.stage_status(done[:1], summary_failed=True) == "failed"


def test_no_time_left_skips_every_step_and_a_bad_stage_is_one_line(tmp_path, capsys):
  out = tmp_path / "out"
  assert gpu_run.main(["correctness,oom", "--dry_run", "--deadline_s", "5", "--out", str(out),
                       "--work", str(tmp_path / "w")]) == 0
  for stage in ("correctness", "oom"):
    s = _stage(out, stage)
    assert s["status"] == "skipped" and {x["skipped"] for x in s["steps"]} <= {
        "deadline", f"no corpus: data/bible/train.en (python -m seq2seq.data.bible "
                    f"data/bible)"}
  assert gpu_run.main(["correctness,speed", "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown stage 'speed'" in err


def test_skip_leaves_out_the_steps_named_and_pytest_k_narrows_the_tests(tmp_path):
  out = tmp_path / "out"
  names = ["profile", "tiny_programs", "as_is", "no_autotuning", "cublas_only", "xla_attention"]
  assert gpu_run.main(["compile", "--dry_run", "--out", str(out), "--work", str(tmp_path / "w"),
                       "--skip", ",".join(f"compile/{n}" for n in names)]) == 0
  s = _stage(out, "compile")
  assert s["status"] == "skipped" and [x["skipped"] for x in s["steps"]] == ["--skip"] * 6
  import types
  args = types.SimpleNamespace(dry_run=False, pytest_k="sigkill or bf16")
  steps, _ = gpu_run.correctness(args, tmp_path)
  kernel, ckpt = steps[0].argv, steps[1].argv
  assert kernel[kernel.index("-k"):] == ["-k", "sigkill or bf16"]
  i = ckpt.index("-k") + 1
  assert ckpt[i].startswith("(complete_workdir or ") and ckpt[i].endswith(") and (sigkill or bf16)")


def test_the_documented_device_commands_parse_and_a_misspelt_skip_is_one_line(capsys):
  """docs/performance.md's commands for the device (device minutes are not spent on a
  typo): each parses, names known stages, and skips steps that exist."""
  import shlex
  text = (ROOT / "docs" / "performance.md").read_text().replace("\\\n", " ")
  commands = [l.split("bench/gpu/run.sh", 1)[1] for l in text.splitlines()
              if l.startswith("bench/gpu/run.sh ")]
  assert len(commands) >= 3
  for c in commands:
    args, stages, skips = gpu_run.parse(shlex.split(c.split("#")[0]))
    assert stages and all(s in gpu_run.STAGES for s in stages)
  assert gpu_run.main(["compile", "--skip", "compile/as_it_is"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--skip: no step 'compile/as_it_is'; the steps: " in err


class _Parsed(Exception):
  """Raised by a script's argument parser once it has read the arguments."""


def test_every_device_command_parses_with_its_scripts_own_flags(monkeypatch, tmp_path):
  """The commands of the real (not dry) run, which only a GPU runs: each bench script,
  checks.py, train.py and decode.py reads its arguments with its own parser, and train.py's
  resolve into a valid config (bible_gpu, its overrides); the test selections exist."""
  import argparse
  import importlib
  import types
  real = argparse.ArgumentParser.parse_args
  def stop(self, args=None, namespace=None):
    raise _Parsed(real(self, args, namespace))
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
  monkeypatch.syspath_prepend(str(ROOT))
  monkeypatch.syspath_prepend(str(ROOT / "bench"))
  args = types.SimpleNamespace(dry_run=False, bible_dir=str(ROOT / "data" / "bible"), pytest_k="")
  seen = set()
  for stage in gpu_run.STAGES:
    steps, _ = gpu_run.STAGE_BUILDERS[stage](args, tmp_path)
    for step in steps:
      script = step.argv[1]
      if script == "-m":
        assert step.argv[2] == "pytest" and "--junitxml" in " ".join(step.argv)
        continue
      seen.add(script)
      assert (ROOT / script).is_file(), script
      if script == "train.py":
        import train
        from seq2seq import train_lib
        a, overrides = train.parse_args(step.argv[2:])
        cfg = train_lib.resolve_config(tmp_path / "new", a.config,
                                       train.config_items(a, overrides) + overrides)
        assert cfg.model.dtype == "bfloat16", step.name
        assert cfg.model.d_model == (256 if step.name == "cpu_recipe" else 512), step.name
        continue
      if script == "decode.py":
        import decode
        with pytest.raises(_Parsed) as parsed:
          decode.parse_args(step.argv[2:])
        a = parsed.value.args[0]
        assert a.beam_size == 4 and a.reference.endswith("test.fr")
        continue
      module = importlib.import_module(Path(script).stem if "gpu" not in script else "checks")
      with pytest.raises(_Parsed) as parsed:
        module.main(step.argv[2:])
      ns = vars(parsed.value.args[0])
      assert ns.get("workload", "gpu") == "gpu" and ns.get("device", "cuda") == "cuda", step
  assert seen == {"bench/bench_train.py", "bench/bench_peers_torch.py",
                  "bench/bench_decode.py", "bench/gpu/checks.py", "train.py", "decode.py"}


def test_cudnn_attention_is_counted_in_compiled_hlo_text():
  import checks
  text = ('%a = custom-call(x), custom_call_target="__cudnn$fmhaScaleBiasSoftmax"\n'
          '%b = custom-call(y), custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward"\n'
          '%c = custom-call(z), custom_call_target="__cublas$gemm"\n'
          '%d = custom-call(x), custom_call_target="__cudnn$fmhaScaleBiasSoftmax"\n')
  assert checks.fmha_calls(text) == {"__cudnn$fmhaScaleBiasSoftmax": 2,
                                     "__cudnn$fmhaScaleBiasSoftmaxBackward": 1}
  assert checks.fmha_calls(text.replace("fmha", "gemm")) == {}


def test_carried_wheels_are_installed_with_pip_into_the_site_folder(tmp_path, monkeypatch):
  """The pip command the device runs (no index, no dependencies), on a small pure wheel
  standing in for a missing package: it lands in --site, importable from there."""
  wheels = tmp_path / "whl"
  wheels.mkdir()
  with zipfile.ZipFile(wheels / "s2s_fake_pkg-1.0-py3-none-any.whl", "w") as z:
    z.writestr("s2s_fake_pkg/__init__.py", "VALUE = 42\n")
    info = "s2s_fake_pkg-1.0.dist-info/"
    z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: s2s-fake-pkg\nVersion: 1.0\n")
    z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")
    z.writestr(info + "RECORD", f"s2s_fake_pkg/__init__.py,,\n{info}METADATA,,\n"
                                f"{info}WHEEL,,\n{info}RECORD,,\n")
  monkeypatch.setattr(gpu_run, "NEEDED_MODULES", ("s2s_fake_pkg",))
  logged = []
  site = tmp_path / "site"
  r = gpu_run.install_wheels(wheels, site, logged.append)
  assert r["done"] and r["installed"] == ["s2s_fake_pkg-1.0-py3-none-any.whl"], (r, logged)
  assert (site / "s2s_fake_pkg" / "__init__.py").read_text() == "VALUE = 42\n"
  assert gpu_run.install_wheels(tmp_path / "none", site, logged.append) == dict(
      done=False, reason=f"s2s_fake_pkg missing and no wheels in {tmp_path / 'none'}")
