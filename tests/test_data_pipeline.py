"""Packing, segment ids / positions, masks with the real Transformer, resume, host shards,
length policy, evaluation padding."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq.data import EOS_ID, load_dataset
from seq2seq.data import testing as dtest
from seq2seq.data import first_fit
from seq2seq.data.pipeline import (OPEN_ROWS, Ragged, TrainStream, apply_length_policy,
                                   plan_rows)


def _random_ragged(n, lo, hi, seed):
  rng = np.random.default_rng(seed)
  # token ids >= 4 (not special), each sequence distinct
  return Ragged.from_lists([list(rng.integers(4, 300, size=rng.integers(lo, hi + 1)))
                            for _ in range(n)])


def _examples_in_batch(batch, name):
  """{(row, segment): tokens} of one side of a packed batch."""
  out = {}
  for r in range(batch[name].shape[0]):
    seg = batch[f"{name}_segments"][r]
    for s in np.unique(seg[seg > 0]):
      out[(r, int(s))] = batch[name][r][seg == s]
  return out


@pytest.fixture(scope="module")
def stream():
  pairs, _ = apply_length_policy(_random_ragged(500, 1, 20, 0),
                                 _random_ragged(500, 1, 25, 1), 16, 16, "truncate")
  return TrainStream(pairs, batch_size=8, seq_len=32, pack=True, seed=3)


def test_ragged_roundtrip_and_eos():
  seqs = [[5, 6, 7], [], [8], [9, 10, 11, 12, 13]]
  r = Ragged.from_lists(seqs)
  assert [r[i].tolist() for i in range(len(r))] == seqs
  assert [r.take([3, 0])[i].tolist() for i in range(2)] == [seqs[3], seqs[0]]
  e, cut = r.with_eos(4)
  assert [e[i].tolist() for i in range(len(e))] == [[5, 6, 7, 2], [2], [8, 2], [9, 10, 11, 2]]
  assert cut.tolist() == [False, False, False, True]


def test_length_policy_counts():
  src = Ragged.from_lists([[5] * 3, [5] * 9, [5] * 4, [5] * 2])
  tgt = Ragged.from_lists([[6] * 3, [6] * 2, [6] * 12, [6] * 2])
  pairs, stats = apply_length_policy(src, tgt, 6, 8, "drop")
  assert pairs.keep.tolist() == [0, 3] and stats["dropped_too_long"] == 2 and stats["kept"] == 2
  assert pairs.example(0)[0].tolist() == [5, 5, 5, EOS_ID]
  assert pairs.example(1)[1].tolist() == [6, 6, EOS_ID]
  pairs, stats = apply_length_policy(src, tgt, 6, 8, "truncate")
  assert stats["truncated"] == 2 and stats["kept"] == 4
  assert pairs.src_len.max() <= 6 and pairs.tgt_len.max() <= 8
  assert pairs.example(1)[0].tolist() == [5] * 5 + [EOS_ID]
  assert pairs.example(2)[1].tolist() == [6] * 7 + [EOS_ID]
  assert pairs.src_len.tolist() == [4, 6, 5, 3] and pairs.tgt_len.tolist() == [4, 3, 8, 3]


def test_packing_loses_nothing_and_segments_positions_right(stream):
  """Over one epoch every example appears whole, in order, with positions 0..len-1, and
  segment ids count 1, 2, ... from the left of each row."""
  seen = []
  for k in range(stream.steps_per_epoch):
    b = stream.batch(k)
    assert all(v.shape == (8, 32) and v.dtype == np.int32 for v in b.values())
    for name in ("src", "tgt"):
      seg, pos, tok = b[f"{name}_segments"], b[f"{name}_positions"], b[name]
      assert np.all((tok != 0) == (seg > 0))          # pad exactly where segment 0
      assert np.all(pos[seg == 0] == 0)
      for r in range(8):
        nz = seg[r][seg[r] > 0]
        assert np.all(np.diff(nz) >= 0) and (nz.size == 0 or nz[0] == 1)
        assert np.all(np.diff(np.unique(nz)) == 1)     # 1, 2, 3, ... no gaps
        assert np.all(seg[r][len(nz):] == 0)            # padding only at the end
        for s in np.unique(nz):
          assert pos[r][seg[r] == s].tolist() == list(range(int((seg[r] == s).sum())))
    src_ex, tgt_ex = _examples_in_batch(b, "src"), _examples_in_batch(b, "tgt")
    assert src_ex.keys() == tgt_ex.keys()              # source and target share segments
    for key in sorted(src_ex):
      seen.append((tuple(src_ex[key]), tuple(tgt_ex[key])))
  # Each example of the epoch exactly as stored (EOS-terminated); every example is placed
  # (the epoch wraps around for the last rows, so some appear twice, none is lost).
  every = {tuple(map(tuple, stream.pairs.example(i))) for i in range(len(stream.pairs))}
  assert set(seen) == every
  stats = stream.epoch_stats(0)
  assert stats["distinct_examples_per_epoch"] == len(stream.pairs)
  assert stats["src_fill"] > 0.8 and stats["tgt_fill"] > 0.85


def test_first_fit_plan_follows_its_rule_and_packs_tighter_than_rows_one_at_a_time():
  """Checked from the finished plan alone: rows fit, one pass places each example once, and
  each example went into the oldest open row with room (open: the last OPEN_ROWS started
  before it), starting a row only when none had room."""
  rng = np.random.default_rng(0)
  n, L = 1500, 64
  src_lens, tgt_lens = rng.integers(2, 50, n), rng.integers(2, 56, n)  # means ~ the Bible's
  order = rng.permutation(n)
  stream, bounds = plan_rows(src_lens, tgt_lens, order, None, L, pack=True)
  assert sorted(stream.tolist()) == list(range(n))
  rows = [stream[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
  assert all(src_lens[r].sum() <= L and tgt_lens[r].sum() <= L for r in rows)
  pos = np.argsort(order)                          # when each example came
  start = [pos[r[0]] for r in rows]
  assert start == sorted(start)                    # rows come out in the order they started
  fits = lambda r, x: (src_lens[r].sum() + src_lens[x] <= L and
                       tgt_lens[r].sum() + tgt_lens[x] <= L)
  for i, row in enumerate(rows):
    for k, x in enumerate(row):
      assert all(pos[y] < pos[x] for y in row[:k])  # a row's examples in arrival order
      before = int(np.searchsorted(start, pos[x]))  # rows started before x came
      assert before - OPEN_ROWS <= i <= before       # x's row was open, or x started it
      older = range(max(0, before - OPEN_ROWS), i)  # the open ones older than x's row
      assert not any(fits([y for y in rows[j] if pos[y] < pos[x]], x) for j in older), (i, k)
  # the same examples filled one row at a time (the naive packing) need 1/4 more rows
  one_at_a_time, room = 0, (-1, -1)
  for x in order:
    if room[0] < src_lens[x] or room[1] < tgt_lens[x]:
      one_at_a_time, room = one_at_a_time + 1, (L, L)
    room = (room[0] - src_lens[x], room[1] - tgt_lens[x])
  assert len(rows) < 0.85 * one_at_a_time, (len(rows), one_at_a_time)
  # more rows than one pass: the pass's rows, then the order again; fewer: its first rows
  more, b_more = plan_rows(src_lens, tgt_lens, order, len(rows) + 5, L, pack=True)
  assert len(b_more) == len(rows) + 6 and more[:n].tolist() == stream.tolist()
  assert more[n] == order[0]
  fewer, b_fewer = plan_rows(src_lens, tgt_lens, order, len(rows) - 5, L, pack=True)
  assert np.array_equal(b_fewer, bounds[:-5]) and np.array_equal(fewer, stream[:b_fewer[-1]])


def _first_fit_lists(order, src_lens, tgt_lens, seq_len, max_rows):
  """The first-fit rule over lists of lists, as plainly as it can be written."""
  rows, open_rows = [], []          # open rows: [examples, source room, target room]
  for e in order:
    for r in open_rows:
      if r[1] >= src_lens[e] and r[2] >= tgt_lens[e]:
        r[0].append(e)
        r[1] -= src_lens[e]
        r[2] -= tgt_lens[e]
        break
    else:
      if len(open_rows) == OPEN_ROWS:
        rows.append(open_rows.pop(0)[0])
        if len(rows) == max_rows:
          return rows
      open_rows.append([[e], seq_len - src_lens[e], seq_len - tgt_lens[e]])
  return (rows + [r[0] for r in open_rows])[:max_rows]


@pytest.mark.parametrize("compiled", [True, False])
def test_plan_is_first_fit_written_plainly(monkeypatch, compiled):
  """plan_rows (NumPy around first_fit.c, or around its Python loop where no compiler is)
  gives the rows of the rule written over lists, for one pass, more rows and fewer."""
  if compiled and not first_fit.available():
    pytest.skip("no C compiler here")
  if not compiled:
    monkeypatch.setattr(first_fit, "rows", lambda *a: None)
  rng = np.random.default_rng(1)
  for trial in range(12):
    n, L = int(rng.integers(1, 2500)), int(rng.integers(8, 130))
    src_lens, tgt_lens = rng.integers(1, L + 1, n), rng.integers(1, L + 1, n)
    order = rng.permutation(n)
    one = _first_fit_lists(order.tolist(), src_lens, tgt_lens, L, n)
    for num_rows in (None, len(one) + int(rng.integers(1, 3 * len(one) + 2)),
                     max(1, len(one) - int(rng.integers(0, len(one))))):
      want = list(one) if num_rows is None else one[:num_rows]
      while num_rows and len(want) < num_rows:
        want += _first_fit_lists(order.tolist(), src_lens, tgt_lens, L, num_rows - len(want))
      stream, bounds = plan_rows(src_lens, tgt_lens, order, num_rows, L, pack=True)
      got = [stream[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
      assert got == want, (trial, num_rows)


PLAN_SAYING = r"""
import sys, warnings
import numpy as np
sys.path.insert(0, sys.argv[1])
from seq2seq.data import first_fit
from seq2seq.data.pipeline import plan_rows
with warnings.catch_warnings(record=True) as said:
  warnings.simplefilter("always")
  for _ in range(2):
    plan_rows(np.full(50, 3), np.full(50, 4), np.arange(50), None, 16, pack=True)
