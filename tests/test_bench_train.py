"""bench/bench_train.py's MFU rests on two things tested here: its analytic FLOP count
(`train_flops`), checked against every dot_general in the jaxpr of the real train step, and
its batches: random ones for the CPU workloads (≈ 13% padding, the speed targets'), and for
the GPU and dry ones train.py's packed rows of a corpus, which the torch peer reads too."""
import functools
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import seq2seq
from seq2seq.config import Config, TrainConfig
from seq2seq.train_lib import init_state, train_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_train  # noqa: E402
from jaxpr_flops import dot_flops  # noqa: E402


def _step_flops(cfg: Config, batch_size: int, src_len: int, tgt_len: int,
                packed: bool = False) -> float:
  """Matmul FLOPs of one `train_step` on [batch, src_len] -> [batch, tgt_len] (packed: with
  segment ids and positions), from its jaxpr (traced on shapes only: nothing is
  initialised or compiled)."""
  state = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
  keys = bench_train.BATCH_KEYS if packed else ("src", "tgt")
  batch = {k: jax.ShapeDtypeStruct((batch_size, src_len if k.startswith("src") else tgt_len),
                                   np.int32) for k in keys}
  step = functools.partial(train_step, cfg=cfg, bos_id=bench_train.BOS)
  return dot_flops(jax.make_jaxpr(step)(state, batch).jaxpr)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie_output", [True, False])
def test_train_flops_counts_every_matmul_of_the_step(dtype, tie_output):
  # Every dimension distinct (and the source and target lengths), so a formula that swapped
  # any two would miss.
  model = seq2seq.get_config("tiny", vocab_size=53).replace(
      d_model=32, num_heads=4, d_ff=48, num_encoder_layers=2, num_decoder_layers=3,
      dtype=dtype, dropout_rate=0.1, tie_output=tie_output)
  cfg = Config(model=model, train=TrainConfig(batch_size=4, seq_len=8))
  assert bench_train.train_flops(model, 4, 6, 9) == _step_flops(cfg, 4, 6, 9)


@pytest.mark.parametrize("workload, preset", [("cpu", "small"), ("cpu", "base"), ("dry", "tiny"),
                                              ("gpu", "bible_gpu")])
def test_train_flops_of_the_benchmark_workloads(workload, preset):
  cfg = bench_train.workload_config(preset, "bfloat16", workload=workload)
  w = bench_train.WORKLOAD_SETS[workload][preset]
  assert (cfg.train.batch_size, cfg.train.seq_len) == (w["batch"], w["length"])
  assert bench_train.train_flops(cfg.model, w["batch"], w["length"], w["length"]) == \
      _step_flops(cfg, w["batch"], w["length"], w["length"], packed=workload != "cpu")


def test_gpu_workloads_are_the_presets_at_their_shapes_and_bible_gpu_is_its_run():
  """(The FLOP count is checked above at distinct dimensions; tracing `big` costs ~10 s.)"""
  from seq2seq.config import get_experiment
  for preset, w in bench_train.GPU_WORKLOADS.items():
    cfg = bench_train.workload_config(preset, "bfloat16", workload="gpu")
    if preset == "bible_gpu":   # train.py --config bible_gpu, with its vocabulary of 8,000
      run = get_experiment("bible_gpu")
      assert cfg.model == run.model.replace(vocab_size=run.data.vocab_size) and \
          cfg.train == run.train
      assert bench_train.DATA_VOCAB["gpu"] == run.data.vocab_size == w["vocab_size"]
      continue
    paper = seq2seq.get_config(preset, vocab_size=w["vocab_size"])
    assert cfg.model == paper.replace(dtype="bfloat16", dropout_rate=0.1,
                                      ffn_dropout_rate=0.1)
    assert (cfg.train.batch_size, cfg.train.seq_len) == (w["batch"], w["length"])
    if preset in ("base", "big"):   # the presets' runs' row length
      assert w["length"] == get_experiment(preset).train.seq_len == 256
  assert bench_train.datasheet_bf16_peak("NVIDIA H100 80GB HBM3") == 989.4e12
  assert bench_train.datasheet_bf16_peak("NVIDIA H100 PCIe") == 756e12
  assert bench_train.datasheet_bf16_peak("cpu") is None


PAIRS = 300


