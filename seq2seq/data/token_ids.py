"""Token ids on disk: each split's pairs tokenized once, in chunks over every core, and
stored in <workdir>/data_cache/ as flat arrays (uint16 where the vocabulary fits), memory-
mapped when read: a corpus of any size costs its offsets in memory, not its tokens.

    <workdir>/data_cache/<split>-<shard>-<key>/
        src.ids, tgt.ids                  the pairs' token ids end to end (no EOS), raw
        src.offsets.npy, tgt.offsets.npy  [n + 1] (uint32 where they fit, else int64): pair i
                                          is ids[offsets[i]:offsets[i+1]]
        src_pieces.npy                    int64 [vocab]: occurrences of each piece in sources
        meta.json                         the ids' dtype, the pairs, the format

The key names the vocabulary (its SHA-256), the split's pairs (`corpus.identity`) and the
shard. `tokenize` writes into a hidden directory beside it, which `publish` renames into
place once the data has passed load_dataset's checks: a reader finds a whole directory or
none, and a refused run leaves nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import socket
import sys
import uuid
from concurrent import futures
from pathlib import Path

import numpy as np

from seq2seq.data.pipeline import Ragged, gather_index
from seq2seq.data.tokenizer import Tokenizer

FORMAT = 1
WINDOW = 1 << 22          # tokens read at a time by TokenIds.read
_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())
CHUNK = 20_000            # pairs a task
PARALLEL_MIN = 100_000    # fewer pairs are tokenized in this process
BAR_DELAY = 1.0           # seconds before the progress bar shows (none for short work)


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """A split's (or shard's) token ids: `src`/`tgt` Ragged with memory-mapped `flat`."""
  src: Ragged
  tgt: Ragged
  src_pieces: np.ndarray    # int64 [vocab]: occurrences of each piece in the sources
  path: Path

  def read(self, side: str, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The tokens flat[starts[i]:starts[i] + lens[i]] of `side`, concatenated, for sorted
    `starts`: read from the file a window at a time, not through the mapping (whose pages
    would stay with this process)."""
    flat = getattr(self, side).flat
    out = np.empty(int(np.sum(lens)), flat.dtype)
    starts, lens = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
    at, a, size = 0, 0, flat.dtype.itemsize
    with open(self.path / f"{side}.ids", "rb") as f:
      while a < len(starts):
        b = a + max(1, int(np.searchsorted(starts[a:], starts[a] + WINDOW, side="right")))
        lo = int(starts[a])
        f.seek(lo * size)
        window = np.frombuffer(f.read((int((starts[a:b] + lens[a:b]).max()) - lo) * size),
                               flat.dtype)
        n = int(lens[a:b].sum())
        out[at:at + n] = window[gather_index(starts[a:b] - lo, lens[a:b])]
        at, a = at + n, b
    return out


def path(cache_dir: Path, tokenizer: Tokenizer, identity: str, split: str, shard: str) -> Path:
  key = hashlib.sha256(tokenizer.model_proto)
  key.update(f"{FORMAT}|{identity}|{split}|{shard}".encode())
  return Path(cache_dir) / f"{split}-{shard}-{key.hexdigest()[:16]}"


def load(where: Path) -> TokenIds | None:
  """The token ids stored at `where`, or None if there are none (or not whole)."""
  try:
    meta = json.loads((where / "meta.json").read_text())
    if meta.get("format") != FORMAT:
      return None
    sides = []
    for side in ("src", "tgt"):
      offsets = np.load(where / f"{side}.offsets.npy")
      if len(offsets) != meta["pairs"] + 1:
        return None
      flat = (np.memmap(where / f"{side}.ids", dtype=meta["dtype"], mode="r")
              if offsets[-1] else np.zeros(0, meta["dtype"]))
      if len(flat) != offsets[-1]:
        return None
      sides.append(Ragged(flat, offsets))
    return TokenIds(*sides, np.load(where / "src_pieces.npy"), Path(where))
  except (OSError, ValueError, KeyError, TypeError):
    return None


def publish(made: Path, where: Path) -> None:
  """Renames the directory `tokenize` wrote into place (already there: another host's, the
  same ids; this one is removed)."""
  try:
    os.replace(made, where)
  except OSError:
    if not (where / "meta.json").exists():
      raise
    shutil.rmtree(made, ignore_errors=True)


def staging(where: Path) -> Path:
  """A new hidden directory's path beside `where`, for `tokenize` to write into; named by
  this process (`remove_staging`)."""
  return where.parent / f".{where.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_HOST}"