print(first_fit.available(), [str(w.message) for w in said])
"""


@pytest.mark.parametrize("case", ["no compiler", "a compiler that fails", "off"])
def test_the_plans_python_loop_says_why_once(tmp_path, case):
  """Without the compiled loop the plan is the Python one: said once, with why (a compiler
  missing, failing), or nothing where SEQ2SEQ_NATIVE=off asked for it."""
  import subprocess
  import sys
  env = {**os.environ, "SEQ2SEQ_NATIVE_DIR": str(tmp_path / "native")}
  env.pop("CC", None)
  if case == "no compiler":
    env["PATH"] = str(tmp_path)                 # (an empty directory)
  elif case == "a compiler that fails":
    env["CC"] = "/bin/false"
  else:
    env["SEQ2SEQ_NATIVE"] = "off"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run([sys.executable, "-c", PLAN_SAYING, root], env=env, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  said = {"no compiler": ["the packing plan runs its Python loop, ~50x slower than "
                          "first_fit.c: no C compiler (cc, gcc or clang; or set CC) on PATH"],
          "a compiler that fails": ["the packing plan runs its Python loop, ~50x slower "
                                    "than first_fit.c: /bin/false failed on first_fit.c: "
                                    "exit 1"],
          "off": []}[case]
  assert p.stdout.strip() == f"False {said!r}", p.stdout


def test_resume_at_step_k_is_exact(stream):
  """Batches from train_batches(k) equal batches k.. of an uninterrupted run, across epoch
  boundaries, and a fresh stream object gives the same batches."""
  spe = stream.steps_per_epoch
  it = stream(0)
  full = [next(it) for _ in range(2 * spe + 3)]
  for k in (1, spe - 1, spe, spe + 2, 2 * spe + 1):
    resumed = stream(k)
    for j in range(k, min(k + 2, len(full))):
      b = next(resumed)
      for name in full[j]:
        np.testing.assert_array_equal(b[name], full[j][name])
  fresh = TrainStream(stream.pairs, batch_size=8, seq_len=32, pack=True, seed=3)
  np.testing.assert_array_equal(fresh.batch(spe + 1)["tgt"], full[spe + 1]["tgt"])
  # another seed, another order; another epoch, another order
  other = TrainStream(stream.pairs, batch_size=8, seq_len=32, pack=True, seed=4)
  assert not np.array_equal(other.batch(0)["src"], full[0]["src"])
  assert not np.array_equal(full[spe]["src"], full[0]["src"])


def test_the_next_epochs_plan_is_made_ahead_on_a_thread(stream, monkeypatch):
  """Past the middle of an epoch the next one's plan is made on a thread of its own, once;
  the batches are those of each epoch's plan made plainly when it is needed."""
  import threading
  from seq2seq.data.pipeline import assemble, epoch_permutation
  made = []
  real = TrainStream._make_plan

  def make_plan(self, epoch):
    made.append((epoch, threading.current_thread().name))
    return real(self, epoch)
  monkeypatch.setattr(TrainStream, "_make_plan", make_plan)
  pairs = stream.pairs
  ahead = TrainStream(pairs, batch_size=8, seq_len=32, pack=True, seed=3)
  steps = ahead.steps_per_epoch
  for step in range(3 * steps + 1):
    epoch, i = divmod(step, steps)
    order = epoch_permutation(len(pairs), 3, epoch, 0)
    plan, bounds = plan_rows(pairs.src_len, pairs.tgt_len, order, steps * 8, 32, pack=True)
    want = assemble(pairs, plan, bounds[i * 8:(i + 1) * 8 + 1], 32, True)
    got = ahead.batch(step)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  assert made == [(1, "plan of epoch 1"), (2, "plan of epoch 2"), (3, "plan of epoch 3")]


