"""decode.py end to end on a tiny workdir trained once for the module (~20 s), and each
kind of bad input: one line on stderr, exit code 2. Also what a newcomer meets first: the
training run's closing lines, what decode.py says of inputs unlike the training data, the
Python API's silence, both scripts' help.

Most runs call `decode.main` in this process (so the jitted decoders compile once for the
whole file); one runs the real script with a pipe on standard input."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import decode as decode_script  # noqa: E402

from seq2seq import translate  # noqa: E402
from seq2seq.errors import UserError  # noqa: E402
from seq2seq.search import Beam, Greedy, Sample  # noqa: E402
from seq2seq.checkpoint import Checkpoints  # noqa: E402
from seq2seq.load import load_workdir  # noqa: E402
from conftest import TEST_XLA_FLAGS  # noqa: E402

MAX_LEN = 64
MAX_SRC_LEN = 32
UNSEEN = "vingt-trois 日本語 ☃ 🙂"   # characters the vocabulary never saw
# One training pair too long for max_src_len: dropped, with a warning.
TOO_LONG = " ".join(["seventy-seven"] * 20)


def train_pairs():
  from num2words import num2words
  return [(num2words(n), num2words(n, lang="fr")) for n in range(300)] + [(TOO_LONG, "x")]


def train_args(root):
  return ["--workdir", str(root / "w"), "--config", "tiny", "--dataset", "parallel_text",
          "--train_files", str(root / "train.tsv"), "--data_dir", str(root / "tfds"),
          "--steps", "10", "--no_progress", "--config.model.d_model=32", "--config.model.num_heads=2",
          "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
          "--config.model.d_ff=64", f"--config.model.max_len={MAX_LEN}",
          "--config.data.vocab_size=300", f"--config.data.max_src_len={MAX_SRC_LEN}",
          "--config.data.max_tgt_len=32", "--config.train.batch_size=8",
          "--config.train.seq_len=32", "--config.train.warmup_steps=10",
          "--config.train.log_every=5", "--config.train.checkpoint_every=5"]


def run_train(root):
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  return subprocess.run([sys.executable, str(ROOT / "train.py"), *train_args(root)], env=env,
                        cwd=str(ROOT), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """10 steps of a tiny model on English→French numbers (and one over-long pair);
  checkpoints at steps 5 and 10. train.py's stdout and stderr are kept beside it."""
  root = tmp_path_factory.mktemp("decode_cli")
  train = root / "train.tsv"
  train.write_text("".join(f"{src}\t{tgt}\n" for src, tgt in train_pairs()))
  p = run_train(root)
  assert p.returncode == 0, p.stderr[-3000:]
  (root / "train.stdout").write_text(p.stdout)
  (root / "train.stderr").write_text(p.stderr)
  return root / "w"


@pytest.fixture(scope="module")
def model(workdir):
  return load_workdir(workdir)


def run(capsys, *argv, stdin=None, monkeypatch=None):
  """(exit code, stdout, stderr) of decode.py with `argv`, in this process."""
  if stdin is not None:
    import io
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
  try:
    code = decode_script.main(list(map(str, argv)))
  except SystemExit as e:  # argparse
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def assert_user_error(code, out, err, message):
  assert code == 2 and out == ""
  assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
  assert message in err, err


# --- end to end ---------------------------------------------------------------------------

def test_sentences_translate_like_the_library_in_order(workdir, model, capsys):
  """Greedy: the script's output is the library's translation of the same sentences from
  the same workdir (so the model, config and vocabulary all come from the workdir)."""
  cfg, params, tok = model
  sentences = ["one hundred", "seven", "two hundred and twelve", "forty-one"]
  code, out, err = run(capsys, "--workdir", workdir, "--beam-size", 1, *sentences)
  assert code == 0, err
  want = translate.translate(params, cfg.model, tok, sentences, Greedy())
  assert out.split("\n") == want + [""]
  assert "tokens/s" in err.strip().splitlines()[-1]


