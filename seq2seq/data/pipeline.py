"""Deterministic batches from stored token ids: length policy, packing, host shards.

Pairs are stored ragged (`Ragged`: one flat token array, maybe memory-mapped, + offsets),
tokenized once (token_ids.py). The length policy reads their lengths only (`Pairs`: which
pairs, how long in a row); a batch copies just its own rows' tokens, EOS appended.
Training order is a pure function of (seed, step, shard): the stream is cut into epochs of
exactly `steps_per_epoch` batches; epoch e visits a shard's pairs in the order
`permutation(seed, e, shard)`, packs them into rows in that order (first-fit over
the last 64 rows started, or one pair per row), wraps around to the start of the order
if rows are left, and skips the few pairs that do not fit. So batch k is found by
computing the plan of epoch k // steps_per_epoch only, and resuming at step k is exact.

The plan is NumPy arrays (which pair goes where), its first-fit loop compiled C where a
compiler is (first_fit.c, ~50x the Python loop it mirrors); batch assembly is vectorised
NumPy.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

import numpy as np

from seq2seq.data import first_fit
from seq2seq.data.prefetch import Prefetch  # noqa: F401 (train_lib's, from here)
from seq2seq.data.ragged import Ragged, gather_index
from seq2seq.data.tokenizer import EOS_ID, PAD_ID
from seq2seq.errors import UserError


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Training pairs as rows hold them: pair i is the source ids `src[keep[i]]` cut to
  `src_len[i] - 1` tokens, then EOS; the same for the target. `src`/`tgt` are the stored
  token ids (their `flat` may be memory-mapped): nothing here copies them whole."""
  src: Ragged
  tgt: Ragged
  keep: np.ndarray      # [n] int32 (int64 past 2**31 pairs): which stored pairs
  src_len: np.ndarray   # [n] uint16: tokens in a row, EOS included
  tgt_len: np.ndarray

  def __len__(self) -> int:
    return len(self.keep)

  def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Pair i's (source, target) tokens as a row holds them."""
    out = []
    for ids, lens in ((self.src, self.src_len), (self.tgt, self.tgt_len)):
      out.append(np.append(ids[int(self.keep[i])][:lens[i] - 1], EOS_ID).astype(np.int32))
    return out[0], out[1]


def apply_length_policy(src: Ragged, tgt: Ragged, max_src_len: int, max_tgt_len: int,
                        policy: str) -> tuple[Pairs, dict]:
  """The pairs training takes, EOS-terminated, within the limits (EOS included): "drop"
  leaves over-long pairs out, "truncate" cuts them (keeping the final EOS). Reads the
  lengths only. Returns (pairs, stats)."""
  n = len(src)
  too_long = (src.lengths >= max_src_len) | (tgt.lengths >= max_tgt_len)   # EOS added
  keep = np.flatnonzero(~too_long) if policy == "drop" else np.arange(n)
  keep = keep.astype(_index_dtype(n))
  lens = [np.minimum(x.lengths[keep], limit - 1).astype(np.uint16) + 1
          for x, limit in ((src, max_src_len), (tgt, max_tgt_len))]
  pairs = Pairs(src, tgt, keep, *lens)
  stats = {"examples": n, "kept": int(len(keep)),
           "dropped_too_long": int(too_long.sum()) if policy == "drop" else 0,
           "truncated": int(too_long.sum()) if policy == "truncate" else 0}
  return pairs, stats


def _index_dtype(n: int):
  return np.int32 if n < 1 << 31 else np.int64


def host_shards(examples: int, num_shards: int, batch_size: int, process_index: int,
                process_count: int) -> dict[int, np.ndarray]:
  """This host's shards of the training pairs: shard -> its pairs (shard s holds every
  `shards`-th pair from s; `shards` is num_shards, or one a host). A host takes
  shards // process_count of them in a row, each its batch_size // shards rows of a batch.
  UserError where the numbers do not divide."""
  if batch_size % process_count:
    raise UserError(f"batch_size {batch_size} is not divisible by the number of hosts "
                    f"({process_count})")
  shards = num_shards or process_count
  if shards % process_count or batch_size % shards:
    raise UserError(f"num_shards {shards} must be a multiple of the number of hosts "
                    f"({process_count}) and divide batch_size ({batch_size})")
  if examples < shards:
    raise UserError(f"the training split has {examples} examples, fewer than the {shards} "
                    f"shards")
  per_host = shards // process_count
  return {s: np.arange(s, examples, shards)
          for s in range(process_index * per_host, (process_index + 1) * per_host)}