def test_closed_batches_leave_no_thread_running(stream, monkeypatch):
  """Prefetch.close ends its thread and closes the batches, which wait for a next epoch's
  plan being made: no thread of the input pipeline runs on into the interpreter's exit
  (one inside NumPy's C++ sort there aborts the process)."""
  import threading
  import time
  from seq2seq.data.pipeline import Prefetch
  started = threading.Event()
  real = TrainStream._make_plan

  def slow_plan(self, epoch):   # the plan still being made when the run ends
    started.set()
    time.sleep(1.0)
    return real(self, epoch)
  monkeypatch.setattr(TrainStream, "_make_plan", slow_plan)
  s = TrainStream(stream.pairs, batch_size=8, seq_len=32, pack=True, seed=3)
  batches = Prefetch(iter(s(s.steps_per_epoch - 1)))   # the last step of epoch 0
  next(batches)
  assert started.wait(30)
  batches.close()
  alive = [t.name for t in threading.enumerate()
           if t.name.startswith("plan of epoch") or t is batches._t]
  assert alive == []


def test_unpacked_rows():
  pairs, _ = apply_length_policy(_random_ragged(50, 1, 10, 0),
                                 _random_ragged(50, 1, 10, 1), 16, 16, "drop")
  s = TrainStream(pairs, batch_size=4, seq_len=16, pack=False, seed=0)
  assert s.steps_per_epoch == 13
  b = s.batch(0)
  assert np.array_equal(b["src_segments"], (b["src"] != 0).astype(np.int32))
  assert np.array_equal(b["tgt_positions"], np.tile(np.arange(16), (4, 1)))
  order = np.random.default_rng([0, 0, 0]).permutation(50)
  assert b["src"][2][b["src"][2] != 0].tolist() == pairs.example(order[2])[0].tolist()