def test_default_is_beam_4_and_input_file_keeps_order_empty_lines_and_unseen_chars(
    workdir, model, tmp_path, capsys):
  cfg, params, tok = model
  lines = ["one hundred", "", "seven", "   ", UNSEEN, "two hundred and twelve"]
  path = tmp_path / "in.txt"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  code, out, err = run(capsys, "--workdir", workdir, "--input", path)
  assert code == 0, err
  got = out.split("\n")
  assert len(got) == len(lines) + 1 and got[-1] == ""
  assert got[1] == "" and got[3] == ""                 # empty and blank lines stay empty
  # the unseen characters are spelt with byte pieces, never UNK, and do not crash
  assert tok.unk_id not in tok.encode(UNSEEN)
  assert tok.decode(tok.encode(UNSEEN)) == UNSEEN
  want = translate.translate(params, cfg.model, tok, [l for l in lines if l.strip()],
                            Beam(size=4, alpha=0.6, stop="exact"))
  assert [g for g, l in zip(got, lines) if l.strip()] == want
  assert "6/6" in err                                   # the progress bar
  assert "6 lines" in err and "tokens/s" in err


def test_nbest_prints_index_score_translation(workdir, model, capsys):
  cfg, params, tok = model
  sentences = ["one hundred", "", "seven"]
  code, out, err = run(capsys, "--workdir", workdir, "--n-best", 3, "--alpha", 1.0,
                       *sentences)
  assert code == 0, err
  rows = [line.split("\t") for line in out.splitlines()]
  assert all(len(r) == 3 for r in rows)
  assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 2, 2, 2]
  assert rows[3][1:] == ["0.0000", ""]                  # the empty input: one line
  want = translate.translate_nbest(params, cfg.model, tok, sentences,
                                  Beam(size=4, alpha=1.0, n_best=3, stop="exact"))
  for i, group in ((0, rows[0:3]), (2, rows[4:7])):
    scores = [float(r[1]) for r in group]
    assert scores == sorted(scores, reverse=True)
    np.testing.assert_allclose(scores, want.scores[i], atol=1e-4)
    assert [r[2] for r in group] == want.texts[i]


def test_sampling_from_stdin_is_reproducible_with_a_seed(workdir, capsys, monkeypatch):
  text = "one hundred\nseven\n\n"
  runs = [run(capsys, "--workdir", workdir, "--top-k", 5, "--temperature", 1.5, "--seed",
              seed, "--no-progress", stdin=text, monkeypatch=monkeypatch)
          for seed in (1, 1, 2)]
  assert all(code == 0 for code, _, _ in runs), runs
  outs = [out for _, out, _ in runs]
  assert outs[0] == outs[1] and outs[0] != outs[2]
  assert len(outs[0].split("\n")) == 4 and outs[0].split("\n")[2] == ""


def test_over_long_line_is_truncated_with_one_warning(workdir, model, capsys):
  _, _, tok = model
  long = " ".join(["seventy-seven"] * 60)
  assert len(tok.encode(long)) + 1 > MAX_LEN
  code, out, err = run(capsys, "--workdir", workdir, "--beam-size", 1, "seven", long, long)
  assert code == 0, err
  assert len(out.split("\n")) == 4
  warnings = [l for l in err.splitlines() if l.startswith("warning:") and "truncated" in l]
  assert len(warnings) == 1 and "2 input line(s)" in warnings[0] and "(line 2, 3)" in warnings[0]
  got = out.split("\n")
  assert got[1] == got[2] != ""    # what the cut source gives is library-tested (test_decoding)


def test_checkpoint_step_and_max_len(workdir, capsys):
  outs = {}
  for step in (5, 10):
    code, outs[step], err = run(capsys, "--workdir", workdir, "--beam-size", 1,
                                "--checkpoint-step", step, "--max-len", 3, "one hundred")
    assert code == 0, err
    assert len(outs[step].strip().split()) <= 3        # at most 3 tokens
  _, latest, _ = run(capsys, "--workdir", workdir, "--beam-size", 1, "--max-len", 3,
                     "one hundred")
  assert latest == outs[10]


