"""The decode slots (slots.decode_stream) against decoding.decode: the same translations, with
sentences ending at different steps, handing their slots to the next, and the slots'
source width narrowing as the sources get shorter."""
import jax
import numpy as np
import pytest

from seq2seq import decoding, kernels, slots
from seq2seq.errors import UserError
from seq2seq.search import Beam, Greedy, Sample
from test_decoding import CFG, _random_params
from test_search import EOS, V_EAGER, eager_ends_best, eager_ends_logp

BOS = 1
LENGTHS = (30, 3, 17, 9, 24, 2, 25, 12, 5, 28, 21, 7)


@pytest.fixture(scope="module")
def params():
  return _random_params(0)


@pytest.fixture(scope="module")
def sources():
  rng = np.random.default_rng(5)
  return [rng.integers(4, 40, n - 1).tolist() + [3] for n in LENGTHS]


@pytest.fixture(scope="module")
def eos(params, sources):
  """The EOS id that ends this random model's greedy sentences at the most different steps
  (those that never produce it run to their limits, source length + 50)."""
  res = decoding.decode(CFG, params, _batch(sources), Greedy(), bos_id=BOS, eos_id=2)
  toks = res.tokens[:, 0]

  def ends(tok):
    return {int(np.flatnonzero(t == tok)[0]) if (t == tok).any() else -1 for t in toks}
  return max(range(4, CFG.vocab_size), key=lambda tok: (len(ends(tok)), -tok))


def _batch(sources):
  src = np.zeros((len(sources), max(map(len, sources))), np.int32)
  for b, s in enumerate(sources):
    src[b, :len(s)] = s
  return src


BEAM = Beam(size=3, alpha=0.6, n_best=2)


@pytest.mark.parametrize("strategy,table", [   # beam search moving its cache: in the slow tier
    (Greedy(), "reference"), pytest.param(BEAM, "reference", marks=pytest.mark.slow),
    (BEAM, "cpu")],
                         ids=["greedy", "beam", "beam-rows"])
def test_stream_decodes_each_source_as_decode_does(params, sources, eos, strategy, table):
  """With the cpu kernels (where the C++ attention is built) beam search leaves the cache
  ring in place and reads each hypothesis's keys through a table of rows, resized with
  the ring; the reference kernels move every beam's cache."""
  cfg = CFG.replace(kernels=table)
  rows = kernels.get(table).beam_rows(cfg) and isinstance(strategy, Beam)
  state = slots._empty_state(cfg, strategy, 4, 16, 20, 20, bos_id=BOS, pad_id=0)
  assert ("rows" in state["carry"]["state"][0]) == rows
  if table == "cpu" and not rows:
    pytest.skip("the C++ decode attention is not built here (kernels/native.py)")
  want = decoding.decode(CFG, params, _batch(sources), strategy, bos_id=BOS, eos_id=eos)
  assert len(set(want.lengths[:, 0].tolist())) >= 3     # sentences end at different steps
  stats = slots.StreamStats()
  got = slots.decode_stream(cfg, params, sources, strategy, bos_id=BOS, eos_id=eos, slots=4,
                            refill=2, queue=3, stats=stats)
  for b, (tokens, scores, lengths) in enumerate(got):
    np.testing.assert_array_equal(lengths, want.lengths[b])
    for h, n in enumerate(lengths):
      np.testing.assert_array_equal(tokens[h, :n], want.tokens[b, h, :n])
    np.testing.assert_allclose(scores, want.scores[b], rtol=1e-5)
  # Every slot-step accounted for: 12 sentences through 4 slots, several returns (queues of
  # 3, one narrowing from width 32 to 16).
  assert stats.tokens == want.lengths[:, 0].sum()
  assert stats.runs >= 4 and stats.slot_steps == 4 * stats.steps
  # A greedy sentence is busy one step per token; beam search searches on past its best.
  assert stats.tokens <= stats.busy_slot_steps < stats.slot_steps
  assert (stats.busy_slot_steps == stats.tokens) == isinstance(strategy, Greedy)


@pytest.mark.slow   # a sampling loop per batch layout (~4 s)
def test_sampling_does_not_depend_on_the_other_sentences(params, sources, eos):
  strategy, short = Sample(temperature=3.0), [s for s in sources if len(s) <= 16]
  run = lambda srcs, **kw: slots.decode_stream(CFG, params, srcs, strategy, bos_id=BOS,
                                               eos_id=eos, **kw)
  a = run(short, slots=4, refill=1, rng=7)
  b = run(short, slots=2, refill=2, queue=5, rng=7)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x[0], y[0])
    np.testing.assert_allclose(x[1], y[1], rtol=1e-5)
  other = run(short, slots=4, refill=1, rng=8)
  assert any((x[0] != y[0]).any() for x, y in zip(a, other))


def test_bad_stream_arguments_are_user_errors(params):
  run = lambda srcs, **kw: slots.decode_stream(CFG, params, srcs, bos_id=BOS, eos_id=2, **kw)
  assert run([]) == []
  for srcs, kw, msg in (([[5, 3]], dict(slots=0), "slots must be >= 1"),
                        ([[5] * 65], {}, "every source must hold 1 to 64 tokens"),
                        ([[]], {}, "every source must hold"),
                        ([[5, 3]], dict(max_len=65), "max_len must be in")):
    with pytest.raises(UserError, match=msg):
      run(srcs, **kw)