# --- training order ------------------------------------------------------------------------

def epoch_permutation(n: int, seed: int, epoch: int, shard: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch, shard]).permutation(n)


# Rows filled at once when packing: more pack tighter but plan slower. On the README's Bible
# corpus (27k pairs, rows of 64 tokens) target tokens fill 72% of the rows when they are
# filled one at a time, 86% with 8 open, 92% with 64, 93% with 128.
OPEN_ROWS = 64


def plan_rows(src_lens: np.ndarray, tgt_lens: np.ndarray, order: np.ndarray,
              num_rows: int | None, seq_len: int, pack: bool) -> tuple[np.ndarray, np.ndarray]:
  """One epoch's rows as (stream, bounds): row r holds examples stream[bounds[r]:bounds[r+1]].

  Examples are taken in `order`, and again from its start while rows are missing
  (`num_rows=None`: the rows of one pass). Without packing a row holds one example; packed,
  see `_first_fit_rows`.
  """
  if not pack:
    rows = len(order) if num_rows is None else num_rows
    return np.resize(order, rows), np.arange(rows + 1, dtype=np.int64)
  return extend_plan(one_pass(src_lens, tgt_lens, order, num_rows or len(order), seq_len),
                     src_lens, tgt_lens, order, num_rows, seq_len)


