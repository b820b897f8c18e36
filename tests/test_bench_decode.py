"""bench/bench_decode.py's cost model: the FLOPs and bytes it charges a cached decode step
are counted independently, from the step's own jaxpr (every dot_general) and from the real
parameter and cache arrays the step reads."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import seq2seq
from seq2seq import decoding
from seq2seq.model import Transformer, init_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import bench_decode  # noqa: E402
from jaxpr_flops import dot_flops  # noqa: E402

ROWS, BEAMS, CACHE_LEN, SRC_LEN = 3, 2, 7, 5


def _cfg(dtype):
  return seq2seq.get_config("tiny", vocab_size=53).replace(
      d_model=32, num_heads=4, d_ff=48, num_decoder_layers=2, dropout_rate=0.0, dtype=dtype,
      scan_layers=False)   # one module per layer, as decode steps run


@pytest.mark.slow   # traces and counts a decode step per dtype (~4 s each)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_cost_matches_the_step_jaxpr_and_the_arrays_it_reads(dtype):
  cfg = _cfg(dtype)
  model = Transformer(cfg)
  x = jnp.ones((1, 4), jnp.int32)
  # Only shapes matter to what is counted: zeros, without compiling the initialiser.
  variables = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                     jax.eval_shape(model.init, jax.random.key(0), x, x))
  src = jnp.asarray(np.random.default_rng(0).integers(3, 53, (ROWS, SRC_LEN)), jnp.int32)
  step, cache = decoding.transformer_tokens_to_logits(model, variables, src,
                                                      max_len=CACHE_LEN, repeat=BEAMS)
  seq = jnp.ones((ROWS * BEAMS, CACHE_LEN + 1), jnp.int32)
  closed = jax.make_jaxpr(step)(seq, jnp.int32(2), cache)
  jaxpr = closed.jaxpr
  flops, nbytes = bench_decode.step_cost(cfg, ROWS * BEAMS, CACHE_LEN, SRC_LEN, sources=ROWS)
  assert flops == dot_flops(jaxpr)

  # Bytes: the decoder's parameters except the cross-attention key/value projections (run
  # once per call), the tied head, the self-attention cache of every beam and the
  # cross-attention K, V of every source (its beams share them).
  params = variables["params"]
  per_step = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params["decoder"])
              if not ("cross_attn" in jax.tree_util.keystr(path)
                      and ("'key'" in jax.tree_util.keystr(path)
                           or "'value'" in jax.tree_util.keystr(path)))]
  elements = sum(a.size for a in per_step) + params["embed"]["embedding"].size
  elements += sum(a.size for a in jax.tree_util.tree_leaves(init_cache(cfg, ROWS * BEAMS,
                                                                        CACHE_LEN)))
  cross = model.apply(variables, model.apply(variables, src, method=Transformer.encode),
                      method=Transformer.precompute_cross_kv)
  elements += sum(a.size for a in jax.tree_util.tree_leaves(cross))
  assert nbytes == elements * jnp.dtype(dtype).itemsize
  # ... and those are the arrays the step reads (its jaxpr's constants besides the cache it
  # is passed): one copy of the cross K, V per source, not one per beam.
  assert {a.shape for a in jax.tree_util.tree_leaves(cross)} <= {
      np.shape(c) for c in closed.consts}


def test_roofline_limit_is_the_slower_of_compute_and_memory():
  cfg = _cfg("float32")
  flops, nbytes = bench_decode.step_cost(cfg, ROWS, CACHE_LEN, SRC_LEN)
  # Memory bound: bandwidth so low that bytes take 10x longer than the FLOPs.
  r = bench_decode.roofline(cfg, ROWS, 1, SRC_LEN, CACHE_LEN, run_s=1.0,
                            peak_flops=flops, bandwidth=nbytes / 10.0)
  assert r["bound"] == "memory"
  assert r["limit_tokens_per_s"] == pytest.approx(ROWS * CACHE_LEN / (CACHE_LEN * 10.0))
  assert r["fraction_of_limit"] == pytest.approx(CACHE_LEN * 10.0)
  r = bench_decode.roofline(cfg, ROWS, 1, SRC_LEN, CACHE_LEN, run_s=2.0,
                            peak_flops=flops / 3.0, bandwidth=nbytes)
  assert r["bound"] == "compute"
  assert r["limit_tokens_per_s"] == pytest.approx(ROWS / 3.0)
  assert r["fraction_of_peak"] == pytest.approx(CACHE_LEN * 3.0 / 2.0)


@pytest.mark.slow
def test_compile_times_are_from_scratch_with_a_persistent_cache_configured(tmp_path):
  # JAX_COMPILATION_CACHE_DIR turns JAX's disk cache on in any process: a second run would
  # then report loading a program from disk as its compile time.
  import subprocess
  cache = tmp_path / "jax"
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "bench_decode.py")
  p = subprocess.run([sys.executable, bench, "--models", "small", "--strategies", "greedy",
                      "--modes", "cached", "--new_tokens", "4", "--repeats", "1", "--out",
                      str(tmp_path / "d.json")], env=env, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  assert not cache.exists() or not any(cache.iterdir())
