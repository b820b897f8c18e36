"""The data path on several hosts. Two train.py processes as two hosts of one run
(jax.distributed over loopback, tests/hosts.py): a refusal on either host, made while the
other waits for it (process 0's vocabulary) or once both have made their shards (one host's
shard all too long), ends both within seconds, one line each and exit 2, no traceback and no
C++ stack trace, and leaves no workdir. A run on another number of hosts gathers its shards
from the token ids the last one stored, byte for byte what tokenizing them writes."""
import filecmp
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import seq2seq
from hosts import run_two_hosts
from seq2seq.data import load_dataset
from seq2seq.data import testing as dtest
from seq2seq.workdir import Workdir

ROOT = Path(__file__).resolve().parent.parent


def _args(corpus: Path, workdir: Path, *extra: str) -> list[str]:
  return [str(ROOT / "train.py"), "--workdir", str(workdir), "--config", "tiny",
          "--train_files", str(corpus), "--steps", "2", "--no_progress",
          "--config.model.d_model=32", "--config.model.num_heads=2",
          "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
          "--config.model.d_ff=64", "--config.model.max_len=64",
          "--config.data.vocab_size=300", "--config.data.max_src_len=32",
          "--config.data.max_tgt_len=32", "--config.train.batch_size=8",
          "--config.train.seq_len=32", "--config.train.eval_every=1000", *extra]


def _two_hosts(args: list[str]) -> list[tuple]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", SEQ2SEQ_COMPILE_CACHE="off",
             SEQ2SEQ_DIST_TIMEOUT="60", SEQ2SEQ_HEARTBEAT_TIMEOUT="100")
  return run_two_hosts([sys.executable, *args], env, timeout=120, check=False)


def _each_said_one_line(outs, lines: list[str]) -> None:
  """Each host exited 2 having written `lines[i]` and nothing else (no traceback, no C++
  stack trace), within seconds of the other."""
  for (_, err, code, _), line in zip(outs, lines):
    assert (code, err) == (2, f"error: {line}\n"), (code, err[-3000:])
  assert abs(outs[0][3] - outs[1][3]) < 5, [t for *_, t in outs]


def test_process_0_refusing_the_vocabulary_stops_the_waiting_host_at_once(tmp_path):
  """SentencePiece cannot make 262 ids of this text (its characters need more): process 0,
  which trains the vocabulary, refuses the run while process 1 waits for it. Before, process
  1 polled for vocab.model for up to an hour."""
  corpus = dtest.write_corpus_dir(str(tmp_path / "corpus"))
  work = tmp_path / "w"
  outs = _two_hosts(_args(corpus, work, "--config.data.vocab_size=262"))
  said = outs[0][1].removeprefix("error: ").strip()
  assert said.startswith("SentencePiece training failed: ") and "262" in said, said
  _each_said_one_line(outs, [said, f"process 0 stopped the run: {said}"])
  assert not work.exists()


def _half_too_long(d: Path) -> Path:
  """Train pairs alternately short and longer than 32 tokens: shard 1 of 2 (every odd pair)
  holds none that fits."""
  short = dtest.sentence_pairs(200, seed=1, max_words=3)
  long = [(" ".join([s] * 40), " ".join([t] * 40))
          for s, t in dtest.sentence_pairs(200, seed=2, max_words=6)]
  dtest.write_moses(str(d / "train"), [p for two in zip(short, long) for p in two])
  dtest.write_moses(str(d / "validation"), short[:10])
  dtest.write_moses(str(d / "test"), short[10:20])
  return d


def test_one_host_refusing_its_shard_stops_every_host_and_publishes_nothing(tmp_path):
  """Process 1's shard holds no pair that fits; process 0's is fine. Before, process 1
  stopped alone and process 0 went on to its first step, where it waited for process 1
  until JAX's heartbeat aborted it with a C++ stack trace, its workdir left behind."""
  corpus = _half_too_long(tmp_path / "corpus")
  work = tmp_path / "w"
  outs = _two_hosts(_args(corpus, work))
  said = ("all 200 training pairs of shard 1 are longer than the limits (source 32, target "
          "32 tokens with EOS); raise max_src_len/max_tgt_len/seq_len or use "
          "length_policy=truncate")
  _each_said_one_line(outs, [f"process 1 stopped the run: {said}", said])
  assert not work.exists()


def test_a_workdir_in_use_is_one_line_on_every_host(tmp_path):
  """Another run holds the workdir: process 0, which takes its lock for the hosts, refuses,
  and both hosts leave jax.distributed together (the lock file is the other run's)."""
  corpus = dtest.write_corpus_dir(str(tmp_path / "corpus"))
  work = tmp_path / "w"
  work.mkdir()
  lock = Workdir(work).lock()
  try:
    outs = _two_hosts(_args(corpus, work))
  finally:
    lock.release()
  said = outs[0][1].removeprefix("error: ").strip()
  assert said.startswith(f"workdir {work} is in use by another run (host "), said
  _each_said_one_line(outs, [said, f"process 0 stopped the run: {said}"])
  assert sorted(p.name for p in work.iterdir()) == []