def test_packed_masks_block_cross_example_attention(stream):
  """The real Transformer on a packed batch gives, for every packed example, the logits it
  gives that example alone; without the segment ids it would not."""
  cfg = seq2seq.TransformerConfig(vocab_size=300, d_model=32, num_heads=2, d_ff=64,
                                  num_encoder_layers=1, num_decoder_layers=1, max_len=64,
                                  dropout_rate=0.0)
  model = seq2seq.Transformer(cfg)
  b = stream.batch(0)
  rows = [r for r in range(8) if b["src_segments"][r].max() >= 2][:2]
  assert rows, "expected rows holding several examples"
  src, tgt = b["src"][rows], b["tgt"][rows]
  ss, ts = b["src_segments"][rows], b["tgt_segments"][rows]
  sp, tp = b["src_positions"][rows], b["tgt_positions"][rows]
  # Every packed example alone in its own zero-padded row.
  where = [(i, s) for i in range(len(rows)) for s in range(1, int(ss[i].max()) + 1)]
  alone_src = np.zeros((len(where), 32), np.int32)
  alone_tgt = np.zeros((len(where), 32), np.int32)
  for k, (i, s) in enumerate(where):
    a, t = src[i][ss[i] == s], tgt[i][ts[i] == s]
    alone_src[k, :len(a)], alone_tgt[k, :len(t)] = a, t
  # One forward pass (one compilation) over: the packed rows with their segments; the same
  # rows as if they were one example each (segment = non-pad, positions = arange); and the
  # examples alone.
  ar = np.broadcast_to(np.arange(32, dtype=np.int32), (len(rows) + len(where), 32))
  all_src = np.concatenate([src, src, alone_src])
  all_tgt = np.concatenate([tgt, tgt, alone_tgt])
  all_ss = np.concatenate([ss, (src != 0).astype(np.int32), (alone_src != 0).astype(np.int32)])
  all_ts = np.concatenate([ts, (tgt != 0).astype(np.int32), (alone_tgt != 0).astype(np.int32)])
  all_sp = np.concatenate([sp, ar])
  all_tp = np.concatenate([tp, ar])
  tgt_in = seq2seq.shift_right(jnp.asarray(all_tgt), 1, jnp.asarray(all_ts))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), all_src[:1], tgt_in[:1])
  out = np.asarray(jax.jit(model.apply)(params, all_src, tgt_in, all_ss, all_ts, all_sp,
                                        all_tp))
  packed, unmasked, alone = out[:len(rows)], out[len(rows):2 * len(rows)], out[2 * len(rows):]
  differs = False
  for k, (i, s) in enumerate(where):
    n = int((ts[i] == s).sum())
    np.testing.assert_allclose(packed[i][ts[i] == s], alone[k, :n], atol=2e-5, rtol=1e-4)
    differs |= not np.allclose(unmasked[i][ts[i] == s], alone[k, :n], atol=1e-3)
  assert differs


