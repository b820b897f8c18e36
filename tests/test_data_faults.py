"""What the data path promises for every fault (docs/usage.md, "What the data path
promises"): a token cache that changed on disk is found when it is opened, said in one line,
set aside and tokenized again, and nothing in it is trained on; a fault of the disk, of the
input files or of the text is one `error:` line and exit 2 with nothing left behind; the
processes the data path starts end with it. Real files and real processes, real faults:
bytes changed in the memory-mapped files, a file size limit (RLIMIT_FSIZE) and a really full
file system (a tmpfs of its own) while writing, a read-only mount, a FIFO and a device as
input, an edit while the run reads, a process killed with SIGKILL."""
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train as train_script  # noqa: E402

from conftest import TEST_XLA_FLAGS  # noqa: E402
from seq2seq import UserError, train_lib  # noqa: E402
from seq2seq.data import load_dataset, token_ids  # noqa: E402
from seq2seq.data import testing as dtest  # noqa: E402
from seq2seq.workdir import Workdir  # noqa: E402

SPLITS = (("train", 900), ("validation", 20), ("test", 25))


def train_args(corpus, workdir, *extra) -> list[str]:
  """train.py's flags for a 2-step run of a tiny model on `corpus`."""
  return ["--workdir", str(workdir), "--config", "tiny", "--train_files", str(corpus),
          "--steps", "2", "--no_progress", "--config.model.d_model=32",
          "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
          "--config.model.num_decoder_layers=1", "--config.model.d_ff=64",
          "--config.model.max_len=64", "--config.data.vocab_size=300",
          "--config.data.max_src_len=32", "--config.data.max_tgt_len=32",
          "--config.train.batch_size=8", "--config.train.seq_len=32",
          "--config.train.warmup_steps=10", "--config.train.eval_every=1000",
          "--config.train.num_eval_examples=4", "--config.train.eval_batch_size=4", *extra]


def config_of(args):
  """The Config train.py resolves for `args`."""
  parsed, overrides = train_script.parse_args(args)
  return train_lib.resolve_config(parsed.workdir, parsed.config,
                                  train_script.config_items(parsed, overrides) + overrides)


def load(cfg, workdir):
  return load_dataset(cfg, str(workdir), process_index=0, process_count=1, progress=False)


def loaded_saying(cfg, workdir):
  """(the dataset, the warnings it gave)."""
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    ds = load(cfg, workdir)
  return ds, [str(w.message) for w in said]


def epoch(ds) -> list[dict]:
  """The batches of the first epoch (every pair placed once, or nearly)."""
  return list(itertools.islice(ds.train_batches(0), ds.stats["steps_per_epoch"]))


def evaluated(ds) -> dict:
  return {split: list(ds.eval_batches(split, 8)) for split in ("validation", "test")}


def assert_same_batches(a, b):
  assert type(a) is type(b)
  if isinstance(a, dict):
    assert a.keys() == b.keys()
    for k in a:
      assert_same_batches(a[k], b[k])
  elif isinstance(a, list) and a and not isinstance(a[0], str):
    assert len(a) == len(b)
    for x, y in zip(a, b):
      assert_same_batches(x, y)
  elif isinstance(a, np.ndarray):
    np.testing.assert_array_equal(a, b)
  else:
    assert a == b


def files(d: Path) -> dict[str, bytes]:
  """Every file under `d` (hidden ones too): relative path -> bytes."""
  return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*"))
          if p.is_file()}


def cached(workdir, split: str) -> Path:
  """The one directory of `split`'s token ids."""
  (where,) = Path(workdir, "data_cache").glob(f"{split}-*")
  return where


def run_train(args, *, file_size: int | None = None, env=None, timeout: float = 180):
  """train.py in a process of its own (with RLIMIT_FSIZE of `file_size` bytes if given)."""
  limit = [] if file_size is None else [
      sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
      f"({file_size}, {file_size})); os.execv(sys.argv[1], sys.argv[1:])"]
  return subprocess.run([*limit, sys.executable, str(ROOT / "train.py"), *args],
                        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, **(env or {})},
                        cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)