def _corpus(d: Path) -> Path:
  """Number words, English to French, in the Bible corpus's layout: short pairs, several to
  a row of 32 tokens."""
  from num2words import num2words
  d.mkdir()
  for split, numbers in (("train", range(PAIRS)), ("validation", range(PAIRS, PAIRS + 4)),
                         ("test", range(PAIRS + 4, PAIRS + 8))):
    (d / f"{split}.en").write_text("".join(num2words(n) + "\n" for n in numbers))
    (d / f"{split}.fr").write_text("".join(num2words(n, lang="fr") + "\n" for n in numbers))
  return d


def test_gpu_and_dry_batches_are_rows_of_the_corpus_pairs_packed_as_train_py_packs(
    tmp_path, monkeypatch):
  """Read back against the corpus: every segment of a row is one pair of it (source and
  target of the same line, EOS-terminated, positions from 0), segments numbered 1.. in
  order, then padding to the row's end; the figures reported are those of the arrays; a
  second call reads the kept file (no building); no corpus: the embedded numbers task."""
  from seq2seq.data.tokenizer import EOS_ID, Tokenizer
  corpus, data_dir = _corpus(tmp_path / "corpus"), tmp_path / "data"
  w = bench_train.DRY_WORKLOADS["tiny"]
  batches, data = bench_train.packed_batches("dry", "tiny", str(corpus), str(data_dir))
  assert len(batches) == bench_train.NUM_BATCHES
  assert data["source"] == f"parallel_text {corpus}" and data["pairs"] == PAIRS
  (vocab,) = data_dir.glob("*/vocab.model")
  tok = Tokenizer.load(str(vocab))
  assert data["tokenizer_vocab"] == tok.vocab_size <= bench_train.DATA_VOCAB["dry"]
  lines = dict(zip((corpus / "train.en").read_text().splitlines(),
                   (corpus / "train.fr").read_text().splitlines()))
  pairs, seen = 0, set()
  for b in batches:
    assert set(b) == set(bench_train.BATCH_KEYS)
    assert all(v.shape == (w["batch"], w["length"]) and v.dtype == np.int32 for v in b.values())
    for r in range(w["batch"]):
      got = {}
      for side in ("src", "tgt"):
        seg, pos, tokens = (b[f"{side}_segments"][r], b[f"{side}_positions"][r], b[side][r])
        n = int((seg > 0).sum())
        assert (seg[n:] == 0).all() and (tokens[n:] == bench_train.PAD).all() and n > 0
        assert (np.diff(seg[:n]) >= 0).all() and (np.diff(seg[:n]) <= 1).all() and seg[0] == 1
        for k in range(1, seg.max() + 1):
          span = np.flatnonzero(seg == k)
          assert (pos[span] == np.arange(len(span))).all() and tokens[span[-1]] == EOS_ID
          got.setdefault(k, []).append(tok.decode(tokens[span[:-1]].tolist()))
      assert b["src_segments"][r].max() == b["tgt_segments"][r].max()
      for src, tgt in got.values():
        assert lines[src] == tgt, (src, tgt)   # a pair of the corpus, whole
        seen.add(src)
      pairs += len(got)
  assert pairs / (len(batches) * w["batch"]) == data["pairs_per_row"] > 2   # packed
  tgt = np.stack([b["tgt"] for b in batches])
  assert data["target_tokens_per_batch"] == [int((t > 0).sum()) for t in tgt]
  assert data["tgt_fill"] == (tgt > 0).sum() / tgt.size and data["rows_with_padding"] > 0
  assert len(seen) > 0.8 * pairs   # train.py's order: a permutation, not one pair again
  build = bench_train._train_py_batches
  monkeypatch.setattr(bench_train, "_train_py_batches", None)   # read back, not built
  again, same = bench_train.packed_batches("dry", "tiny", str(corpus), str(data_dir))
  assert same == data and all((a[k] == b[k]).all() for a, b in zip(again, batches) for k in a)

  asked = {}
  def load_dataset(cfg, workdir, **kw):
    asked.update(data=cfg.data, train=cfg.train)
    raise RuntimeError("stop")
  monkeypatch.setattr("seq2seq.data.dataset.load_dataset", load_dataset)
  monkeypatch.setattr(bench_train, "_train_py_batches", build)
  with pytest.raises(RuntimeError, match="stop"):
    bench_train.packed_batches("gpu", "bible_gpu", str(tmp_path / "none"), str(data_dir))
  assert (asked["data"].dataset, asked["data"].vocab_size, asked["data"].max_src_len) == \
      ("numbers", 8000, 64) and (asked["train"].batch_size, asked["train"].seq_len) == (128, 64)