def _cfg(tmp_path, **data):
  d = dict(dataset="parallel_text", train_files=str(tmp_path / "corpus"),
           data_dir=str(tmp_path / "tfds"), vocab_size=300, max_src_len=16, max_tgt_len=16)
  d.update(data)
  return seq2seq.Config(data=seq2seq.DataConfig(**d),
                        train=seq2seq.TrainConfig(batch_size=8, seq_len=32, seed=1))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("pipe")
  dtest.write_corpus_dir(str(root / "corpus"), (("train", 240), ("validation", 13),
                                                ("test", 30)))
  return root


def test_load_dataset_end_to_end_resume_and_cache(corpus):
  cfg = _cfg(corpus)
  ds = load_dataset(cfg, str(corpus / "work"), process_index=0, process_count=1)
  assert ds.splits == ("train", "validation", "test") and ds.num_examples("train") == 240
  assert ds.tokenizer.vocab_size <= 300 and ds.stats["kept"] + ds.stats["dropped_too_long"] \
      == 240
  it = ds.train_batches(0)
  first = [next(it) for _ in range(5)]
  assert set(first[0]) == {"src", "tgt", "src_segments", "tgt_segments", "src_positions",
                           "tgt_positions"}
  assert first[0]["src"].shape == (8, 32)
  # A new process (same workdir: vocabulary and token cache reused) resumes at step 3.
  ds2 = load_dataset(cfg, str(corpus / "work"), process_index=0, process_count=1)
  assert ds2.tokenizer.model_proto == ds.tokenizer.model_proto
  b3 = next(ds2.train_batches(3))
  for name in b3:
    np.testing.assert_array_equal(b3[name], first[3][name])
  # Decoding a packed segment gives back a training sentence.
  src_text, _ = ds.corpus.read("train")
  seg = first[0]["src_segments"][0]
  assert ds.tokenizer.decode(first[0]["src"][0][seg == 1]) in set(src_text)