def test_reference_scores_the_one_best_lines_with_sacrebleu(workdir, tmp_path, capsys):
  """--reference: BLEU, chrF and exact match of the 1-best lines (with --n-best too) equal
  sacreBLEU's own on the lines written. Half the references are the model's own output, so
  the scores are far from 0 and from 100."""
  import sacrebleu
  from num2words import num2words
  numbers = [7, 100, 212, 41, 999, 3000]
  path = tmp_path / "in.en"
  path.write_text("".join(num2words(n) + "\n" for n in numbers))
  code, hyps, err = run(capsys, "--workdir", workdir, "--input", path, "--no-progress")
  assert code == 0, err
  hyps = hyps.splitlines()
  refs = [h if i % 2 else num2words(n, lang="fr") for i, (n, h) in enumerate(zip(numbers, hyps))]
  ref_path = tmp_path / "ref.fr"
  ref_path.write_text("".join(r + "\n" for r in refs))
  for extra in ([], ["--n-best", 2]):
    code, out, err = run(capsys, "--workdir", workdir, "--input", path, "--no-progress",
                         "--reference", ref_path, *extra)
    assert code == 0, err
    best = out.splitlines() if not extra else [r.split("\t")[2] for r in out.splitlines()][::2]
    assert best == hyps
    exact = sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(refs)
    assert 0.5 <= exact < 1
    want = (f"BLEU {sacrebleu.corpus_bleu(hyps, [refs]).score:.2f}, "
            f"chrF {sacrebleu.corpus_chrf(hyps, [refs]).score:.2f}, "
            f"exact match {100 * exact:.1f}% against {ref_path} (6 lines; sacreBLEU, 13a)")
    assert err.splitlines()[-1] == want, err


def test_reference_must_match_the_input(workdir, tmp_path, capsys, monkeypatch):
  """A reference of another length, a missing one, or typed input (a real pseudo-terminal
  on standard input) is one line on stderr, exit 2, before anything is translated."""
  import pty
  ref = tmp_path / "ref.fr"
  ref.write_text("sept\ncent\n")
  assert_user_error(*run(capsys, "--workdir", workdir, "--reference", ref, "seven"),
                    f"--reference {ref} has 2 line(s), the input 1")
  assert_user_error(*run(capsys, "--workdir", workdir, "--reference", tmp_path / "no.fr",
                         "seven"), f"cannot read {tmp_path / 'no.fr'}")
  master, slave = pty.openpty()
  try:
    with os.fdopen(slave, "r", closefd=False) as tty:
      monkeypatch.setattr(sys, "stdin", tty)
      assert_user_error(*run(capsys, "--workdir", workdir, "--reference", ref),
                        "--reference needs the input as --input FILE")
  finally:
    os.close(master)
    os.close(slave)


def test_the_real_script_reads_standard_input(workdir):
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  p = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--workdir", str(workdir),
                      "--beam-size", "1"], input=f"seven\n\n{UNSEEN}\n".encode(),
                     capture_output=True, env=env, cwd=str(ROOT), timeout=120)
  assert p.returncode == 0, p.stderr.decode()[-2000:]
  out = p.stdout.decode("utf-8").split("\n")
  assert len(out) == 4 and out[1] == "" and out[3] == ""
  assert b"tokens/s" in p.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_one_line(workdir):
  """Standard output on a full disk: one line and exit 2, not a traceback."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  with open("/dev/full", "w") as full:
    p = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--workdir", str(workdir),
                        "--beam-size", "1", "seven"], stdout=full, stderr=subprocess.PIPE,
                       text=True, env=env, cwd=str(ROOT), timeout=120)
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip() == ("error: cannot write the translations: No space left on device "
                              "(0 line(s) written before)"), p.stderr[-2000:]


def test_chunks_write_the_same_lines_as_one_chunk(workdir, model, tmp_path, capsys):
  _, _, tok = model
  long = " ".join(["seventy-seven"] * 60)
  lines = ["one hundred", "", "seven", long, "two hundred and twelve", "forty-one", long]
  path = tmp_path / "in.txt"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  outs = []
  for chunk in (2, 2048):
    code, out, err = run(capsys, "--workdir", workdir, "--beam-size", 1, "--input", path,
                         "--chunk-size", chunk)
    assert code == 0, err
    assert "7/7" in err and "7 lines" in err                     # one bar over all chunks
    assert "2 input line(s)" in err and "(line 4, 7)" in err     # numbered from line 1
    outs.append(out)
  assert outs[0] == outs[1] and len(outs[0].split("\n")) == len(lines) + 1


# Python installs its Ctrl-C handler only if SIGINT is not ignored, and it is ignored in
# background jobs (e.g. a CI script run with &): the real script, with the handler.
WITH_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, "
               "signal.default_int_handler); sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


def _popen_decode(workdir, *argv, **kw):
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  return subprocess.Popen(
      [sys.executable, "-c", WITH_CTRL_C, str(ROOT / "decode.py"), "--workdir", str(workdir),
       *map(str, argv)], env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, bufsize=0, **kw)


def _readline(stream, seconds=120) -> bytes:
  """The next line of a child's unbuffered output; fails rather than hang."""
  import select
  line, deadline = b"", time.time() + seconds
  while not line.endswith(b"\n"):
    if not select.select([stream], [], [], max(0.0, deadline - time.time()))[0]:
      pytest.fail(f"no line of output in {seconds} s (so far: {line!r})")
    byte = stream.read(1)
    if not byte:
      pytest.fail(f"output ended before a whole line (so far: {line!r})")
    line += byte
  return line


