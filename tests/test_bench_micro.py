"""bench/micro.py on tiny shapes: each form it times computes what the plain form does (and a
wrong one is caught), and the FLOPs it divides by are those of the jaxpr it runs."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seq2seq.kernels import cpu, cpu_head

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_decode  # noqa: E402
import micro  # noqa: E402
from jaxpr_flops import dot_flops  # noqa: E402

M, K, N = 32, 24, 40    # all distinct, so a swapped dimension would show


def _flops(f, *shapes, dtype="float32"):
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  return dot_flops(jax.make_jaxpr(f)(*args).jaxpr)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layouts_time_forms_that_agree_and_count_their_flops(dtype):
  r = micro.layouts_measure(M, K, N, dtype, repeats=1)
  for name, form in micro.LAYOUT_FORMS.items():
    assert _flops(form, (M, K), (K, N), (M, N), dtype=dtype) == r["flops"], name
    assert r[name]["s"] > 0 and r[name]["flops_per_s"] == pytest.approx(r["flops"] / r[name]["s"])


def test_layouts_catch_a_form_that_computes_something_else():
  wrong = dict(micro.LAYOUT_FORMS, dw_ours=lambda x, w, g: cpu.dot_tn(x, g) * 1.01)
  with pytest.raises(AssertionError, match="dw_ours against dw_plain"):
    micro.layouts_measure(M, K, N, "bfloat16", repeats=1, forms=wrong)


def test_few_rows_layouts_agree_and_count_the_weights_read():
  r = micro.few_rows_measure(4, K, N, "bfloat16", repeats=1, cold_bytes=8 * K * N)
  assert r["weight_bytes"] == 2 * K * N and r["copies"] == 4
  for name in ("x.W cold", "x.(Wt)t cold", "x.W hot", "x.(Wt)t hot"):
    assert r[name]["bytes_per_s"] == pytest.approx(r["weight_bytes"] / r[name]["s"])


def test_skinny_chain_agrees_with_numpy_and_counts_its_flops_and_bytes():
  d, d_ff, layers, rows = 16, 24, 3, 4
  r = micro.skinny_measure(d, d_ff, layers, rows, repeats=1)
  ws = [((d, d_ff), (d_ff, d))] * layers
  chain = lambda x, *w: micro.ffn_chain(x, list(zip(w[::2], w[1::2])))
  assert r["flops"] == _flops(chain, (rows, d), *[s for pair in ws for s in pair])
  assert r["weight_bytes"] == 4 * sum(np.prod(s) for pair in ws for s in pair)
  assert {"xla_dots", "ynnpack", "numpy"} <= set(r)


def test_ceilings_read_each_decode_workload_at_its_own_row_count():
  def measured(preset, rows, rate):
    return dict(preset=preset, rows=rows, ynnpack=dict(flops_per_s=rate),
                numpy=dict(flops_per_s=2 * rate))
  # small greedy decodes 16 rows, small beam 4 64, base greedy 8; base beam 4 (32) is absent.
  results = [measured("small", 16, 1e11), measured("small", 64, 3e11), measured("base", 8, 5e10),
             measured("small", 32, 9e11)]
  got = {(c["model"], c["strategy"]): c for c in micro.ceilings(results)}
  assert set(got) == {("small", "greedy"), ("small", "beam4"), ("base", "greedy")}
  for (model, strategy), rate in ((("small", "greedy"), 1e11), (("small", "beam4"), 3e11),
                                  (("base", "greedy"), 5e10)):
    w = bench_decode.WORKLOADS[model]
    beams = 4 if strategy == "beam4" else 1
    cfg = micro.seq2seq.get_config(model, vocab_size=w["vocab_size"])
    flops, _ = bench_decode.step_cost(cfg, w["batch"] * beams, 64, 32, sources=w["batch"])
    c = got[(model, strategy)]
    assert c["rows"] == w["batch"] * beams
    assert c["ynnpack"] == pytest.approx(w["batch"] * rate / flops)
    assert c["numpy"] == pytest.approx(2 * c["ynnpack"])


def test_head_chunks_cli_writes_the_rule_and_the_heads_flops(tmp_path):
  out = tmp_path / "head.json"
  batch, length, vocab = 4, 8, 50
  micro.main(["head_chunks", "--presets", "tiny", "--vocab", str(vocab), "--batch", str(batch),
              "--length", str(length), "--chunks", "1,2", "--dtypes", "float32",
              "--repeats", "1", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["what"] == "head_chunks" and "CPUs" in saved["machine"]
  (r,) = saved["results"]
  d = micro.seq2seq.get_config("tiny").d_model
  assert (r["batch"], r["length"], r["d"], r["vocab"]) == (batch, length, d, vocab)
  assert r["rule"] == cpu_head.head_chunks(batch, length, vocab)
  assert set(r["by_chunks"]) == {"1", "2"}

  t = jnp.ones((batch, length), jnp.int32)
  loss = lambda y, w: cpu_head.head_loss(y, w, None, t, jnp.ones(t.shape), chunks=1)[0]
  assert r["flops"] == _flops(jax.value_and_grad(loss, argnums=(0, 1)), (batch, length, d),
                              (vocab, d))


def test_int8_forms_agree_with_float32_and_a_wrong_one_is_caught():
  r = micro.int8_measure(4, K, N, repeats=1, cold_bytes=8 * K * N)
  assert r["copies"] == 4 and r["bf16"]["s"] > 0 and r["int8"]["s"] > 0
  wrong = dict(micro.INT8_FORMS, int8=lambda x, w: micro.int8_dot(x, w[0], w[1] * 1.1))
  with pytest.raises(AssertionError, match="int8 against float32"):
    micro.int8_measure(4, K, N, repeats=1, cold_bytes=8 * K * N, forms=wrong)


def test_int8_dot_is_the_product_of_the_quantized_operands():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((K, N)).astype(np.float32)
  wq, s = micro.int8_weights(jnp.asarray(w))
  assert wq.dtype == jnp.int8 and np.abs(np.asarray(wq)).max() == 127
  a = np.abs(x).max(axis=1, keepdims=True) / 127
  xq = np.round(x / a)
  want = (xq.astype(np.int64) @ np.asarray(wq, np.int64)) * a * np.asarray(s)
  np.testing.assert_allclose(micro.int8_dot(jnp.asarray(x), wq, s), want, rtol=1e-5, atol=1e-5)


def test_int8_step_weights_are_the_step_matmuls_bench_decode_counts():
  cfg = micro.seq2seq.get_config("base", vocab_size=32000)
  flops = sum(2 * 8 * k * n * count for k, n, count in micro.decode_step_weights(cfg))
  want, _ = bench_decode.step_cost(cfg, 8, 0, 0)   # no attention: the weights' matmuls only
  assert flops == want