def test_a_refusal_every_host_makes_before_they_agree_on_anything(tmp_path):
  """Flags that contradict each other: every host refuses them before its first agreement,
  and they leave jax.distributed together."""
  corpus = dtest.write_corpus_dir(str(tmp_path / "corpus"))
  outs = _two_hosts(_args(corpus, tmp_path / "w", "--config.train.steps=3"))
  said = "give --steps or --config.train.steps, not both"
  _each_said_one_line(outs, [said, said])
  assert not (tmp_path / "w").exists()


# --- another number of hosts ----------------------------------------------------------------

def _cfg(corpus: str) -> seq2seq.Config:
  return seq2seq.Config(
      data=seq2seq.DataConfig(dataset="parallel_text", train_files=corpus, vocab_size=300),
      train=seq2seq.TrainConfig(batch_size=12, seq_len=32))


def _load(corpus: str, workdir: Path, hosts: int) -> list:
  """Each host's dataset of a run on `hosts` hosts (process 0 first: it makes the
  vocabulary the others read)."""
  return [load_dataset(_cfg(corpus), str(workdir), process_index=p, process_count=hosts,
                       progress=False) for p in range(hosts)]


def _same_files(a: Path, b: Path) -> None:
  names = sorted(p.name for p in (a / "data_cache").iterdir())
  assert names == sorted(p.name for p in (b / "data_cache").iterdir())
  for name in names:
    files = sorted(p.name for p in (a / "data_cache" / name).iterdir())
    assert files == sorted(p.name for p in (b / "data_cache" / name).iterdir()), name
    for f in files:
      assert filecmp.cmp(a / "data_cache" / name / f, b / "data_cache" / name / f,
                         shallow=False), (name, f)


@pytest.mark.filterwarnings("ignore:.*training pairs are longer")
def test_another_host_count_gathers_its_shards_from_the_stored_ids(tmp_path):
  """Runs on 2, then 3, 4 and 1 hosts in one workdir (one shard a host): each count after
  the first gathers its shards from the ids stored before (2 of 3's shards come from both
  stored shards, interleaved), and every file is the one a workdir that tokenized each count
  itself holds."""
  corpus = dtest.write_corpus_dir(str(tmp_path / "corpus"), sizes=(
      ("train", 1001), ("validation", 10), ("test", 10)))
  gathered, tokenized = tmp_path / "gathered", tmp_path / "tokenized"
  assert all(ds.regrouped == {} for ds in _load(corpus, gathered, 2))
  for hosts in (3, 4, 1):
    got = _load(corpus, gathered, hosts)
    assert [ds.regrouped for ds in got] == [{f"{p}of{hosts}": 2} for p in range(hosts)]
  for hosts in (2, 3, 4, 1):
    assert all(ds.regrouped == {} for ds in _load(corpus, tokenized / str(hosts), hosts))
  for hosts in (3, 4, 1):   # the files of every count, in one workdir each
    for d in (tokenized / str(hosts)).glob("data_cache/*"):
      if not (tokenized / "2" / "data_cache" / d.name).exists():
        d.rename(tokenized / "2" / "data_cache" / d.name)
  _same_files(gathered, tokenized / "2")


@pytest.mark.filterwarnings("ignore:.*training pairs are longer")
def test_stored_ids_that_changed_on_disk_are_not_gathered(tmp_path):
  """A byte of the stored ids changed: a run on another host count tokenizes its shards
  (the same files as a clean workdir's), nothing of the changed ones is copied."""
  corpus = dtest.write_corpus_dir(str(tmp_path / "corpus"))
  work, clean = tmp_path / "w", tmp_path / "clean"
  _load(corpus, work, 1)
  ids = next((work / "data_cache").glob("train-0of1-*")) / "src.ids"
  flat = np.fromfile(ids, np.uint16)
  flat[5] = (flat[5] + 1) % 290 + 4
  flat.tofile(ids)
  assert [ds.regrouped for ds in _load(corpus, work, 2)] == [{}, {}]
  _load(corpus, clean, 2)
  for shard in ("0of2", "1of2"):
    [a] = (work / "data_cache").glob(f"train-{shard}-*")
    [b] = (clean / "data_cache").glob(f"train-{shard}-*")
    for f in ("src.ids", "tgt.ids", "src.offsets.npy", "meta.json"):
      assert filecmp.cmp(a / f, b / f, shallow=False), (shard, f)