def test_ctrl_c_keeps_the_lines_already_written(workdir, model, tmp_path, capsys):
  """The real script, interrupted once its first chunk is out: it exits 130, and what it
  wrote is whole lines, the translations of the first lines of the input."""
  from num2words import num2words
  lines = [num2words(n) for n in range(3000)]
  path = tmp_path / "many.txt"
  path.write_text("\n".join(lines) + "\n")
  proc = _popen_decode(workdir, "--beam-size", 1, "--chunk-size", 4, "--no-progress",
                       "--input", path)
  try:
    first = [_readline(proc.stdout) for _ in range(4)]   # waits for the first chunk
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  err = err.decode()
  assert proc.returncode == 130, err[-2000:]
  out = b"".join(first).decode() + rest.decode()
  assert out.endswith("\n")
  got = out.split("\n")[:-1]
  assert f"interrupted: {len(got)} line(s) translated and written" in err.splitlines()[-1], err
  assert 4 <= len(got) < len(lines) and len(got) % 4 == 0, err
  code, want, err = run(capsys, "--workdir", workdir, "--beam-size", 1, *lines[:len(got)])
  assert code == 0, err
  assert got == want.split("\n")[:-1]


def test_an_input_file_is_read_as_it_is_translated(workdir, capsys, tmp_path):
  """--input FILE is not read whole first: from a named pipe, a chunk's translations come
  out before the next lines are written (so a file of any length is held a chunk at a
  time); the end of the pipe ends the run."""
  fifo = tmp_path / "in.fifo"
  os.mkfifo(fifo)
  proc = _popen_decode(workdir, "--beam-size", 1, "--chunk-size", 2, "--input", fifo)
  try:
    with open(fifo, "wb", buffering=0) as writer:
      writer.write(b"seven\none hundred\n")
      first = [_readline(proc.stdout) for _ in range(2)]   # the rest is not written yet
      writer.write(b"forty-one\n")
    rest, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, err.decode()[-2000:]
  code, want, _ = run(capsys, "--workdir", workdir, "--beam-size", 1, "seven", "one hundred",
                      "forty-one")
  assert (b"".join(first) + rest).decode() == want
  assert b"3 lines" in err


def test_a_line_that_is_not_utf8_ends_the_run_after_the_lines_before(workdir, tmp_path,
                                                                      capsys):
  """Met as the input is read: the chunks before it stay written, then one line naming
  the input line, exit 2."""
  path = tmp_path / "in.txt"
  path.write_bytes(b"seven\none hundred\nforty-one\ncaf\xe9\n")
  code, out, err = run(capsys, "--workdir", workdir, "--beam-size", 1, "--chunk-size", 2,
                       "--no-progress", "--input", path)
  _, want, _ = run(capsys, "--workdir", workdir, "--beam-size", 1, "seven", "one hundred")
  assert code == 2 and out == want, err
  assert err.strip() == (f"error: {path} line 4: invalid UTF-8 (byte 0xe9) (2 line(s) "
                         f"translated and written before)"), err