def test_the_loop_compiles_once_per_shape(params, sources, eos, caplog):
  """Several returns to the host per source width (queues of 3), and the state made anew,
  narrowed and refilled between them: one compile of the loop per width and cache ring,
  not a second one for an input placed differently (an uncommitted state)."""
  import logging
  shapes = []
  real = slots._jitted_loop(())

  def loop(*args, **kw):
    state = args[3]
    shapes.append((state["src_valid"].shape, state["carry"]["state"][0]["k"].shape))
    return real(*args, **kw)

  monkeypatch = pytest.MonkeyPatch()
  monkeypatch.setattr(slots, "_jitted_loop", lambda options=(): loop)
  caplog.set_level(logging.WARNING, logger="jax._src.dispatch")
  try:
    with jax.log_compiles():
      # Parameters as a checkpoint gives them: committed to a device.
      slots.decode_stream(CFG.replace(max_len=CFG.max_len - 1),
                          jax.device_put(params, jax.devices()[0]), sources, Greedy(),
                          bos_id=BOS, eos_id=eos, slots=4, refill=2, queue=3)
  finally:
    monkeypatch.undo()
  compiles = [r for r in caplog.records if "compilation of jit(_loop_impl)" in r.getMessage()]
  assert len(shapes) > len(set(shapes)) >= 2          # shapes met more than once
  assert len(compiles) == len(set(shapes)), [r.getMessage() for r in compiles]


@pytest.mark.slow   # two bf16 decodes of every source, each way (~7 s)
def test_bf16_slots_keep_the_cache_as_bits_and_decode_as_decode_does(params, sources, eos):
  """In bf16 with the C++ decode attention (kernels/native.py), the slots keep keys and
  values as bf16's bits (written in place, read by the kernel as they are): greedy gives
  decoding.decode's translations (its cache in bf16); without the kernel, float32."""
  from seq2seq import kernels
  from seq2seq.kernels import cpu, native
  cfg = CFG.replace(dtype="bfloat16", kernels="cpu")
  store = kernels.get("cpu").cache_dtype(cfg)
  assert store == (cpu.BF16_BITS if native.available() else np.float32)
  x = jax.numpy.asarray([1.0, -2.5, 3.14159], jax.numpy.float32)
  np.testing.assert_array_equal(cpu._cached(cpu.cache_store(x, store)).astype(np.float32),
                                x.astype(jax.numpy.bfloat16).astype(np.float32))
  want = decoding.decode(cfg, params, _batch(sources), Greedy(), bos_id=BOS, eos_id=eos)
  got = slots.decode_stream(cfg, params, sources, Greedy(), bos_id=BOS, eos_id=eos, slots=4,
                            refill=2, queue=3)
  for b, (tokens, scores, lengths) in enumerate(got):
    np.testing.assert_array_equal(lengths, want.lengths[b])
    np.testing.assert_array_equal(tokens[0, :lengths[0]], want.tokens[b, 0, :lengths[0]])
    np.testing.assert_allclose(scores, want.scores[b], rtol=2e-3, atol=0.05)   # bf16 sums


class _TableModel:
  """Stands in for the Transformer in decoding.py and slots.py: next-token logits from
  `logp` by step and last token, whatever the source; the caches pass through untouched."""
  logp = None

  def __init__(self, config):
    self.config = config

  def apply(self, variables, *args, method):
    return method(self, *args)

  def encode(self, src_BxS):
    return src_BxS

  def precompute_cross_kv(self, src_BxS):
    c = self.config
    kv = jax.numpy.zeros((src_BxS.shape[0], c.num_heads, src_BxS.shape[1], c.head_dim))
    return tuple((kv, kv) for _ in range(c.num_decoder_layers))

  def decode_step(self, tokens_Nx1, i, cache, cross_kv, src_valid, decode, column=None):
    i_N = jax.numpy.broadcast_to(i, tokens_Nx1.shape[:1])
    return jax.numpy.stack([i_N, tokens_Nx1[:, 0]], -1)[:, None], cache   # y: [N, 1, 2]

  def output_head(self, y_Nx2):
    return jax.numpy.asarray(self.logp, jax.numpy.float32)[y_Nx2[:, 0], y_Nx2[:, 1]]


@pytest.mark.slow   # both loops compiled over five sources (~6 s); test_search has the fixed one
def test_default_beam_outlasts_unlikely_early_ends_in_both_loops(monkeypatch):
  """test_search's model whose likely hypothesis grows while unlikely ones end (the empty
  one at the first step), as a Transformer in both decode loops: with the default stop rule
  (Beam(), decode.py's) each returns the best hypothesis for every source, while "count"
  stops before it ends."""
  logp = eager_ends_logp()
  limit = logp.shape[0] - 1
  score, want = eager_ends_best(logp, Beam().alpha)
  monkeypatch.setattr(_TableModel, "logp", logp)
  for module in (decoding, slots):
    monkeypatch.setattr(module, "Transformer", _TableModel)
  cfg = CFG.replace(vocab_size=V_EAGER, kernels="reference")   # its own compiled loops
  params = _random_params(0, cfg)
  sources = [[5, 3], [7, 8, 9, 3], [6, 3], [4, 4, 4, 3], [9, 3]]
  for strategy in (Beam(), Beam(stop="count")):
    fixed = decoding.decode(cfg, params, _batch(sources), strategy, bos_id=BOS, eos_id=EOS,
                            max_len=limit)
    streamed = slots.decode_stream(cfg, params, sources, strategy, bos_id=BOS, eos_id=EOS,
                                   slots=2, refill=1, max_len=limit)
    for b, (tokens, scores, lengths) in enumerate(streamed):
      for got, got_score in ((tokens[0, :lengths[0]], scores[0]),
                             (fixed.tokens[b, 0, :fixed.lengths[b, 0]], fixed.scores[b, 0])):
        if strategy.stop == "count":
          assert len(got) <= 3 and got_score < score - 4, got
        else:
          assert got.tolist() == want
          assert got_score == pytest.approx(score, abs=1e-5)