def one_pass(src_lens: np.ndarray, tgt_lens: np.ndarray, order: np.ndarray, max_rows: int,
             seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """The packed rows of one pass over `order` (at most `max_rows`) as (stream, bounds)."""
  s = np.ascontiguousarray(src_lens[order], np.int32)
  t = np.ascontiguousarray(tgt_lens[order], np.int32)
  row = first_fit.rows(s, t, seq_len, OPEN_ROWS, max_rows)
  if row is None:   # no C compiler: the same rule in Python
    first_fit.say_why_python()
    row = _first_fit_rows(s, t, seq_len, OPEN_ROWS, max_rows)
  del s, t
  if row.min(initial=0) >= 0 and row.max(initial=0) < max_rows:   # all placed
    by_row = np.argsort(row, kind="stable")                        # a row's pairs as they came
  else:
    placed = np.flatnonzero((row >= 0) & (row < max_rows))         # arrival positions
    row = row[placed]
    by_row = placed[np.argsort(row, kind="stable")]
  bounds = np.zeros(int(row.max(initial=-1)) + 2, np.int64)
  np.cumsum(np.bincount(row), out=bounds[1:])
  return np.asarray(order)[by_row], bounds


def extend_plan(plan, src_lens, tgt_lens, order, num_rows: int | None, seq_len: int):
  """`plan` (one pass's rows) followed by further passes over `order` until `num_rows`."""
  streams, bounds = [plan[0]], [plan[1]]
  rows = len(plan[1]) - 1
  while num_rows and rows < num_rows:
    stream, b = one_pass(src_lens, tgt_lens, order, num_rows - rows, seq_len)
    streams.append(stream)
    bounds.append(b[1:] + bounds[-1][-1])
    rows += len(b) - 1
  return np.concatenate(streams), np.concatenate(bounds)


def _first_fit_rows(src_len: np.ndarray, tgt_len: np.ndarray, seq_len: int, window: int,
                    max_rows: int) -> np.ndarray:
  """The row of each example of a pass (examples in arrival order), -1 after the pass ended.

  First-fit over the last `window` rows started: an example goes into the oldest of them
  where both its source and its target tokens still fit, or else starts a new row, which
  closes the oldest when `window` are open. The pass ends once `max_rows` rows are closed.
  (first_fit.c is this loop compiled: `first_fit.rows` runs it where a C compiler is.)
  """
  row = np.full(len(src_len), -1, np.int32)
  room_src, room_tgt, ids = [], [], []   # the open rows, oldest first
  started = 0
  for a in range(0, len(src_len), 1 << 16):   # Python ints a chunk at a time
    for i, (s, t) in enumerate(zip(src_len[a:a + (1 << 16)].tolist(),
                                   tgt_len[a:a + (1 << 16)].tolist()), a):
      for j in range(len(ids)):
        if room_src[j] >= s and room_tgt[j] >= t:
          room_src[j] -= s
          room_tgt[j] -= t
          row[i] = ids[j]
          break
      else:
        if len(ids) == window:
          if started - window + 1 == max_rows:
            return row
          del room_src[0], room_tgt[0], ids[0]
        room_src.append(seq_len - s)
        room_tgt.append(seq_len - t)
        ids.append(started)
        row[i] = started
        started += 1
  return row


def assemble(pairs: Pairs, stream: np.ndarray, bounds: np.ndarray, seq_len: int,
             pack: bool) -> dict[str, np.ndarray]:
  """Rows bounds[r]..bounds[r+1] of `stream` (pair ids) into [R, seq_len] arrays."""
  num_rows = len(bounds) - 1
  ex = stream[bounds[0]:bounds[-1]]
  stored = pairs.keep[ex]
  counts = np.diff(bounds)
  row = np.repeat(np.arange(num_rows), counts)
  seg = np.arange(len(ex)) - np.repeat(bounds[:-1] - bounds[0], counts) + 1  # 1, 2, .. per row
  out = {}
  for name, ids, all_lens in (("src", pairs.src, pairs.src_len),
                              ("tgt", pairs.tgt, pairs.tgt_len)):
    lens = all_lens[ex].astype(np.int64)
    # column where each example starts: exclusive cumsum of lengths within its row
    csum = np.cumsum(lens) - lens
    row_start = np.repeat(csum[bounds[:-1] - bounds[0]], counts)
    start = row * seq_len + csum - row_start
    dest = gather_index(start, lens)
    tokens = np.zeros(num_rows * seq_len, np.int32)
    tokens[gather_index(start, lens - 1)] = ids.flat[gather_index(ids.offsets[stored],
                                                                    lens - 1)]
    tokens[start + lens - 1] = EOS_ID
    segments = np.zeros(num_rows * seq_len, np.int32)
    segments[dest] = np.repeat(seg, lens)
    if pack:
      positions = np.zeros(num_rows * seq_len, np.int32)
      positions[dest] = gather_index(np.zeros_like(lens), lens)
    else:  # unpacked rows: positions are simply arange
      positions = np.tile(np.arange(seq_len, dtype=np.int32), num_rows)
    out[name] = tokens.reshape(num_rows, seq_len)
    out[f"{name}_segments"] = segments.reshape(num_rows, seq_len)
    out[f"{name}_positions"] = positions.reshape(num_rows, seq_len)
  return out


class TrainStream:
  """Infinite, deterministic training batches of one shard's pairs.

  Batch k (a dict of int32 [batch_size, seq_len]) depends only on (seed, k, shard) and the
  data. `pairs` fit `seq_len` (the length policy's limits). Halfway through an epoch the
  next epoch's plan is made on a thread of its own, so that the boundary waits for nothing.
  """

  def __init__(self, pairs: Pairs, *, batch_size: int, seq_len: int, pack: bool, seed: int,
               shard: int = 0):
    if len(pairs) == 0:
      raise ValueError("no training examples")
    self.pairs = pairs
    self.batch_size, self.seq_len, self.pack = batch_size, seq_len, pack
    self.seed, self.shard = seed, shard
    # Epoch 0's one pass sets the number of steps of every epoch (and starts its plan).
    order = self._order(0)
    if pack:
      first = one_pass(pairs.src_len, pairs.tgt_len, order, len(order), seq_len)
      rows = len(first[1]) - 1
    else:
      first, rows = None, len(order)
    self.steps_per_epoch = max(1, -(-rows // batch_size))
    num_rows = self.steps_per_epoch * batch_size
    self._plans = {0: (extend_plan(first, pairs.src_len, pairs.tgt_len, order, num_rows,
                                   seq_len) if pack else
                       plan_rows(None, None, order, num_rows, seq_len, False))}
    self._ahead: tuple[int, threading.Thread, list] | None = None   # the next epoch's

  def _order(self, epoch: int) -> np.ndarray:
    n = len(self.pairs)
    return epoch_permutation(n, self.seed, epoch, self.shard).astype(_index_dtype(n))

  def _make_plan(self, epoch: int):
    return plan_rows(self.pairs.src_len, self.pairs.tgt_len, self._order(epoch),
                     self.steps_per_epoch * self.batch_size, self.seq_len, self.pack)

  def _plan(self, epoch: int):
    if epoch not in self._plans:   # keeps one epoch's (and the next, once prepared)
      if self._ahead is not None and self._ahead[0] == epoch:
        _, thread, out = self._ahead
        thread.join()
        if isinstance(out[0], BaseException):
          raise out[0]
        plan = out[0]
      else:
        plan = self._make_plan(epoch)
      self._plans, self._ahead = {epoch: plan}, None
    return self._plans[epoch]

  def _prepare(self, epoch: int) -> None:
    """Starts making epoch `epoch`'s plan on a thread (the C loop and NumPy's sort run
    without the interpreter's lock)."""
    if epoch in self._plans or (self._ahead is not None and self._ahead[0] == epoch):
      return
    out: list = [None]

    def make():
      try:
        out[0] = self._make_plan(epoch)
      except BaseException as e:   # raised where the plan is asked for
        out[0] = e
    thread = threading.Thread(target=make, daemon=True, name=f"plan of epoch {epoch}")
    self._ahead = (epoch, thread, out)
    thread.start()

  def finish(self) -> None:
    """Waits for the next epoch's plan where one is being made: nothing runs on after."""
    if self._ahead is not None:
      self._ahead[1].join()

  def batch(self, step: int) -> dict[str, np.ndarray]:
    epoch, i = divmod(step, self.steps_per_epoch)
    stream, bounds = self._plan(epoch)
    if 2 * i >= self.steps_per_epoch - 1:
      self._prepare(epoch + 1)
    b = bounds[i * self.batch_size:(i + 1) * self.batch_size + 1]
    return assemble(self.pairs, stream, b, self.seq_len, self.pack)

  def __call__(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    step = start_step
    try:
      while True:
        yield self.batch(step)
        step += 1
    finally:
      self.finish()

  def epoch_stats(self, epoch: int = 0) -> dict:
    """How epoch `epoch` uses the data: examples placed, distinct, token fill."""
    stream, bounds = self._plan(epoch)
    ex = stream[:bounds[-1]]
    rows = self.steps_per_epoch * self.batch_size
    placed = np.zeros(len(self.pairs), bool)
    placed[ex] = True
    return {
        "steps_per_epoch": self.steps_per_epoch,
        "examples_per_epoch": int(len(ex)),
        "distinct_examples_per_epoch": int(placed.sum()),
        "examples_per_step": len(ex) / self.steps_per_epoch,
        "src_fill": float(self.pairs.src_len[ex].sum() / (rows * self.seq_len)),
        "tgt_fill": float(self.pairs.tgt_len[ex].sum() / (rows * self.seq_len)),
    }


def pad_batch(src: Ragged, tgt: Ragged, idx: np.ndarray, batch_size: int,
              src_len: int, tgt_len: int) -> dict[str, np.ndarray]:
  """Evaluation rows: examples `idx` padded to [batch_size, len]; missing rows all zero."""
  out = {}
  for name, data, length in (("src", src, src_len), ("tgt", tgt, tgt_len)):
    lens = data.lengths[idx]
    row = np.arange(len(idx))
    dest = gather_index(row * length, lens)
    tokens = np.full(batch_size * length, PAD_ID, np.int32)
    tokens[dest] = data.flat[gather_index(data.offsets[idx], lens)]
    out[name] = tokens.reshape(batch_size, length)
  valid = np.zeros(batch_size, bool)
  valid[:len(idx)] = True
  out["valid"] = valid
  return out