def test_typed_lines_are_translated_as_they_are_entered(workdir, model, capsys):
  """At a terminal (a pseudo-terminal here), each line's translation comes out before the
  next line is typed."""
  import pty
  master, slave = pty.openpty()
  proc = _popen_decode(workdir, "--beam-size", 1, stdin=slave)
  os.close(slave)
  try:
    got = []
    for sentence in ("seven", "one hundred"):
      os.write(master, sentence.encode() + b"\n")
      got.append(_readline(proc.stdout).decode())        # before any more input
    os.write(master, b"\x04")                             # Ctrl-D: end of input
    rest, err = proc.communicate(timeout=120)
  finally:
    os.close(master)
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0 and rest == b"", err.decode()[-2000:]
  code, want, _ = run(capsys, "--workdir", workdir, "--beam-size", 1, "seven", "one hundred")
  assert "".join(got) == want
  assert b"press Enter" in err and b"2 lines" in err


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--top-k", "5", "--beam-size", "4"], "cannot be used with beam search"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--temperature", "-0.5", "--top-k", "3"], "temperature must be > 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-p", "0.9", "--n-best", "2"], "n_best cannot be used with sample"),
    (["--beam-size", "1", "--alpha", "0.6"], "alpha cannot be used with greedy"),
    (["--n-best", "5"], "n_best must be an integer in [1, beam size 4]"),
    (["--beam-size", "0"], "beam size must be"),
    (["--beam-size", "four"], "invalid int value: 'four'"),
    (["--input", "in.txt"], "SENTENCE arguments or --input, not both"),
])
def test_contradictory_options(argv, message, tmp_path, capsys):
  """Rejected before the workdir is even read (this one does not exist)."""
  assert_user_error(*run(capsys, "--workdir", tmp_path / "none", *argv, "one"), message)


def test_missing_workdir(tmp_path, capsys):
  assert_user_error(*run(capsys, "--workdir", tmp_path / "nope", "one"),
                    f"workdir {tmp_path / 'nope'} does not exist")
  (tmp_path / "file").write_text("x")
  assert_user_error(*run(capsys, "--workdir", tmp_path / "file", "one"),
                    f"workdir {tmp_path / 'file'} is a file, not a directory")
  assert_user_error(*run(capsys, "--workdir", "gs://bucket/run1", "one"), "is a URL")


def test_workdir_without_checkpoint(workdir, tmp_path, capsys):
  empty = tmp_path / "empty"
  empty.mkdir()
  for name in ("config.json", "vocab.model"):
    shutil.copy(workdir / name, empty / name)
  assert_user_error(*run(capsys, "--workdir", empty, "one"), "holds no checkpoint")
  assert_user_error(*run(capsys, "--workdir", tmp_path, "one"), "holds no config.json")


def test_config_that_does_not_match_the_checkpoint(workdir, tmp_path, capsys):
  edited = tmp_path / "edited"
  shutil.copytree(workdir, edited)
  cfg = json.loads((edited / "config.json").read_text())
  cfg["model"]["d_model"] = 64
  (edited / "config.json").write_text(json.dumps(cfg))
  assert_user_error(*run(capsys, "--workdir", edited, "one"),
                    "checkpoint 10 does not match its config.json")


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-step", "7", "one"], "no checkpoint at step 7 (have: 5, 10)"),
    (["--input", "/nonexistent/in.txt"], "cannot read /nonexistent/in.txt"),
    (["--max-len", "1000", "one"], f"max_len must be in [1, {MAX_LEN}]"),
    (["--batch-size", "0", "one"], "batch_size must be >= 1"),
    (["--seed", "99999999999999999999999", "one"], "--seed must be in [0, 2**32)"),
])
def test_bad_values_with_a_good_workdir(workdir, argv, message, capsys):
  assert_user_error(*run(capsys, "--workdir", workdir, *argv), message)


def _spelt(argv, sep):
  """argv with every flag's words joined by `sep` (values and --config.KEY=VALUE kept)."""
  out = []
  for a in argv:
    if a.startswith("--") and "." not in a:
      name, eq, value = a.partition("=")
      a = "--" + name[2:].replace("_", sep).replace("-", sep) + eq + value
    out.append(a)
  return out