def remove_staging(cache_dir: Path, pid: int | None = None) -> None:
  """Removes the directories `staging` named for process `pid` (default: any process of this
  host that has ended: what a killed run left)."""
  for p in Path(cache_dir).glob(f".*.tmp-*-{_HOST}") if Path(cache_dir).is_dir() else ():
    owner = p.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
    if owner.isdigit() and (int(owner) == pid if pid is not None else not _alive(int(owner))):
      shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:   # someone else's
    return True
  return True


def tokenize(corpus, split: str, indices, tokenizer: Tokenizer, into: Path, *,
             progress: bool = False, workers: int | None = None) -> TokenIds:
  """Tokenizes pairs `indices` (default: all) of `split` into the new directory `into`,
  CHUNK pairs at a time, over `workers` processes (default: one a core) when there are
  PARALLEL_MIN pairs or more."""
  from tqdm import tqdm
  n = corpus.num_examples(split)
  idx = np.arange(n) if indices is None else np.asarray(indices, np.int64)
  dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
  workers = workers or len(os.sched_getaffinity(0))
  into.mkdir(parents=True)
  lens = {"src": [np.zeros(1, np.int64)], "tgt": [np.zeros(1, np.int64)]}
  pieces = np.zeros(tokenizer.vocab_size, np.int64)
  bar = tqdm(total=len(idx), desc=f"tokenizing {split}", unit=" pairs", unit_scale=True,
             disable=not progress, delay=BAR_DELAY, file=sys.stderr)
  chunks = (corpus.read(split, idx[a:a + CHUNK]) for a in range(0, len(idx), CHUNK))
  with open(into / "src.ids", "wb") as src_f, open(into / "tgt.ids", "wb") as tgt_f:
    for src, src_lens, tgt, tgt_lens in _encoded(chunks, tokenizer, dtype,
                                                  workers if len(idx) >= PARALLEL_MIN else 1):
      src_f.write(src.tobytes())
      tgt_f.write(tgt.tobytes())
      lens["src"].append(src_lens)
      lens["tgt"].append(tgt_lens)
      pieces += np.bincount(src, minlength=len(pieces))[:len(pieces)]
      bar.update(len(src_lens))
  bar.close()
  for side, parts in lens.items():
    offsets = np.cumsum(np.concatenate(parts))
    np.save(into / f"{side}.offsets.npy",
            offsets.astype(np.uint32) if offsets[-1] < 1 << 32 else offsets)
  np.save(into / "src_pieces.npy", pieces)
  (into / "meta.json").write_text(json.dumps(
      {"format": FORMAT, "dtype": np.dtype(dtype).name, "pairs": int(len(idx)), "split": split,
       "vocab_size": tokenizer.vocab_size}))
  return load(into)


def _encoded(chunks, tokenizer: Tokenizer, dtype, workers: int):
  """(src ids, src lengths, tgt ids, tgt lengths) of each chunk of (sources, targets), in
  order: in this process, or over `workers` processes with a few chunks in flight."""
  if workers <= 1:
    for src, tgt in chunks:
      yield _encode(tokenizer, src, tgt, dtype)
    return
  ctx = multiprocessing.get_context("spawn")   # (forking a process that runs JAX is unsafe)
  with futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                                   initargs=(tokenizer.model_proto,
                                             tokenizer.lowercase_source)) as pool:
    pending = []
    for chunk in itertools.chain(chunks, [None]):
      if chunk is not None:
        pending.append(pool.submit(_encode_in_worker, *chunk, dtype))
      while pending and (chunk is None or len(pending) > 2 * workers):
        yield pending.pop(0).result()


def _encode(tokenizer: Tokenizer, src: list[str], tgt: list[str], dtype, threads: int = -1):
  src_ids = tokenizer.encode_batch([tokenizer.normalize_source(s) for s in src], threads)
  tgt_ids = tokenizer.encode_batch(tgt, threads)
  return (*_flat(src_ids, dtype), *_flat(tgt_ids, dtype))


def _flat(seqs: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
  lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
  return np.fromiter(itertools.chain.from_iterable(seqs), dtype, int(lens.sum())), lens


_worker_tokenizer: Tokenizer | None = None


def _start_worker(model_proto: bytes, lowercase_source: bool) -> None:
  global _worker_tokenizer
  _worker_tokenizer = Tokenizer(model_proto, lowercase_source=lowercase_source)


def _encode_in_worker(src: list[str], tgt: list[str], dtype):
  return _encode(_worker_tokenizer, src, tgt, dtype, threads=1)
