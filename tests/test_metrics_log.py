"""metrics.jsonl across a kill and a resume, and bench/plot_metrics.py on it."""
import json
import subprocess
import sys
from pathlib import Path

from seq2seq.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _killed_and_resumed(workdir):
  """A run logs steps 50-150 and evaluates at 100, then dies in the middle of a line; the
  resumed run (its checkpoint: step 100) logs 150 and 200 again with other values."""
  first = MetricsWriter(workdir)
  for step in (50, 100, 150):
    first.write(step, "train", {"loss": 10.0 - step / 100})
    if step == 100:
      first.write(step, "validation", {"loss": 9.5, "bleu": 1.0, "chrf": 10.0})
  first.close()
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 200, "time": 1.0, "split": "tra')  # SIGKILL here
  resumed = MetricsWriter(workdir)
  for step in (150, 200):
    resumed.write(step, "train", {"loss": 5.0 - step / 100})
    if step == 200:
      resumed.write(step, "validation", {"loss": 4.5, "bleu": 2.0, "chrf": 20.0})
      resumed.write(step, "test", {"loss": 4.4, "bleu": 3.0, "chrf": 30.0})
  resumed.close()


def test_a_resumed_runs_rows_replace_the_killed_runs_and_nothing_is_lost(tmp_path, capsys):
  _killed_and_resumed(tmp_path)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 9  # 4 + the cut line + 4: every row written is still there, whole
  assert lines[4].endswith('"split": "tra')
  parsed = [json.loads(l) for i, l in enumerate(lines) if i != 4]
  got = [(r["split"], r["step"], r["loss"]) for r in read_metrics(tmp_path)]
  assert got == [("train", 50, 9.5), ("train", 100, 9.0), ("validation", 100, 9.5),
                 ("train", 150, 3.5), ("train", 200, 3.0), ("validation", 200, 4.5),
                 ("test", 200, 4.4)]
  # the same from a naive reading: the last row of each (split, step), in step order
  last = {}
  for r in parsed:
    last[(r["split"], r["step"])] = r
  assert read_metrics(tmp_path) == sorted(last.values(), key=lambda r: r["step"])
  assert "skipped 1 unreadable line" in capsys.readouterr().err


def test_read_metrics_of_a_workdir_without_a_log_is_empty(tmp_path):
  assert read_metrics(tmp_path) == []


def _plot(*args):
  return subprocess.run([sys.executable, str(ROOT / "bench" / "plot_metrics.py"), *args],
                        capture_output=True, text=True, timeout=120)


def test_plot_metrics_draws_a_killed_and_resumed_run(tmp_path):
  _killed_and_resumed(tmp_path)
  out = tmp_path / "plots" / "curves.png"
  p = _plot("--workdir", str(tmp_path), "--out", str(out))
  assert p.returncode == 0, p.stderr
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_metrics_bad_input_is_one_line(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "metrics.jsonl").write_text("")
  _killed_and_resumed(tmp_path)
  for args, says in [(("--workdir", str(tmp_path / "nowhere")), "no metrics.jsonl"),
                     (("--workdir", str(tmp_path / "empty")), "holds no metrics"),
                     (("--workdir", str(tmp_path), "--out", str(tmp_path / "x.notanimage")),
                      "cannot write"),
                     (("--workdir", str(tmp_path), "--out"), "expected one argument"),
                     (("--workdir", str(tmp_path), "--out", str(tmp_path / "x.png"),
                       "--colour", "red"), "unrecognized arguments: --colour red")]:
    if "--out" not in " ".join(args):
      args = (*args, "--out", str(tmp_path / "x.png"))
    p = _plot(*args)
    assert p.returncode != 0 and says in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()  # the error, after the reader's warning if any
    assert "Traceback" not in p.stderr and lines[-1].startswith("error:"), p.stderr
    assert all(l.startswith("warning:") for l in lines[:-1]), p.stderr


def _events(path):
  """The events of a TensorBoard file, each record's framing and checksums checked."""
  import struct
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.record_writer import masked_crc32c
  data, i, events = path.read_bytes(), 0, []
  while i < len(data):
    header = data[i:i + 8]
    (n,) = struct.unpack("Q", header)
    assert struct.unpack("I", data[i + 8:i + 12])[0] == masked_crc32c(header)
    body = data[i + 12:i + 12 + n]
    assert struct.unpack("I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(body)
    events.append(Event.FromString(body))
    i += 16 + n
  return events


def test_the_tensorboard_file_holds_what_tensorboardxs_own_writer_writes(tmp_path):
  """The scalars, written on the caller's thread, as records and events like those of
  tensorboardX's SummaryWriter (but for the times)."""
  from tensorboardX import SummaryWriter
  (tmp_path / "ours").mkdir()
  ours = MetricsWriter(tmp_path / "ours")
  theirs = SummaryWriter(str(tmp_path / "theirs"))
  for step, split, scalars in ((5, "train", {"loss": 2.5, "accuracy": 0.25}),
                               (10, "validation", {"bleu": 3.0})):
    ours.write(step, split, scalars)
    for k, v in scalars.items():
      theirs.add_scalar(f"{split}/{k}", v, step)
  ours.close()
  theirs.close()

  def timeless(d):
    (path,) = (d / "tensorboard" if d.name == "ours" else d).glob("events.out.tfevents.*")
    events = _events(path)
    for e in events:
      assert e.wall_time > 1e9
      e.wall_time = 0
    return events
  assert timeless(tmp_path / "ours") == timeless(tmp_path / "theirs")
  assert [(e.step, e.summary.value[0].tag) for e in timeless(tmp_path / "ours")[1:]] == [
      (5, "train/loss"), (5, "train/accuracy"), (10, "validation/bleu")]
