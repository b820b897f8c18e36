"""Token ids on disk: each split's pairs tokenized once, in chunks over every core, and
stored in <workdir>/data_cache/ as flat arrays (uint16 where the vocabulary fits), memory-
mapped when read: a corpus of any size costs its offsets in memory, not its tokens.

    <workdir>/data_cache/<split>-<shard>-<key>/
        src.ids, tgt.ids                  the pairs' token ids end to end (no EOS), raw
        src.offsets.npy, tgt.offsets.npy  [n + 1] (uint32 where they fit, else int64): pair i
                                          is ids[offsets[i]:offsets[i+1]]
        src_pieces.npy                    int64 [vocab]: occurrences of each piece in sources
        meta.json                         the ids' dtype, the pairs, what they were made from
                                          and each file's SHA-256

The key names the vocabulary (its SHA-256), the split's pairs (`corpus.identity`) and the
shard. A training shard missing from the cache is gathered from the ids of another count of
shards where they are stored (`regroup`: a run on another number of hosts, one shard a host,
copies its shards out of the last run's instead of tokenizing again). `tokenize` and
`regroup` write into a hidden directory beside it, which `publish` renames into place once
the data has passed load_dataset's checks: a reader finds a whole directory or none, and a
refused run leaves nothing.

Trusted as the checkpoints are: before a split is published its ids are checked (each below
the vocabulary's size, offsets that never decrease, as many ids as the offsets say) and the
SHA-256 of each file recorded; `load` checks them all again, reading the files once, and
raises `Broken` for a directory that is not the one that was written. Nothing of it is used:
the caller sets it aside (`set_aside`) and tokenizes the split again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import socket
import sys
import uuid
import warnings
from concurrent import futures
from pathlib import Path

import numpy as np

from seq2seq.data.files import cannot_write, end_with_parent
from seq2seq.data.ragged import Ragged, gather_index
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.errors import UserError

FORMAT = 2                # 2: each file's SHA-256 in meta.json
WINDOW = 1 << 22          # tokens read at a time by TokenIds.read
_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())
CHUNK = 20_000            # pairs a task
PARALLEL_MIN = 100_000    # fewer pairs are tokenized in this process
BAR_DELAY = 1.0           # seconds before the progress bar shows (none for short work)
_BLOCK = 1 << 24          # bytes read at a time when a file is checked
SIDES = ("src", "tgt")
FILES = ("src.ids", "tgt.ids", "src.offsets.npy", "tgt.offsets.npy", "src_pieces.npy")


class Broken(Exception):
  """A cached split that is not whole, or not what was written: why, in a few words."""


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


def vocabulary_key(tokenizer: Tokenizer) -> str:
  return hashlib.sha256(tokenizer.model_proto).hexdigest()[:16]


def path(cache_dir: Path, tokenizer: Tokenizer, identity: str, split: str, shard: str) -> Path:
  key = hashlib.sha256(tokenizer.model_proto)
  key.update(f"{FORMAT}|{identity}|{split}|{shard}".encode())
  return Path(cache_dir) / f"{split}-{shard}-{key.hexdigest()[:16]}"


# --- checks ---------------------------------------------------------------------------------

def _scan(path: Path, dtype=None) -> tuple[str, int, int]:
  """(SHA-256, items, largest item) of a file read a block at a time (items and the largest
  only for `dtype`, the ids' type; else bytes and -1). Not through a mapping: its pages
  would stay with this process."""
  digest, size, top = hashlib.sha256(), 0, -1
  buf = bytearray(_BLOCK)
  with open(path, "rb", buffering=0) as f:
    while n := f.readinto(buf):
      block = memoryview(buf)[:n]
      digest.update(block)
      if dtype is not None and n:
        top = max(top, int(np.frombuffer(block, dtype, n // np.dtype(dtype).itemsize).max()))
      size += n
  return digest.hexdigest(), size // (np.dtype(dtype).itemsize if dtype is not None else 1), top


def _scan_all(where: Path, dtype) -> dict[str, tuple[str, int, int]]:
  """`_scan` of each of FILES, two at a time (hashing lets go of the interpreter)."""
  def one(name):
    try:
      return name, _scan(where / name, dtype if name.endswith(".ids") else None)
    except FileNotFoundError:
      raise Broken(f"{name} is missing") from None
    except OSError as e:
      raise Broken(f"{name} cannot be read ({e.strerror or e})") from None
  with futures.ThreadPoolExecutor(2) as pool:
    return dict(pool.map(one, FILES))


def check_side(side: str, offsets: np.ndarray, ids: int, largest: int, vocab_size: int):
  """A side's arrays are whole: offsets from 0 that never decrease, as many ids as they say,
  each below the vocabulary's size (Broken if not)."""
  if len(offsets) == 0 or offsets[0] != 0 or not np.all(offsets[1:] >= offsets[:-1]):
    raise Broken(f"{side} offsets decrease or do not start at 0")
  if int(offsets[-1]) != ids:
    raise Broken(f"{side}.ids holds {ids} ids, its offsets say {int(offsets[-1])}")
  if largest >= vocab_size:
    raise Broken(f"id {largest} in {side}.ids, past the vocabulary ({vocab_size} ids)")


def load(where: Path, vocab_size: int) -> TokenIds | None:
  """The token ids stored at `where`, checked; None if there are none; Broken if they are
  not whole or not the files that were written (each file's SHA-256)."""
  where = Path(where)
  if not where.is_dir():
    return None
  try:
    meta = json.loads((where / "meta.json").read_text())
  except FileNotFoundError:
    raise Broken("meta.json is missing") from None
  except (OSError, ValueError) as e:
    raise Broken(f"meta.json cannot be read ({getattr(e, 'strerror', None) or e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise Broken("written by another version")
  try:
    dtype, pairs, sums = np.dtype(meta["dtype"]), int(meta["pairs"]), dict(meta["sha256"])
  except (KeyError, TypeError, ValueError):
    raise Broken("meta.json is not whole") from None
  if meta.get("vocab_size") != vocab_size:
    raise Broken(f"made for a vocabulary of {meta.get('vocab_size')} ids, not {vocab_size}")
  scans = _scan_all(where, dtype)
  for name in FILES:
    if scans[name][0] != sums.get(name):
      raise Broken(f"{name} is not the file that was written (its SHA-256 differs)")
  return _opened(where, dtype, pairs, scans, vocab_size)


def _opened(where: Path, dtype, pairs: int, scans: dict, vocab_size: int) -> TokenIds:
  """The token ids of the files `_scan_all` read (Broken if they are not whole)."""
  sides = []
  try:
    for side in SIDES:
      offsets = np.load(where / f"{side}.offsets.npy")
      if offsets.ndim != 1 or len(offsets) != pairs + 1:
        raise Broken(f"{side}.offsets.npy holds {len(offsets)} offsets for {pairs} pairs")
      _, ids, largest = scans[f"{side}.ids"]
      check_side(side, offsets, ids, largest, vocab_size)
      flat = (np.memmap(where / f"{side}.ids", dtype=dtype, mode="r")
              if ids else np.zeros(0, dtype))
      sides.append(Ragged(flat, offsets))
    pieces = np.load(where / "src_pieces.npy")
  except (OSError, ValueError) as e:
    raise Broken(f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
  if pieces.shape != (vocab_size,):
    raise Broken(f"src_pieces.npy holds {pieces.shape} counts for {vocab_size} ids")
  return TokenIds(*sides, pieces, where)


# --- the directories -----------------------------------------------------------------------

def publish(made: Path, where: Path, vocab_size: int) -> None:
  """Renames the directory `tokenize` wrote into place. One already there is another
  host's: kept if it is whole (the same ids; this one is removed), else set aside."""
  for _ in range(3):
    try:
      os.replace(made, where)
      return
    except OSError:
      if not where.exists():
        raise
    try:
      if load(where, vocab_size) is not None:
        shutil.rmtree(made, ignore_errors=True)
        return
    except Broken:
      set_aside(where)
  os.replace(made, where)


def set_aside(where: Path) -> None:
  """Moves a broken directory out of readers' way (a name `remove_staging` knows), then
  removes it."""
  aside = staging(where)
  try:
    os.replace(where, aside)
  except FileNotFoundError:   # another host set it aside first
    return
  except OSError as e:
    raise cannot_write(where, e) from None
  shutil.rmtree(aside, ignore_errors=True)


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


def remove_unusable(cache_dir: Path, vocabulary: str, identities: dict[str, str]) -> list[str]:
  """Removes the published directories that no run of this workdir can use: made with
  another vocabulary (`vocabulary_key`), of text that is no longer a split's (`identities`:
  split -> `corpus.identity`), by another version, or not whole. Those of another shard
  count stay. Returns their names."""
  gone = []
  for p in sorted(Path(cache_dir).iterdir()) if Path(cache_dir).is_dir() else ():
    if p.name.startswith(".") or not p.is_dir():
      continue
    try:
      meta = json.loads((p / "meta.json").read_text())
      usable = (meta.get("format") == FORMAT and meta.get("vocabulary") == vocabulary
                and identities.get(meta.get("split")) == meta.get("identity"))
    except (OSError, ValueError, AttributeError):
      usable = False
    if not usable:
      shutil.rmtree(p, ignore_errors=True)
      gone.append(p.name)
  return gone


def replace_earlier_versions(cache_dir: Path, workdir, order_changes: bool) -> None:
  """Token ids of this format replace the data_cache/*.npz files earlier versions wrote:
  removed once the new ones are in place. Pairs of your own text came, in those versions,
  in TFDS's order: a run resumed from then (`order_changes`) takes them in the files'
  order, and says so."""
  old = sorted(Path(cache_dir).glob("*.npz"))
  if old and order_changes:
    warnings.warn(f"{workdir}: its training pairs were tokenized by an earlier version, in "
                  f"the order TFDS had stored them: from the step it resumes at, this run "
                  f"takes the same pairs in another order (the files')")
  for path in old:
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:   # someone else's
    return True
  return True


# --- tokenizing ----------------------------------------------------------------------------

def tokenize(corpus, split: str, indices, tokenizer: Tokenizer, into: Path, *,
             progress: bool = False, workers: int | None = None,
             published_as: Path | None = None, release: bool = False) -> TokenIds:
  """Tokenizes pairs `indices` (default: all) of `split` into the new directory `into`,
  CHUNK pairs at a time, over `workers` processes (default: one a core) when there are
  PARALLEL_MIN pairs or more; checks what it wrote and records each file's SHA-256. A file
  that cannot be written is one line (UserError) naming it as it will be published
  (`published_as`, default `into`). With `release`, the corpus forgets the split's line
  index once its last chunk is read, before the ids are gathered and checked."""
  n = corpus.num_examples(split)
  idx = np.arange(n) if indices is None else np.asarray(indices, np.int64)
  dtype = _dtype(tokenizer)
  workers = workers or len(os.sched_getaffinity(0))

  def chunks():
    for a in range(0, len(idx), CHUNK):
      yield corpus.read(split, idx[a:a + CHUNK])
    if release:
      corpus.release(split)
  encoded = _encoded(chunks(), tokenizer, dtype, workers if len(idx) >= PARALLEL_MIN else 1)
  return _write(into, encoded, len(idx), dtype, tokenizer, split, corpus.identity(split),
                f"tokenizing {split}", progress, Path(published_as or into))


def _dtype(tokenizer: Tokenizer):
  return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32


# --- another shard count's ids ----------------------------------------------------------------

REGROUP_CHUNK = 1 << 18   # pairs gathered at a time
_SHARD_NAME = re.compile(r"(?P<split>.+)-(?P<shard>\d+)of(?P<of>\d+)-[0-9a-f]{16}")


def stored_shards(cache_dir: Path, tokenizer: Tokenizer, identity: str, split: str, n: int,
                  shard: int, shards: int) -> tuple[int, dict[int, TokenIds]] | None:
  """The split's token ids as another count of shards stored them, whole (checked), where
  they hold every pair of shard `shard` of `shards` (of a split of `n` pairs): (their count,
  {their shard: its ids} of those needed), or None. A run on another number of hosts (one
  shard a host) finds the ids the last one made."""
  names = (_SHARD_NAME.fullmatch(p.name) for p in Path(cache_dir).iterdir())
  counts = {int(m["of"]) for m in names if m and m["split"] == split} - {shards}
  for of in sorted(counts):
    need = np.unique(np.arange(shard, min(n, shard + shards * of), shards) % of).tolist()
    found = {}
    for s in need:
      try:
        ids = load(path(cache_dir, tokenizer, identity, split, f"{s}of{of}"),
                   tokenizer.vocab_size)
      except Broken:   # (a run with that many shards sets it aside)
        ids = None
      if ids is None or len(ids.src) != len(range(s, n, of)):
        break
      found[s] = ids
    else:
      return of, found
  return None


def regroup(stored: tuple[int, dict[int, TokenIds]], split: str, n: int, shard: int,
            shards: int, tokenizer: Tokenizer, identity: str, into: Path, *,
            progress: bool = False, published_as: Path | None = None) -> TokenIds:
  """Shard `shard` of `shards` of a split of `n` pairs (its pairs shard, shard + shards,
  ...) gathered from the ids another count of shards stored (`stored_shards`) into the new
  directory `into`: the files tokenizing it would write, at the speed of a copy."""
  of, found = stored
  pairs = np.arange(shard, n, shards)

  def chunks():
    for a in range(0, len(pairs), REGROUP_CHUNK):
      i = pairs[a:a + REGROUP_CHUNK]
      where, at = i % of, i // of   # pair i is pair i // of of stored shard i % of
      out = []
      for side in SIDES:
        lens, parts = np.zeros(len(i), np.int64), []
        for s, ids in found.items():
          mine = np.flatnonzero(where == s)
          offsets = getattr(ids, side).offsets
          starts = offsets[at[mine]].astype(np.int64)
          lens[mine] = offsets[at[mine] + 1] - starts
          parts.append((mine, ids.read(side, starts, lens[mine])))
        tokens = np.empty(int(lens.sum()), _dtype(tokenizer))
        first = np.cumsum(lens) - lens
        for mine, read in parts:
          tokens[gather_index(first[mine], lens[mine])] = read
        out += [tokens, lens]
      yield tuple(out)
  return _write(into, chunks(), len(pairs), _dtype(tokenizer), tokenizer, split, identity,
                f"regrouping {split}", progress, Path(published_as or into))


def _write(into: Path, encoded, pairs: int, dtype, tokenizer: Tokenizer, split: str,
           identity: str, desc: str, progress: bool, shown: Path) -> TokenIds:
  """Writes the (src ids, src lengths, tgt ids, tgt lengths) of each chunk of `encoded`
  into the new directory `into` with their offsets and piece counts, checks them and records
  each file's SHA-256 (meta.json). A file that cannot be written is one line naming it
  (`shown`)."""
  from tqdm import tqdm
  lens = {"src": [np.zeros(1, np.uint32)], "tgt": [np.zeros(1, np.uint32)]}   # (a line's)
  pieces = np.zeros(tokenizer.vocab_size, np.int64)
  bar = tqdm(total=pairs, desc=desc, unit=" pairs", unit_scale=True, disable=not progress,
             delay=BAR_DELAY, file=sys.stderr)
  writing = ""
  try:
    into.mkdir(parents=True)
    writing = "src.ids"
    with open(into / "src.ids", "wb") as src_f, open(into / "tgt.ids", "wb") as tgt_f:
      for src, src_lens, tgt, tgt_lens in encoded:
        writing = "src.ids"
        src_f.write(src.tobytes())
        writing = "tgt.ids"
        tgt_f.write(tgt.tobytes())
        lens["src"].append(src_lens.astype(np.uint32))
        lens["tgt"].append(tgt_lens.astype(np.uint32))
        pieces += np.bincount(src, minlength=len(pieces))[:len(pieces)]
        bar.update(len(src_lens))
      writing = "tgt.ids"
    bar.close()
    for side, parts in lens.items():
      writing = f"{side}.offsets.npy"
      offsets = np.cumsum(np.concatenate(parts), dtype=np.int64)
      parts.clear()
      np.save(into / writing, offsets.astype(np.uint32) if offsets[-1] < 1 << 32 else offsets)
    writing = "src_pieces.npy"
    np.save(into / writing, pieces)
    try:   # what is on disk: checked, and its SHA-256 kept
      scans = _scan_all(into, dtype)
      ids = _opened(into, dtype, pairs, scans, tokenizer.vocab_size)
    except Broken as e:
      raise UserError(f"the token ids made for {shown} fail their check ({e}): nothing was "
                      f"kept; run again, and report it if it happens again") from None
    writing = "meta.json"
    (into / writing).write_text(json.dumps(
        {"format": FORMAT, "dtype": np.dtype(dtype).name, "pairs": int(pairs),
         "split": split, "vocab_size": tokenizer.vocab_size,
         "vocabulary": vocabulary_key(tokenizer), "identity": identity,
         "sha256": {name: scans[name][0] for name in FILES}}))
  except OSError as e:
    raise cannot_write(shown / writing if writing else shown, e) from None
  finally:
    bar.close()
  return ids


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
                                             tokenizer.lowercase_source, os.getpid())) as pool:
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


def _start_worker(model_proto: bytes, lowercase_source: bool, parent: int) -> None:
  global _worker_tokenizer
  end_with_parent(parent)   # a killed run leaves no worker behind
  _worker_tokenizer = Tokenizer(model_proto, lowercase_source=lowercase_source)


def _encode_in_worker(src: list[str], tgt: list[str], dtype):
  return _encode(_worker_tokenizer, src, tgt, dtype, threads=1)