def one_error_line(p) -> str:
  """The last line of a refused run: exit 2, one `error:` line, no traceback."""
  assert p.returncode == 2, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), p.stderr[-3000:]
  return last


# A file system of its own (a tmpfs in a private user and mount namespace: `unshare`, no root
# needed) holding a copy of the workdir, or the workdir mounted read-only: bash's $1 the
# directory to mount on, $2 the workdir, $3 the free KiB (tmpfs); the command follows. The
# workdir is copied back from the tmpfs (or removed, if the run removed it) afterwards.
TMPFS = r"""set -u
disk=$1 work=$2 free=$3; shift 3
mount -t tmpfs -o size=4m tmpfs "$disk" || exit 99
if [ -d "$work" ]; then cp -a "$work" "$disk/w"; fi
head -c 8m /dev/zero > "$disk/filler" 2>/dev/null      # fails once the disk is full
truncate -s -"${free}k" "$disk/filler"
"$@"
rc=$?
rm -rf "$work"
if [ -d "$disk/w" ]; then cp -a "$disk/w" "$work"; fi
exit $rc
"""
READ_ONLY = r"""set -u
ro=$1; shift 3
mount --bind "$ro" "$ro" && mount -o remount,bind,ro "$ro" || exit 99
exec "$@"
"""


def in_namespace(script: str, where: Path, workdir: Path, free_kib: int, command,
                 timeout: float = 180):
  if not shutil.which("unshare"):
    pytest.skip("no unshare (util-linux)")
  p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script,
                      "mounts", str(where), str(workdir), str(free_kib), *command],
                     env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}, cwd=str(ROOT),
                     capture_output=True, text=True, timeout=timeout)
  if p.returncode == 99 or (p.returncode == 1 and "unshare" in p.stderr):
    pytest.skip(f"cannot mount a file system here: {p.stderr.strip()[-300:]}")
  return p


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return Path(dtest.write_corpus_dir(str(tmp_path_factory.mktemp("corpus") / "c"), SPLITS))


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
  """A workdir whose vocabulary and token ids were made as train.py makes them (no
  checkpoints), with the batches they give."""
  workdir = tmp_path_factory.mktemp("clean") / "w"
  cfg = config_of(train_args(corpus, workdir))
  ds = load(cfg, workdir)

  class Clean:
    pass
  out = Clean()
  out.workdir, out.cfg, out.epoch, out.evaluated = workdir, cfg, epoch(ds), evaluated(ds)
  out.cache = files(workdir / "data_cache")
  return out


def copy_of(clean, tmp_path, without=()) -> Path:
  workdir = tmp_path / "w"
  shutil.copytree(clean.workdir, workdir)
  for name in without:
    path = workdir / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
  return workdir


# --- the token cache ----------------------------------------------------------------------

