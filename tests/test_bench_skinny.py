"""bench/bench_skinny.py times XLA's and NumPy's few-row FFN chains; they must compute the
same thing, and its FLOP and byte counts must be the chain's."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_skinny  # noqa: E402


def test_measure_counts_the_chain_and_times_all_three():
  r = bench_skinny.measure(d=32, d_ff=48, n_layers=3, rows=5, repeats=1)
  assert r["flops"] == 2 * 5 * 3 * (32 * 48 + 48 * 32)
  assert r["weight_bytes"] == 4 * 3 * (32 * 48 + 48 * 32)
  for name in ("xla_dots", "ynnpack", "numpy"):
    assert r[name]["s"] > 0
    assert r[name]["flops_per_s"] == pytest.approx(r["flops"] / r[name]["s"])


def test_measure_rejects_a_chain_that_computes_something_else(monkeypatch):
  def no_relu(x, layers):
    for w1, w2 in layers:
      x = x + (x @ w1) @ w2
    return x
  monkeypatch.setattr(bench_skinny, "ffn_chain", no_relu)
  with pytest.raises(AssertionError, match="xla_dots"):
    bench_skinny.measure(d=32, d_ff=48, n_layers=2, rows=4, repeats=1)


def test_decode_ceiling_is_the_roofline_with_unlimited_bandwidth():
  import bench_decode
  import seq2seq
  cfg = seq2seq.get_config("small", vocab_size=8000)
  rate = 90e9
  roof = bench_decode.roofline(cfg, batch=16, beams=4, src_len=32, new_tokens=64, run_s=1.0,
                               peak_flops=rate, bandwidth=float("inf"))
  assert bench_skinny.ceiling_tokens_per_s(cfg, 16, 4, rate) == pytest.approx(
      roof["limit_tokens_per_s"])
  # ceilings() picks each workload's row count (batch x beams) from the measured rows, and
  # the rate of the dots the f32 decode loop uses on this CPU (bench_skinny.LOOP).
  other = "ynnpack" if bench_skinny.LOOP == "xla_dots" else "xla_dots"
  fake = [dict(preset="small", rows=n, numpy=dict(flops_per_s=2 * rate),
               **{bench_skinny.LOOP: dict(flops_per_s=rate), other: dict(flops_per_s=9 * rate)})
          for n in (16, 64)]
  got = {(c["model"], c["strategy"]): c for c in bench_skinny.ceilings(fake)}
  assert set(got) == {("small", "greedy"), ("small", "beam4")}
  assert got[("small", "beam4")]["rows"] == 64
  assert got[("small", "beam4")][bench_skinny.LOOP] == pytest.approx(roof["limit_tokens_per_s"])
  assert got[("small", "beam4")]["numpy"] == pytest.approx(2 * roof["limit_tokens_per_s"])