def test_flags_are_spelt_either_way_in_both_scripts():
  """Both scripts accept flags spelt with dashes or underscores."""
  sys.path.insert(0, str(ROOT))
  import train as train_script
  decode_argv = ["--workdir", "w", "--beam-size", "2", "--checkpoint-step", "5", "--n-best",
                 "2", "--max-len=9", "--batch-size", "3", "--chunk-size", "7",
                 "--top-k", "3", "--top-p", "0.9", "--no-progress", "one_two"]
  want = decode_script.parse_args(decode_argv)
  assert (want.beam_size, want.checkpoint_step, want.max_len, want.chunk_size, want.top_k,
          want.no_progress, want.sentences) == (2, 5, 9, 7, 3, True, ["one_two"])
  assert decode_script.parse_args(_spelt(decode_argv, "_")) == want
  assert not decode_script.parse_args(["--workdir", "w"]).no_progress
  train_argv = ["--workdir", "w", "--train_files", "x", "--validation_files=y", "--test_files",
                "z", "--src_lang", "en", "--tgt_lang", "fr", "--data_dir", "d", "--no_progress",
                "--coordinator_address", "h:1", "--num_processes", "2", "--process_id", "0",
                "--config.train.batch_size=4"]
  want = train_script.parse_args(train_argv)
  assert want[0].validation_files == "y" and want[0].no_progress and want[0].num_processes == 2
  assert want[1] == ["train.batch_size=4"]
  assert train_script.parse_args(_spelt(train_argv, "-")) == want
  assert not train_script.parse_args(["--workdir", "w"])[0].no_progress