def test_batches_are_the_pipeline_written_plainly(corpus):
  """load_dataset's batches are what the rule says, computed here pair by pair: every
  training pair tokenized and EOS-terminated, those over the limits left out, epoch e's
  permutation(seed, e, 0) packed first-fit, one pass setting the epoch's steps and more
  passes filling its last rows, each row laid out with segments and positions."""
  cfg = _cfg(corpus)
  ds = load_dataset(cfg, str(corpus / "work"), process_index=0, process_count=1)
  tok = ds.tokenizer
  pairs = [(tok.encode(s) + [EOS_ID], tok.encode(t) + [EOS_ID])
           for s, t in zip(*ds.corpus.read("train"))]
  pairs = [p for p in pairs if len(p[0]) <= 16 and len(p[1]) <= 16]
  src_lens, tgt_lens = [len(p[0]) for p in pairs], [len(p[1]) for p in pairs]
  B, L = 8, 32

  def rows_of(epoch, steps=None):
    order = np.random.default_rng([1, epoch, 0]).permutation(len(pairs)).tolist()
    rows = _first_fit_lists(order, src_lens, tgt_lens, L, len(order))
    steps = steps or -(-len(rows) // B)
    while len(rows) < steps * B:
      rows += _first_fit_lists(order, src_lens, tgt_lens, L, steps * B - len(rows))
    return rows[:steps * B], steps

  _, steps = rows_of(0)
  for k in (0, 1, steps - 1, steps, 2 * steps + 3):
    rows, _ = rows_of(k // steps, steps)
    got = next(ds.train_batches(k))
    for r, row in enumerate(rows[(k % steps) * B:(k % steps + 1) * B]):
      for side, name in ((0, "src"), (1, "tgt")):
        tokens = sum((pairs[e][side] for e in row), [])
        segments = sum(([j + 1] * len(pairs[e][side]) for j, e in enumerate(row)), [])
        positions = sum((list(range(len(pairs[e][side]))) for e in row), [])
        pad = [0] * (L - len(tokens))
        assert got[name][r].tolist() == tokens + pad, (k, r)
        assert got[f"{name}_segments"][r].tolist() == segments + pad
        assert got[f"{name}_positions"][r].tolist() == positions + pad


def test_host_shards_are_disjoint_and_cover(corpus):
  cfg = _cfg(corpus)
  shards = [load_dataset(cfg, str(corpus / "work"), process_index=p, process_count=2)
            for p in range(2)]
  texts = set()
  for p, ds in enumerate(shards):
    assert ds.host_batch_size == 4
    b = next(ds.train_batches(0))
    assert b["src"].shape == (4, 32)
    assert ds.stats["host_examples"] == 120
    pairs = ds._streams[0].pairs
    texts |= {(p, ds.tokenizer.decode(pairs.example(i)[0])) for i in range(len(pairs))}
  a = {t for p, t in texts if p == 0}
  b = {t for p, t in texts if p == 1}
  full, _ = shards[0].corpus.read("train")
  assert a | b <= set(full) and len(a | b) >= len(set(full)) - shards[0].stats[
      "dropped_too_long"] - shards[1].stats["dropped_too_long"]


def test_fixed_shards_make_batches_independent_of_host_count(corpus):
  """With num_shards fixed, 2 hosts' rows stacked == 1 host's batch, step by step."""
  cfg = _cfg(corpus)
  cfg = cfg.replace(data=cfg.data.replace(num_shards=2))
  one = load_dataset(cfg, str(corpus / "work"), process_index=0, process_count=1)
  two = [load_dataset(cfg, str(corpus / "work"), process_index=p, process_count=2)
         for p in range(2)]
  it1 = one.train_batches(5)
  it2 = [ds.train_batches(5) for ds in two]
  for _ in range(3):
    b1, parts = next(it1), [next(it) for it in it2]
    for k in b1:
      np.testing.assert_array_equal(b1[k], np.concatenate([p[k] for p in parts]))
  # without a fixed shard count the single host reads the data in another order
  other = next(load_dataset(_cfg(corpus), str(corpus / "work"), process_index=0,
                            process_count=1).train_batches(5))
  assert not np.array_equal(other["src"], np.concatenate(
      [next(ds.train_batches(5))["src"] for ds in two]))


def test_eval_batches_pad_never_drop(corpus):
  cfg = _cfg(corpus, max_src_len=6)   # many test sources are longer: truncated, kept
  ds = load_dataset(cfg, str(corpus / "work6"), process_index=0, process_count=1)
  batches = list(ds.eval_batches("test", 8))
  assert len(batches) == 4                               # 30 examples -> 8, 8, 8, 6
  src_text, tgt_text = ds.corpus.read("test")
  got = [t for b in batches for t, v in zip(b["tgt_text"], b["valid"]) if v]
  assert got == tgt_text
  last = batches[-1]
  assert last["valid"].tolist() == [True] * 6 + [False] * 2
  assert np.all(last["src"][6:] == 0) and np.all(last["tgt"][6:] == 0)
  assert last["src_text"][6:] == ["", ""]
  assert all(b["src"].shape == (8, 6) for b in batches)  # truncated to max_src_len
  assert all(b["src"].dtype == np.int32 for b in batches)
  assert np.all((batches[0]["src"] == EOS_ID).sum(1) == 1)  # EOS kept after truncation
  for row, ref in zip(batches[0]["tgt"], tgt_text):  # maybe truncated to max_tgt_len
    assert ref.startswith(ds.tokenizer.decode(row)) and ds.tokenizer.decode(row)
  assert len(list(ds.eval_batches("validation", 8, max_examples=10))) == 2
  assert ds.stats["dropped_too_long"] > 0               # training policy is "drop"