def _change_id(to):
  def change(workdir):
    where = cached(workdir, "train")
    ids = np.memmap(where / "src.ids", np.uint16, "r+")   # the file the run maps
    offsets = np.load(where / "src.offsets.npy")
    short = np.flatnonzero(np.diff(offsets) < 10)      # pairs the length policy keeps
    i = int(short[len(short) // 2])
    ids[offsets[i]] = to(int(ids[offsets[i]]))
    ids.flush()
    return where
  return change


def _flip_offset_bit(workdir):
  where = cached(workdir, "train")
  offsets = np.load(where / "src.offsets.npy", mmap_mode="r+")
  offsets[100] ^= 1 << 20
  offsets.flush()
  return where


def _truncate(split, name, by):
  def truncate(workdir):
    where = cached(workdir, split)
    os.truncate(where / name, (where / name).stat().st_size - by)
    return where
  return truncate


def _delete(split, name):
  def delete(workdir):
    where = cached(workdir, split)
    (where / name).unlink()
    return where
  return delete


CHANGES = {
    "an id changed to another valid id": _change_id(lambda v: 4 + (v - 4 + 7) % 290),
    "an id past the vocabulary": _change_id(lambda v: 65535),
    "a bit flipped in the offsets": _flip_offset_bit,
    "the ids truncated by 2 bytes": _truncate("train", "tgt.ids", 2),
    "meta.json deleted": _delete("train", "meta.json"),
    "the validation offsets truncated": _truncate("validation", "src.offsets.npy", 4),
    "a test offsets file deleted": _delete("test", "tgt.offsets.npy"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_token_cache_is_set_aside_and_tokenized_again(clean, tmp_path, change):
  """Whatever changed in a cached split, the run says so in one line naming it, trains and
  evaluates on the ids of the text (the batches of a clean workdir), and leaves the cache
  as a clean run made it: the next run tokenizes nothing and says nothing."""
  workdir = copy_of(clean, tmp_path)
  where = CHANGES[change](workdir)
  ds, said = loaded_saying(clean.cfg, workdir)
  about = [line for line in said if "data_cache" in line]
  assert len(about) == 1, said
  assert about[0].startswith(f"{where}: ") and "tokenizing it again" in about[0], about
  assert "\n" not in about[0]
  assert_same_batches(epoch(ds), clean.epoch)
  assert_same_batches(evaluated(ds), clean.evaluated)
  assert files(workdir / "data_cache") == clean.cache   # nothing broken kept, nor aside
  again, said = loaded_saying(clean.cfg, workdir)
  assert not [line for line in said if "data_cache" in line], said
  assert again.stats["seconds"]["token ids"] == 0


def test_the_checks_of_a_split_being_built():
  """Before a split's ids are published: every id below the vocabulary's size, offsets that
  never decrease from 0, as many ids as the offsets say."""
  offsets = np.array([0, 3, 3, 7], np.uint32)
  token_ids.check_side("src", offsets, 7, 299, 300)   # whole: nothing said
  for args, says in (((offsets, 7, 300, 300), "id 300 in src.ids, past the vocabulary"),
                     ((offsets, 8, 5, 300), "src.ids holds 8 ids, its offsets say 7"),
                     ((np.array([0, 3, 2, 7]), 7, 5, 300), "offsets decrease"),
                     ((np.array([1, 3, 7]), 7, 5, 300), "offsets decrease")):
    with pytest.raises(token_ids.Broken, match=says):
      token_ids.check_side("src", *args)


def _past_the_vocabulary(workdir):
  """Every 50th id of the training sources set to 65535 (in every batch)."""
  where = cached(workdir, "train")
  ids = np.memmap(where / "src.ids", np.uint16, "r+")
  ids[::50] = 65535
  ids.flush()
  return where


@pytest.mark.slow
def test_a_run_on_a_changed_cache_trains_as_a_clean_one(corpus, tmp_path):
  """train.py resumed on a cache whose ids were set past the vocabulary (every rerun used to
  stop at a non-finite loss, until data_cache/ was deleted by hand) says so in one line and
  trains to the parameters of the clean run."""
  from seq2seq.load import load_workdir
  import jax
  first = tmp_path / "first"
  p = run_train(train_args(corpus, first))
  assert p.returncode == 0, p.stderr[-3000:]
  runs = {}
  for name, change in (("clean", None), ("changed", _past_the_vocabulary)):
    shutil.copytree(first, tmp_path / name)
    where = change(tmp_path / name) if change else None
    p = run_train(train_args(corpus, tmp_path / name, "--steps", "4"))
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "data_cache" in line]
    assert len(said) == (where is not None), p.stderr[-3000:]
    assert all(line.startswith(f"warning: {where}: ") for line in said), said
    runs[name] = jax.tree_util.tree_map(np.asarray, load_workdir(tmp_path / name, 4)[1])
  jax.tree_util.tree_map(np.testing.assert_array_equal, runs["changed"], runs["clean"])


# --- the disk -----------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["token ids", "vocabulary", "vocabulary's sample"])
@pytest.mark.parametrize("fault", ["file size limit", "full disk"])
def test_a_write_that_fails_is_one_line_and_leaves_the_workdir_as_it_was(
    corpus, clean, tmp_path, what, fault):
  """The token ids (the workdir has its vocabulary), vocab.model (the workdir has the token
  ids of that vocabulary) or the vocabulary's sample (a new workdir; in TMPDIR) cannot be
  written: RLIMIT_FSIZE ("File too large"), or a file system that is really full ("No
  space left on device"). One line naming the file, exit 2; no temporary file left, the
  workdir as it was (a new one: none)."""
  if what == "token ids":
    workdir = copy_of(clean, tmp_path, without=["data_cache"])
    size, free = 16 << 10, 16            # < the training ids (~40 KB); > the rest
  elif what == "vocabulary":
    workdir = copy_of(clean, tmp_path, without=["vocab.model", "vocab.json"])
    size, free = 128 << 10, 64           # < vocab.model (~245 KB); > the rest
  else:
    workdir = tmp_path / "w"
    size, free = 16 << 10, 16            # < the sample (~27 KB a side)
  before = files(workdir) if workdir.exists() else None
  if fault == "file size limit":
    at, tmp, why = workdir, tmp_path / "tmp", "File too large"
    tmp.mkdir()
    p = run_train(train_args(corpus, workdir), file_size=size, env={"TMPDIR": str(tmp)})
    assert not list(tmp.iterdir())
  else:
    disk = tmp_path / "disk"
    disk.mkdir()
    at, why = disk / "w", "No space left on device"
    tmp = disk / "tmp" if what == "vocabulary's sample" else tmp_path / "tmp"   # (full, or not)
    p = in_namespace(TMPFS, disk, workdir, free,
                     ["bash", "-c", 'mkdir "$0" && TMPDIR="$0" exec "$@"', str(tmp),
                      sys.executable, str(ROOT / "train.py"), *train_args(corpus, at)])
  file = {"token ids": at / "data_cache", "vocabulary": at / "vocab.model",
          "vocabulary's sample": f"{tmp}:"}[what]
  last = one_error_line(p)
  assert last.startswith(f"error: cannot write {file}") and why in last, last
  assert (files(workdir) if workdir.exists() else None) == before


def test_a_read_only_data_cache_is_refused_before_training(corpus, clean, tmp_path):
  """data_cache/ cannot be written (a read-only mount) and the test split is not cached:
  refused before anything runs (it used to train, save, then fail at the test split)."""
  workdir = copy_of(clean, tmp_path)
  shutil.rmtree(cached(workdir, "test"))
  before = files(workdir)
  p = in_namespace(READ_ONLY, workdir / "data_cache", workdir, 0,
                   [sys.executable, str(ROOT / "train.py"), *train_args(corpus, workdir)])
  last = one_error_line(p)
  assert last == f"error: {workdir / 'data_cache'} is not writable: Read-only file system", last
  assert files(workdir) == before


# --- the input files ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_an_input_that_is_not_a_regular_file_is_refused(corpus, tmp_path, kind):
  """A FIFO (the run used to hang, silent, holding the workdir's lock) or a device."""
  c = tmp_path / "c"
  shutil.copytree(corpus, c)
  (c / "train.en").unlink()
  if kind == "FIFO":
    os.mkfifo(c / "train.en")
  else:
    (c / "train.en").symlink_to("/dev/zero")
  try:
    p = run_train(train_args(c, tmp_path / "w"), timeout=60)
  except subprocess.TimeoutExpired:
    pytest.fail("train.py hung reading it")
  assert one_error_line(p) == (f"error: parallel_text: {c / 'train.en'} is not a regular "
                               f"file (a {kind}): give a file"), p.stderr[-2000:]
  assert not (tmp_path / "w").exists()


def test_cr_only_line_ends_are_said(tmp_path):
  """Lines ended by "\\r" alone read as one line each file (SentencePiece used to fail on
  it: "[!sentences_.empty()]")."""
  c = tmp_path / "c"
  c.mkdir()
  pairs = dtest.sentence_pairs(200, seed=5)
  (c / "train.en").write_bytes("".join(s + "\r" for s, _ in pairs).encode())
  (c / "train.fr").write_bytes("".join(t + "\r" for _, t in pairs).encode())
  cfg = config_of(train_args(c / "train", tmp_path / "w"))
  with pytest.raises(UserError) as e:
    load(cfg, tmp_path / "w")
  assert str(e.value) == (f"parallel_text: {c / 'train.en'} ends its lines with \\r alone "
                          f"(old Mac OS line ends): convert them to \\n, e.g. with "
                          f"tr '\\r' '\\n'"), str(e.value)
  assert not (tmp_path / "w").exists()


EDIT_WHILE_TRAINING_THE_VOCABULARY = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import seq2seq
from seq2seq import UserError
from seq2seq.data import load_dataset, vocabulary
corpus, workdir, keep_length = Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
train = vocabulary._train_in_child

def edit_then_train(*args, **kw):   # the file edited while the vocabulary trains
  lines = (corpus / "train.en").read_text().split("\n")
  lines[5] = lines[5].replace("a", "e") if keep_length else lines[5] + " and more words"
  (corpus / "train.en").write_text("\n".join(lines))
  return train(*args, **kw)

vocabulary._train_in_child = edit_then_train
cfg = seq2seq.Config(data=seq2seq.DataConfig(dataset="parallel_text",
    train_files=str(corpus / "train"), vocab_size=300),
    train=seq2seq.TrainConfig(batch_size=8, seq_len=32))
try:
  load_dataset(cfg, workdir, process_index=0, process_count=1, progress=False)
  print(json.dumps(None))
except UserError as e:
  print(json.dumps(str(e)))
"""


@pytest.mark.parametrize("optimized", [False, True], ids=["python", "python -O"])
@pytest.mark.parametrize("keep_length", [True, False], ids=["same length", "longer"])
def test_text_edited_while_the_run_reads_it_is_said(tmp_path, keep_length, optimized):
  """The training text changes after it was indexed, while the vocabulary trains (an edit
  that keeps the byte length was read silently; a longer one was a bare AssertionError, and
  nothing at all under python -O): one line naming it, and nothing left behind."""
  c = tmp_path / "c"
  dtest.write_moses(str(c / "train"), dtest.sentence_pairs(300, seed=6))
  p = subprocess.run([sys.executable, *(["-O"] if optimized else []), "-c",
                      EDIT_WHILE_TRAINING_THE_VOCABULARY, str(ROOT), str(c),
                      str(tmp_path / "w"), "1" if keep_length else "0"],
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-3000:]
  said = json.loads(p.stdout.strip().splitlines()[-1])
  assert said == (f"parallel_text: {c / 'train.en'} changed while this run read it: run "
                  f"again once it is written"), p.stdout[-2000:]
  assert not (tmp_path / "w").exists()


def test_text_changed_between_runs_is_said_and_old_caches_go(corpus, tmp_path):
  """A run resumed on training text that changed goes on with its vocabulary on the new
  pairs, and says so in one line; the token ids of the old text, which no run can use now,
  are removed (they used to stay, one set for every edit)."""
  c, workdir = tmp_path / "c", tmp_path / "w"
  shutil.copytree(corpus, c)
  cfg = config_of(train_args(c, workdir))
  load(cfg, workdir)
  old = cached(workdir, "train").name
  Workdir(workdir).write_config(cfg)                     # as a run that saved a checkpoint
  (workdir / "checkpoints" / "2").mkdir(parents=True)
  vocab = (workdir / "vocab.model").read_bytes()
  dtest.write_moses(str(c / "train"), dtest.sentence_pairs(950, seed=0))   # 50 more pairs
  ds, said = loaded_saying(cfg, workdir)
  assert ("the training text changed since this run's vocabulary was made (900 -> 950 "
          "pairs): from the step it resumes at, the run trains on the new text's pairs, "
          "with the vocabulary it has") in said, said
  assert not [line for line in said if "vocab.model" in line], said
  assert ds.num_examples("train") == 950
  assert (workdir / "vocab.model").read_bytes() == vocab
  assert {p.name for p in (workdir / "data_cache").iterdir()} == {
      cached(workdir, s).name for s in ("train", "validation", "test")}
  assert cached(workdir, "train").name != old


def test_a_vocab_size_sentencepiece_cannot_reach_is_said(clean, corpus, tmp_path):
  cfg = clean.cfg.replace(data=clean.cfg.data.replace(vocab_size=70000))
  ds, said = loaded_saying(cfg, tmp_path / "w")
  made = ds.tokenizer.vocab_size
  assert made < 2000
  assert [line for line in said if "vocab_size" in line] == [
      f"data.vocab_size 70000: the training text gave SentencePiece {made:,} ids, the "
      f"vocabulary's size (the model's vocab_size, in config.json)"], said


# --- the processes the data path starts --------------------------------------------------

LOAD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import seq2seq
from seq2seq.data import load_dataset, token_ids, vocabulary
if sys.argv[4] == "tokenizing":    # a quick vocabulary, then tokenizing in many chunks
  vocabulary.SPM_MAX_PAIRS, token_ids.PARALLEL_MIN, token_ids.CHUNK = 5000, 0, 500
cfg = seq2seq.Config(data=seq2seq.DataConfig(dataset="parallel_text",
    train_files=sys.argv[2], vocab_size=8000),
    train=seq2seq.TrainConfig(batch_size=8, seq_len=32))
load_dataset(cfg, sys.argv[3], process_index=0, process_count=1, progress=False)
"""


def random_words_corpus(prefix: Path, pairs: int, seed: int = 0) -> Path:
  """`pairs` pairs of 10 words drawn from 20,000 random ones: slow to learn pieces of."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, 9, 20000)
  letters = rng.integers(0, 26, int(lengths.sum())).astype(np.uint8) + ord("a")
  words = [letters[a:a + n].tobytes().decode()
           for a, n in zip((np.cumsum(lengths) - lengths).tolist(), lengths.tolist())]
  picks = rng.integers(0, len(words), (2, pairs, 10))
  for side, lang in enumerate(("en", "fr")):
    Path(f"{prefix}.{lang}").write_text(
        "".join(" ".join(words[i] for i in row) + "\n" for row in picks[side].tolist()))
  return prefix


def descendants(pid: int) -> list[psutil.Process]:
  try:
    return psutil.Process(pid).children(recursive=True)
  except psutil.NoSuchProcess:
    return []


def ended(p: psutil.Process) -> bool:
  try:
    return p.status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["vocabulary", "tokenizing"])
def test_the_data_paths_processes_end_with_the_run(tmp_path, phase):
  """A run killed (SIGKILL) while SentencePiece trains in its child process, or while its
  workers tokenize: every process it started ends within seconds (the tokenizing workers
  and multiprocessing's resource tracker, or the trainer, used to live on, orphaned), and
  nothing is left in TMPDIR (the vocabulary's sample used to stay there, named); the
  next run makes the same token ids as an uninterrupted one."""
  (tmp_path / "c").mkdir()
  (tmp_path / "tmp").mkdir()
  prefix = random_words_corpus(tmp_path / "c" / "train", 100_000)
  run = subprocess.Popen([sys.executable, "-c", LOAD, str(ROOT), str(prefix),
                          str(tmp_path / "w"), phase], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
  started = []
  try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
      started = descendants(run.pid)
      lines = [" ".join(p.cmdline()) for p in started if not ended(p)]
      if phase == "vocabulary" and any("seq2seq.data.vocabulary" in l for l in lines):
        break
      if phase == "tokenizing" and sum("spawn_main" in l for l in lines) >= 2:
        break
      time.sleep(0.05)
    else:
      pytest.fail(f"no {phase} process seen: {run.stderr.read()[-2000:]}")
    time.sleep(0.5)
    started = descendants(run.pid)
    run.send_signal(signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(map(ended, started)):
      time.sleep(0.1)
    alive = [" ".join(p.cmdline())[:120] for p in started if not ended(p)]
    assert not alive, alive
    assert not list((tmp_path / "tmp").iterdir())
  finally:
    run.kill()
    run.wait()
    for p in started:   # (what the old code left)
      try:
        p.kill()
      except psutil.NoSuchProcess:
        pass
  if phase == "tokenizing":
    again = subprocess.run([sys.executable, "-c", LOAD, str(ROOT), str(prefix),
                            str(tmp_path / "w"), phase], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [p for p in (tmp_path / "w" / "data_cache").iterdir()
                if p.name.startswith(".")]
    from seq2seq.data.tokenizer import Tokenizer
    tok = Tokenizer.load(str(tmp_path / "w" / "vocab.model"))
    ids = token_ids.load(cached(tmp_path / "w", "train"), tok.vocab_size)
    src = Path(f"{prefix}.en").read_text().split("\n")
    for i in (0, 1, 49_999, 99_999):
      assert ids.src[i].tolist() == tok.encode(src[i])