@pytest.mark.slow   # runs the benchmark's train steps
def test_a_step_with_a_non_finite_loss_fails_the_row_and_tokens_are_the_real_ones(
    tmp_path, monkeypatch):
  """run_one on the dry workload's packed rows: the target tokens it counts are the batches'
  non-pad ones, every loss is finite; with a NaN in the parameters, its row says which step
  went wrong (main then marks it failed and exits 1)."""
  corpus, data_dir = str(_corpus(tmp_path / "corpus")), str(tmp_path / "data")
  kw = dict(steps=2, warmup=1, workload_set="dry", peak_n=64, corpus=corpus, data_dir=data_dir)
  r = bench_train.run_one("tiny", "float32", **kw)
  batches, _ = bench_train.packed_batches("dry", "tiny", corpus, data_dir)
  timed = [int((batches[i]["tgt"] != 0).sum()) for i in (2, 3)]
  assert r["target_tokens_per_step"] == np.mean(timed) and "error" not in r
  assert len(r["losses"]) == 4 and all(np.isfinite(r["losses"])) and r["data"]["pairs_per_row"] > 2
  real = bench_train.workload
  def poisoned(*a, **k):
    trainer, state, local, batches = real(*a, **k)
    params = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(np.nan), state.params)
    return trainer, state.replace(params=params), local, batches
  monkeypatch.setattr(bench_train, "workload", poisoned)
  r = bench_train.run_one("tiny", "float32", **kw)
  assert r["error"] == "non-finite loss or gradient norm at step 1 of 4"


def test_the_torch_peer_sees_each_pair_of_a_packed_row_alone():
  """nn.Transformer on packed rows (bench_peers_torch.packed_inputs) against the same model
  on each pair alone, unpadded (its one-pair path: key padding masks, a causal mask): equal
  logits at every position of every pair."""
  torch = pytest.importorskip("torch")
  import bench_peers_torch as peer
  torch.manual_seed(0)
  cfg, model = peer._build_model("tiny")
  model.eval()   # no dropout
  pairs = [([5, 6, 7, 2], [8, 9, 2]), ([10, 11, 2], [12, 13, 14, 15, 2]), ([16, 2], [17, 2]),
           ([20, 21, 22, 23, 24, 2], [25, 2])]
  rows, length = [[0, 1], [2], [3, 2, 0]], 12
  b = {k: np.zeros((len(rows), length), np.int32) for k in bench_train.BATCH_KEYS}
  for r, row in enumerate(rows):
    for side, i in (("src", 0), ("tgt", 1)):
      col = 0
      for k, p in enumerate(row):
        n = len(pairs[p][i])
        b[side][r, col:col + n] = pairs[p][i]
        b[f"{side}_segments"][r, col:col + n] = k + 1
        b[f"{side}_positions"][r, col:col + n] = np.arange(n)
        col += n
  src, tgt_in, tgt, packed = peer.packed_inputs(b, cfg["num_heads"])
  with torch.no_grad():
    logits = model(src, tgt_in, packed)
    for r, row in enumerate(rows):
      col = 0
      for p in row:
        s, t = (torch.tensor([x]) for x in pairs[p])
        alone = model(s, torch.cat([torch.full_like(t[:, :1], peer.BOS), t[:, :-1]], 1))[0]
        assert tgt_in[r, col] == peer.BOS and (tgt_in[r, col + 1:col + len(t[0])] ==
                                               t[0, :-1]).all()
        torch.testing.assert_close(logits[r, col:col + len(t[0])], alone, atol=1e-5, rtol=1e-5)
        col += len(t[0])
      assert (tgt_in[r, col:] == peer.PAD).all()


def test_random_batches_end_in_eos_then_pad_about_13_percent():
  rng = np.random.default_rng(0)
  vocab, length = 100, 64
  pad = []
  for _ in range(20):
    b = bench_train.random_batch(rng, 32, length, vocab)
    for x in (b["src"], b["tgt"]):
      assert x.shape == (32, length) and x.dtype == np.int32
      lens = (x != bench_train.PAD).sum(1)
      assert lens.min() >= bench_train.MIN_LEN and lens.max() <= length
      for row, n in zip(x, lens):
        assert row[n - 1] == bench_train.EOS and (row[n:] == bench_train.PAD).all()
        assert (row[:n - 1] >= 3).all() and (row[:n - 1] < vocab).all()
      pad.append(1.0 - lens.mean() / length)
  assert 0.12 < np.mean(pad) < 0.145