@pytest.mark.parametrize("script, argv, message", [
    ("train.py", ["--bogus"], "unrecognized argument --bogus"),
    ("train.py", ["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ("decode.py", ["--beam-size", "x"], "argument --beam_size: invalid int value: 'x'"),
    ("decode.py", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_are_one_line_and_exit_2_without_loading_jax(script, argv, message):
  """Each script's flags are read before JAX loads (importing seq2seq is lazy): a typo
  answers at once with one line, not argparse's usage dump."""
  code = ("import runpy, sys; sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
          "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
          "finally: print('jax loaded' if 'jax' in sys.modules else 'no jax', file=sys.stderr)")
  p = subprocess.run([sys.executable, "-c", code, str(ROOT / script), *argv], cwd=str(ROOT),
                     capture_output=True, text=True, timeout=60)
  first, last = p.stderr.strip().splitlines()
  assert p.returncode == 2 and first.startswith("error: ") and message in first, p.stderr
  assert last == "no jax"


def test_a_second_run_loads_the_compiled_decode_loop_from_the_disk_cache(workdir, tmp_path):
  cache = tmp_path / "cache"
  env = dict(os.environ, SEQ2SEQ_COMPILE_CACHE=str(cache), JAX_DEBUG_LOG_MODULES="jax._src.compiler",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")   # however fast the compile
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count

  def decode(env):
    p = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--workdir", str(workdir),
                        "twelve", "three hundred"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    hit = "Persistent compilation cache hit for 'jit__decode_impl'" in p.stderr
    return p.stdout, hit

  first, hit = decode(env)
  assert not hit and any(f.name.startswith("jit__decode_impl") for f in cache.iterdir())
  second, hit = decode(env)
  assert hit and second == first
  for off in ("off", "/proc/no/such/dir"):   # off, or a directory that cannot be made
    assert decode(dict(env, SEQ2SEQ_COMPILE_CACHE=off)) == (first, False)


@pytest.mark.parametrize("flags, want", [
    (dict(), Beam(4, 0.6, 1, "exact")),
    (dict(beam_size=8, alpha=1.0, n_best=3), Beam(8, 1.0, 3, "exact")),
    (dict(beam_stop="count"), Beam(4, 0.6, 1, "count")),
    (dict(beam_size=1), Greedy()),
    (dict(top_k=5), Sample(1.0, 5, 1.0)),
    (dict(temperature=0.7, top_p=0.9, beam_size=1), Sample(0.7, 0, 0.9)),
    (dict(top_k=5, beam_size=4), "cannot be used with beam search"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0.9, n_best=2), "n_best cannot be used with sample"),
    (dict(beam_size=1, alpha=0.6), "alpha cannot be used with greedy"),
    (dict(n_best=5), r"n_best must be an integer in \[1, beam size 4\]"),
    (dict(beam_size=0), "beam size must be"),
    (dict(beam_size=1, beam_stop="best"), "beam_stop cannot be used with greedy"),
])
def test_strategy_from_flags(flags, want):
  if isinstance(want, str):
    with pytest.raises(UserError, match=want) as e:
      decode_script.strategy_from_flags(**flags)
    assert "\n" not in str(e.value)
  else:
    assert decode_script.strategy_from_flags(**flags) == want


def test_default_beam_search_is_beam_defaults():
  """decode.py's default beam search is Beam()'s: the one test_search and test_slots check
  against hypotheses that end early."""
  assert decode_script.strategy_from_flags() == Beam() and Beam().stop == "exact"


# --- a newcomer's first hour ----------------------------------------------------------------

def _seen_by_training(tok):
  """(pieces, longest) of the training sources as the fixture's run kept them, computed
  here from the training file: pairs over 32 tokens (EOS included) dropped."""
  pieces, longest = set(), 0
  for src, tgt in train_pairs():
    s, t = tok.encode(src) + [tok.eos_id], tok.encode(tgt) + [tok.eos_id]
    if len(s) <= MAX_SRC_LEN and len(t) <= 32:
      pieces |= set(s[:-1])
      longest = max(longest, len(s))
  return pieces, longest


def test_lines_unlike_every_training_source_get_one_warning_with_their_count(
    workdir, model, capsys):
  """A line with a piece no training source held (upper case and unseen characters are
  byte pieces here) or longer than the longest training source is translated all the same,
  and counted in one warning; the record in the workdir is what the training file says."""
  _, _, tok = model
  pieces, longest = _seen_by_training(tok)
  record = json.loads((workdir / "train_sources.json").read_text())
  assert record["longest"] == longest and set(record["pieces"]) == pieces
  assert longest < len(tok.encode(TOO_LONG))        # the dropped pair is not counted
  long_familiar = " ".join(["one hundred and one"] * 6)
  lines = ["seven", "", "SEVEN", UNSEEN, long_familiar, "two hundred and twelve",
           " ".join(["seventy-seven"] * 60)]
  unseen = [i for i, l in enumerate(lines) if set(tok.encode(l)) - pieces]
  long = [i for i, l in enumerate(lines) if len(tok.encode(l)) + 1 > longest]
  assert unseen == [2, 3] and long == [3, 4, 6]     # the cases this test means to cover
  code, out, err = run(capsys, "--workdir", workdir, "--beam_size", 1, *lines)
  assert code == 0, err
  assert len(out.split("\n")) == len(lines) + 1
  warnings = [l for l in err.splitlines() if "unlike anything the model was trained on" in l]
  assert len(warnings) == 1, err
  assert warnings[0].startswith("warning: 4 input line(s) unlike"), warnings
  assert "(line 3, 4, 5, 7)" in warnings[0]
  assert (f"2 with pieces no training source held, 3 longer than the longest training source "
          f"({longest} tokens)") in warnings[0]
  code, out, err = run(capsys, "--workdir", workdir, "seven", "two hundred and twelve")
  assert code == 0 and "warning" not in err, err


def test_sources_are_lower_cased_where_the_run_says_in_decode_py_and_the_api(
    workdir, model, tmp_path, capsys):
  """data.lowercase_source in the workdir's config: decode.py and load_workdir's tokenizer
  read "SEVEN" as "seven" (without it, upper case is byte pieces: another input)."""
  cfg, params, tok = model
  assert not cfg.data.lowercase_source and not tok.lowercase_source
  lower = tmp_path / "lower"
  shutil.copytree(workdir, lower)
  config = json.loads((lower / "config.json").read_text())
  config["data"]["lowercase_source"] = True
  (lower / "config.json").write_text(json.dumps(config))
  lcfg, lparams, ltok = load_workdir(lower)
  assert lcfg.data.lowercase_source and ltok.lowercase_source
  src = ["SEVEN", "Two Hundred And Twelve"]
  want, _ = translate.encode_sources(tok, [s.lower() for s in src], MAX_LEN)
  assert translate.encode_sources(ltok, src, MAX_LEN)[0] == want
  assert translate.encode_sources(tok, src, MAX_LEN)[0] != want
  got = translate.translate(lparams, lcfg.model, ltok, src + ["seven"], Greedy())
  assert got == translate.translate(params, cfg.model, tok, ["seven", "two hundred and twelve",
                                                             "seven"], Greedy())
  code, out, err = run(capsys, "--workdir", lower, "--beam_size", 1, *src)
  assert code == 0, err
  assert out.splitlines() == got[:2] and "warning" not in err


def _speed(err):
  m = re.fullmatch(r"(\d+) (lines?), (\d+) tokens: compiling ([\d.]+) s, decoding ([\d.]+) s "
                   r"\(([\d.]+) tokens/s\)", err.strip().splitlines()[-1])
  assert m, err
  return int(m[1]), m[2], int(m[3]), float(m[4]), float(m[5])


def test_closing_line_reports_compiling_and_decoding_apart(workdir, capsys):
  """A first run of a new shape (--max_len 7 is compiled for no other test) spends time
  compiling; the same run again compiles nothing, and its decoding time is the rest."""
  runs = []
  for _ in range(2):
    start = time.perf_counter()
    code, out, err = run(capsys, "--workdir", workdir, "--beam_size", 1, "--max_len", 7,
                         "one hundred")
    wall = time.perf_counter() - start
    assert code == 0, err
    runs.append((_speed(err), wall))
  (n, word, tokens, compiling, decoding), wall = runs[0]
  assert (n, word) == (1, "line") and tokens >= 1
  assert compiling > 0.2 and compiling + decoding <= wall
  (_, _, tokens2, compiling2, decoding2), wall2 = runs[1]
  assert compiling2 == 0.0 and tokens2 == tokens and 0 <= decoding2 <= wall2
  assert decoding2 < compiling


@pytest.mark.slow
def test_load_workdir_prints_nothing_and_leaves_logging_alone(workdir):
  """The Python API in a fresh interpreter: loading prints nothing (Orbax's routine
  warnings are filtered while it loads), and the program's own absl warnings still show."""
  code = ("import logging, sys\n"
          "from seq2seq.load import load_workdir\n"
          "load_workdir(sys.argv[1])\n"
          "logging.getLogger('absl').warning('the program speaks')\n")
  env = dict(os.environ)
  env["XLA_FLAGS"] = TEST_XLA_FLAGS   # not the caller's device count
  p = subprocess.run([sys.executable, "-c", code, str(workdir)], env=env, cwd=str(ROOT),
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].endswith("the program speaks"), p.stderr


def test_train_py_ends_with_a_command_that_translates_a_source_of_its_own_data(
    workdir, capsys):
  """The closing hint is a decode.py command for the workdir and a training source (this
  run has no held-out split), which decode.py takes without a warning."""
  out = (workdir.parent / "train.stdout").read_text()
  hint = [l for l in out.splitlines() if l.startswith("translate with: ")]
  assert len(hint) == 1, out
  argv = shlex.split(hint[0].removeprefix("translate with: "))
  assert argv[:4] == ["python", "decode.py", "--workdir", str(workdir)] and len(argv) == 5
  assert argv[4] in {src for src, _ in train_pairs()}
  code, got, err = run(capsys, *argv[2:])
  assert code == 0 and got.count("\n") == 1 and "warning" not in err, err


def test_train_py_warns_of_dropped_pairs_in_one_line(workdir):
  err = (workdir.parent / "train.stderr").read_text()
  assert ("warning: 1 of 301 training pairs are longer than 32 source / 32 target tokens "
          "(EOS included): dropped") in err.splitlines(), err
  assert not [l for l in err.splitlines() if l.startswith(("WARNING", "INFO"))], err


@pytest.mark.slow
def test_a_rerun_of_a_finished_workdir_says_it_trained_nothing(workdir):
  p = run_train(workdir.parent)
  assert p.returncode == 0, p.stderr[-2000:]
  first = p.stdout.splitlines()[0]
  assert first == (f"nothing to train: workdir {workdir} is already at step 10 "
                   f"(train.steps 10; --steps N trains on to step N)"), p.stdout
  assert Checkpoints(workdir, read_only=True).steps() == [5, 10]


@pytest.mark.parametrize("script", ["train", "decode"])
def test_help_spells_every_flag_one_way(script, capsys):
  """Both scripts list their flags with _ between words (the --config.KEY=VALUE fields can
  only be spelt so); the - spelling is an alias (test_flags_are_spelt_either_way...)."""
  sys.path.insert(0, str(ROOT))
  module = __import__(script)
  with pytest.raises(SystemExit) as e:
    module.parse_args(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  options = text[text.index("options:"):]
  options = options[:options.index("\n\n")] if "\n\n" in options else options
  flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", options))
  assert len(flags) >= 10, flags
  assert not [f for f in flags if "-" in f[2:]], sorted(flags)
