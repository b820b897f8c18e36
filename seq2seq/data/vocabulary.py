"""The vocabulary: a SentencePiece model trained on a sample of the training pairs, kept in
the workdir (<workdir>/vocab.model) with a record of what it was built from (vocab.json:
the training data's identity, the SentencePiece settings, its SHA-256).

A stored vocabulary is reused only if it was built from the same data and settings, or if a
run (config.json) already depends on it. Process 0 trains it; the other hosts read the file
once the hosts agreed that it is there. SentencePiece trains in a child process: its memory (~24 bytes a character of the
sample for the unigram model) is the system's again when it ends, and its log drives a
progress bar. The sample holds at most SPM_MAX_PAIRS pairs and SPM_MAX_BYTES of text.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import warnings

import numpy as np

from seq2seq.config import Config
from seq2seq.data.files import atomic_write, cannot_write
from seq2seq.data.tokenizer import Tokenizer, normalize_source
from seq2seq.errors import UserError
from seq2seq.workdir import Workdir

NUMBERS_MAX_VOCAB = 1024      # the numbers task needs ~370 ids (260 are specials + bytes)
SPM_MAX_PAIRS = 500_000       # SentencePiece trains on at most this many training pairs...
SPM_MAX_BYTES = 80_000_000    # ...holding at most this much text (~2 GB of its memory)
_CHUNK = 50_000               # pairs read at a time
BAR_DELAY = 1.0               # seconds before the progress bar shows (none for short work)


def vocab_size(cfg: Config) -> int:
  d = cfg.data
  return min(d.vocab_size, NUMBERS_MAX_VOCAB) if d.dataset == "numbers" else d.vocab_size


def sample_size(corpus) -> tuple[int, bool]:
  """(pairs in the sample, whether SPM_MAX_BYTES made it smaller than SPM_MAX_PAIRS would)."""
  n = corpus.num_examples("train")
  by_pairs = min(n, SPM_MAX_PAIRS)
  text = corpus.text_bytes("train")
  by_bytes = math.floor(SPM_MAX_BYTES * n / text) if text else by_pairs
  return min(by_pairs, by_bytes), by_bytes < by_pairs


def built_from(cfg: Config, corpus) -> dict:
  """What a vocabulary trained for `cfg` is built from: the training split's identity and
  the SentencePiece settings."""
  d = cfg.data
  if d.dataset == "parallel_text":   # the train files' bytes (not the other splits')
    data = f"parallel_text train files sha256 {corpus.files_sha256('train')[:16]}"
  else:
    data = corpus.name
  record = {"training_data": data, "training_pairs": corpus.num_examples("train"),
            "source_key": corpus.src_key, "target_key": corpus.tgt_key,
            "lowercase_source": d.lowercase_source,
            "vocab_size": vocab_size(cfg), "spm_model_type": d.spm_model_type,
            "character_coverage": d.character_coverage, "max_pairs": SPM_MAX_PAIRS}
  if sample_size(corpus)[1]:
    record["max_bytes"] = SPM_MAX_BYTES
  return record


# What a vocabulary's record says of the training text alone (not of the settings).
_THE_TEXT = {"training_data", "training_pairs", "max_bytes"}


def _read_record(wd: Workdir) -> dict | None:
  try:
    record = json.loads(wd.vocab_record.read_text())
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def _stored(wd: Workdir, record_now: dict) -> tuple[bytes | None, str]:
  """(the stored vocabulary if this run may use it, why it may not: "" if it may)."""
  path = wd.vocab
  if not path.exists():
    return None, ""
  try:
    proto = path.read_bytes()
  except OSError as e:
    raise UserError(f"cannot read {path}: {e.strerror or e}") from None
  record = _read_record(wd)
  of_a_run = wd.config.exists()   # its checkpoints depend on it
  if record is not None and record.get("sha256") != hashlib.sha256(proto).hexdigest():
    why = "it is not the file vocab.json describes"
  elif record is None:
    why = "" if of_a_run else "nothing records what it was built from"
  elif record.get("built_from") != record_now:
    was = record.get("built_from") or {}
    changed = [k for k in {**was, **record_now} if was.get(k) != record_now.get(k)]
    if of_a_run and set(changed) <= _THE_TEXT:   # the run goes on: what changes, said
      warnings.warn(f"the training text changed since this run's vocabulary was made "
                    f"({was.get('training_pairs')} -> {record_now['training_pairs']} pairs): "
                    f"from the step it resumes at, the run trains on the new text's pairs, "
                    f"with the vocabulary it has")
      return proto, ""
    diff = [f"{k}: {was.get(k)!r} -> {record_now.get(k)!r}" for k in changed]
    why = f"it was built from other data or settings ({'; '.join(diff[:2])})"
  else:
    why = ""
  if why and of_a_run:   # kept, said: the run's embeddings are of these pieces
    warnings.warn(f"{path}: {why}; kept, as the run's checkpoints depend on it")
    why = ""
  return (None if why else proto), why


def vocabulary(cfg: Config, wd: Workdir, corpus, process_index: int = 0,
               progress: bool = False) -> tuple[Tokenizer, bool, dict]:
  """(the tokenizer, whether it is new and still to be written by `write`, its record).
  Process 0 reuses the stored vocabulary or trains one; the others read the one process 0
  stored (after the hosts agreed that it did: seq2seq.hosts)."""
  record = built_from(cfg, corpus)
  path = wd.vocab
  if process_index != 0:
    with warnings.catch_warnings():   # (process 0 says what it decided)
      warnings.simplefilter("ignore")
      proto, why = _stored(wd, record)
    if proto is None or why:
      raise UserError(f"{path}: {why or 'not there'}, though process 0 stored the run's "
                      f"vocabulary: is the workdir on a file system every host shares?")
    return Tokenizer(proto, str(path)), False, record
  proto, why = _stored(wd, record)
  if proto is not None:
    try:
      return Tokenizer(proto, str(path)), False, record
    except (RuntimeError, UserError) as e:
      if wd.config.exists():
        raise UserError(f"{path} is not a readable SentencePiece model ({e})") from None
      why = "it is not a readable SentencePiece model"
  if why:
    warnings.warn(f"{path}: {why}; no run uses it: training a new one in its place")
  tokenizer = train(corpus, record, progress)
  if tokenizer.vocab_size < record["vocab_size"] and cfg.data.dataset != "numbers":
    warnings.warn(f"data.vocab_size {record['vocab_size']}: the training text gave "
                  f"SentencePiece {tokenizer.vocab_size:,} ids, the vocabulary's size (the "
                  f"model's vocab_size, in config.json)")
  return tokenizer, True, record


def write(wd: Workdir, tokenizer: Tokenizer, record: dict) -> None:
  """vocab.model, then the record that vouches for it (a reader that finds the record finds
  its vocabulary)."""
  atomic_write(str(wd.vocab), tokenizer.model_proto)
  data = {"sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(), "built_from": record}
  atomic_write(str(wd.vocab_record), (json.dumps(data, indent=2) + "\n").encode())


# --- training -------------------------------------------------------------------------------

def train(corpus, record: dict, progress: bool = False) -> Tokenizer:
  """SentencePiece trained on the sample of the training pairs: every source (normalised),
  then every target, of pairs sorted(rng(0).choice(n, k)) (all pairs when k = n)."""
  n = corpus.num_examples("train")
  k, _ = sample_size(corpus)
  idx = np.arange(n) if k >= n else np.sort(
      np.random.default_rng(0).choice(n, k, replace=False))
  # The sample is two files with no name (TMPDIR's, unlinked as they are made) which the
  # child reads by descriptor: a run killed, even with SIGKILL, leaves nothing on disk.
  where = tempfile.gettempdir()
  try:
    src_f = tempfile.TemporaryFile(prefix="seq2seq-vocabulary-")
    tgt_f = tempfile.TemporaryFile(prefix="seq2seq-vocabulary-")
  except OSError as e:
    raise cannot_write(where, e, "for the vocabulary's sample: set TMPDIR to a writable "
                       "directory with room") from None
  with src_f, tgt_f:
    try:
      for a in range(0, len(idx), _CHUNK):
        src, tgt = corpus.read("train", idx[a:a + _CHUNK])
        _write_records(src_f, (normalize_source(x, record["lowercase_source"]) for x in src))
        _write_records(tgt_f, tgt)
      src_f.flush()
      tgt_f.flush()
    except OSError as e:
      for f in (src_f, tgt_f):
        f.raw.close()   # (closing them would write what their buffers hold, and fail again)
      raise cannot_write(where, e, "the vocabulary's sample, removed again: free space there, "
                         "or set TMPDIR to a directory on a disk with room") from None
    # The text's line index (16 bytes a line) goes while the trainer's child holds its
    # sample (~1.8 GB), the largest moment of a first run, back to the system (train.py's
    # malloc keeps what is freed): tokenizing indexes the text again (at 36M pairs 1.15 GB
    # let go, 12 s to index again)
    corpus.release("train")
    from seq2seq.kernels import malloc   # (here: the child that trains imports no JAX)
    malloc.release_freed_memory()
    args = Tokenizer.trainer_args(record["vocab_size"], record["spm_model_type"],
                                  record["character_coverage"])
    return Tokenizer(_train_in_child([src_f, tgt_f], args, progress))


def _write_records(f, texts) -> None:
  for text in texts:
    b = text.encode("utf-8")
    f.write(struct.pack("<I", len(b)))
    f.write(b)


def _read_records(fds):
  for fd in fds:
    with os.fdopen(fd, "rb") as f:
      f.seek(0)
      while head := f.read(4):
        yield f.read(struct.unpack("<I", head)[0]).decode("utf-8")


# SentencePiece's log lines that say how far training is (as a share of the whole).
_LOADED = re.compile(r"Loaded all (\d+) sentences")
_SEEDS = re.compile(r"Initialized (\d+) seed")
_EM = re.compile(r"EM sub_iter=\d+ size=(\d+)")
_BPE = re.compile(r"Added: freq=\d+ size=(\d+)")


def _train_in_child(sample: list, args: dict, progress: bool) -> bytes:
  """Runs this module as a child process on the sample's open files, which it inherits (it
  ends with this one); the model's bytes, which it writes to its standard output."""
  from tqdm import tqdm
  fds = [f.fileno() for f in sample]
  cmd = [sys.executable, "-m", "seq2seq.data.vocabulary", str(os.getpid()), json.dumps(args),
         *map(str, fds)]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
       *filter(None, [os.environ.get("PYTHONPATH")])])}
  bar = tqdm(total=100, desc="vocabulary", unit="%", disable=not progress, delay=BAR_DELAY,
             bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]",
             file=sys.stderr)
  seeds, target, last, model = 0, args["vocab_size"], [], []
  with subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                        pass_fds=fds) as p:
    reader = threading.Thread(target=lambda: model.append(p.stdout.read()), daemon=True)
    reader.start()
    err = io.TextIOWrapper(p.stderr, errors="replace")
    for line in err:
      last = (last + [line.strip()])[-5:]
      done = None
      if _LOADED.search(line):
        done = 5
      elif m := _SEEDS.search(line):
        seeds, done = int(m.group(1)), 40
      elif (m := _EM.search(line)) and seeds > target:
        size = max(int(m.group(1)), target)
        done = 40 + 58 * math.log(seeds / size) / math.log(seeds / target)
      elif m := _BPE.search(line):
        done = 10 + 88 * int(m.group(1)) / target
      if done is not None and done > bar.n:
        bar.update(done - bar.n)
    reader.join()
    err.close()
  if p.returncode == 0:
    bar.update(100 - bar.n)
  bar.close()
  if p.returncode != 0:
    why = next((l for l in reversed(last) if l.startswith("error: ")), f"exit {p.returncode}")
    raise UserError(f"SentencePiece training failed: {why.removeprefix('error: ')}")
  return model[0]


def _main(parent: str, args: str, *sample: str) -> int:
  from seq2seq.data.files import end_with_parent
  end_with_parent(int(parent))   # a killed run leaves no trainer behind
  out = os.fdopen(os.dup(1), "wb")   # the model; anything else written to standard output
  os.dup2(2, 1)                      # goes to standard error
  import sentencepiece as spm
  try:
    spm.SentencePieceTrainer.train(sentence_iterator=_read_records(map(int, sample)),
                                   model_writer=out,
                                   **{**json.loads(args), "minloglevel": 0})
  except RuntimeError as e:
    print(f"error: {(str(e).strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
    return 3
  out.close()
  return 0


if __name__ == "__main__":
  sys.exit(_main(*sys.argv[1:]))
