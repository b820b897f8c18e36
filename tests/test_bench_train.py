"""bench/bench_train.py's MFU rests on two things tested here: its analytic FLOP count
(`train_flops`), checked against every dot_general in the jaxpr of the real train step, and
its random batches (≈ 13% padding, the speed targets' workload)."""
import functools
import os
import sys

import jax
import numpy as np
import pytest

import seq2seq
from seq2seq.config import Config, TrainConfig
from seq2seq.train_lib import init_state, train_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_train  # noqa: E402
from jaxpr_flops import dot_flops  # noqa: E402


def _step_flops(cfg: Config, batch_size: int, src_len: int, tgt_len: int) -> float:
  """Matmul FLOPs of one `train_step` on [batch, src_len] -> [batch, tgt_len], from its
  jaxpr (traced on shapes only: nothing is initialised or compiled)."""
  state = jax.eval_shape(functools.partial(init_state, cfg), jax.random.key(0))
  batch = {k: jax.ShapeDtypeStruct((batch_size, n), np.int32)
           for k, n in (("src", src_len), ("tgt", tgt_len))}
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


@pytest.mark.parametrize("workload, preset", [("cpu", "small"), ("cpu", "base"), ("dry", "tiny")])
def test_train_flops_of_the_benchmark_workloads(workload, preset):
  cfg = bench_train.workload_config(preset, "bfloat16", workload=workload)
  w = bench_train.WORKLOAD_SETS[workload][preset]
  assert (cfg.train.batch_size, cfg.train.seq_len) == (w["batch"], w["length"])
  assert bench_train.train_flops(cfg.model, w["batch"], w["length"], w["length"]) == \
      _step_flops(cfg, w["batch"], w["length"], w["length"])


def test_gpu_workloads_are_the_presets_at_their_shapes():
  """(The FLOP count is checked above at distinct dimensions; tracing `big` costs ~10 s.)"""
  for preset, w in bench_train.GPU_WORKLOADS.items():
    cfg = bench_train.workload_config(preset, "bfloat16", workload="gpu")
    paper = seq2seq.get_config(preset, vocab_size=w["vocab_size"])
    assert cfg.model == paper.replace(dtype="bfloat16", dropout_rate=0.1,
                                      ffn_dropout_rate=0.1)
    assert (cfg.train.batch_size, cfg.train.seq_len) == (w["batch"], w["length"])


def test_gpu_batches_pad_about_13_percent_too_and_datasheet_peaks_are_found():
  w = bench_train.GPU_WORKLOADS["base"]
  b = bench_train.random_batch(np.random.default_rng(0), w["batch"], w["length"], 100,
                               w["min_len"])
  lens = (b["tgt"] != bench_train.PAD).sum(1)
  assert lens.min() >= w["min_len"] and 0.11 < 1.0 - lens.mean() / w["length"] < 0.15
  assert bench_train.datasheet_bf16_peak("NVIDIA H100 80GB HBM3") == 989.4e12
  assert bench_train.datasheet_bf16_peak("NVIDIA H100 PCIe") == 756e12
  assert bench_train.datasheet_bf16_peak("cpu") is None


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
