"""Teacher forcing, label-smoothed cross-entropy, accuracy, the schedule, and learning."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import seq2seq
from seq2seq.losses import accuracy, cross_entropy, shift_right
from seq2seq.optim import make_optimizer, warmup_rsqrt_schedule


def test_shift_right_puts_bos_in_front_and_drops_last():
  tgt = jnp.array([[5, 6, 7, 2, 0], [8, 2, 0, 0, 0]])
  np.testing.assert_array_equal(shift_right(tgt, bos_id=1), [[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]])


def test_shift_right_packed_restarts_each_segment():
  tgt = jnp.array([[5, 6, 2, 7, 2, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(shift_right(tgt, 1, seg), [[1, 5, 6, 1, 7, 0]])


def numpy_smoothed_xent(logits, targets, eps):
  V = logits.shape[-1]
  total, count = 0.0, 0
  for b in range(logits.shape[0]):
    for t in range(logits.shape[1]):
      if targets[b, t] == 0:
        continue
      z = logits[b, t].astype(np.float64)
      logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
      q = np.full(V, eps / (V - 1))
      q[targets[b, t]] = 1 - eps
      # KL(q || p) = Σ q log q - Σ q log p  (0 for a perfect prediction)
      nz = q > 0
      total += float(np.sum(q[nz] * np.log(q[nz])) - np.sum(q * logp))
      count += 1
  return total, count


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_matches_numpy_and_ignores_padding(eps):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
  targets = rng.integers(1, 11, (3, 5))
  targets[0, 3:] = 0
  targets[2, 1:] = 0
  s, n = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), eps)
  want_s, want_n = numpy_smoothed_xent(logits, targets, eps)
  assert float(n) == want_n
  assert float(s) == pytest.approx(want_s, rel=1e-5)
  # Logits at padded positions do not matter.
  logits2 = logits.copy()
  logits2[targets == 0] = 100.0
  assert float(cross_entropy(jnp.asarray(logits2), jnp.asarray(targets), eps)[0]) == pytest.approx(float(s), rel=1e-6)


def test_smoothed_loss_is_zero_at_the_smoothed_target():
  V, eps = 7, 0.1
  q = np.full(V, eps / (V - 1))
  q[3] = 1 - eps
  logits = jnp.asarray(np.log(q)[None, None, :], jnp.float32)
  s, _ = cross_entropy(logits, jnp.array([[3]]), eps)
  assert abs(float(s)) < 1e-5


def test_accuracy_counts_non_pad_only():
  logits = jnp.eye(4)[jnp.array([[1, 2, 3, 3]])] * 5
  c, n = accuracy(logits, jnp.array([[1, 2, 2, 0]]))
  assert (float(c), float(n)) == (2.0, 3.0)


def test_schedule_matches_paper_formula():
  d, w, scale = 512, 4000, 2.0
  sched = warmup_rsqrt_schedule(d, w, scale)
  formula = lambda s: scale * d ** -0.5 * min(s ** -0.5, s * w ** -1.5)
  for step in (1, 100, w, 4 * w, 100000):
    assert float(sched(step)) == pytest.approx(formula(step), rel=1e-5)
  assert float(sched(w)) > float(sched(w // 2)) and float(sched(w)) > float(sched(4 * w))
  assert float(sched(4 * w)) == pytest.approx(float(sched(w)) / 2, rel=1e-5)


def test_cooldown_scales_the_last_steps_linearly_and_nothing_before():
  d, w, total, cool = 64, 20, 100, 30
  paper = warmup_rsqrt_schedule(d, w)
  sched = warmup_rsqrt_schedule(d, w, cooldown_steps=cool, total_steps=total)
  for step in range(1, total + 1):
    factor = 1.0 if step <= total - cool else (total + 1 - step) / cool  # naive
    assert float(sched(step)) == pytest.approx(float(paper(step)) * factor, rel=1e-5), step
  assert float(sched(total)) == pytest.approx(float(paper(total)) / cool, rel=1e-5)
  assert float(sched(total + 5)) == 0.0


def test_train_schedule_uses_the_config_cooldown_and_clamps_it_to_the_run():
  from seq2seq import config as config_lib
  from seq2seq.train_lib import schedule
  cfg = config_lib.get_experiment("numbers")
  cfg = cfg.replace(train=cfg.train.replace(steps=300, warmup_steps=150, cooldown_steps=100))
  paper = warmup_rsqrt_schedule(cfg.model.d_model, 150, cfg.train.learning_rate_scale)
  assert float(schedule(cfg)(200)) == pytest.approx(float(paper(200)), rel=1e-6)
  assert float(schedule(cfg)(251)) == pytest.approx(float(paper(251)) / 2, rel=1e-5)
  short = cfg.replace(train=cfg.train.replace(steps=40))  # a quick run: cooldown = the run
  assert float(schedule(short)(1)) == pytest.approx(float(paper(1)), rel=1e-5)
  assert float(schedule(short)(40)) == pytest.approx(float(paper(40)) / 40, rel=1e-5)
  with pytest.raises(config_lib.ConfigError, match="cooldown_steps"):
    cfg.train.replace(cooldown_steps=-1)


def test_optimizer_is_adam_with_paper_betas_and_uses_step_one_first():
  sched = warmup_rsqrt_schedule(64, 10)
  opt = make_optimizer(sched)
  p = {"w": jnp.ones(3)}
  g = {"w": jnp.array([1.0, -2.0, 0.5])}
  upd, _ = opt.update(g, opt.init(p), p)
  # First Adam step moves each weight by lr(1) in the direction of -sign(g) (ε = 1e-9).
  np.testing.assert_allclose(upd["w"], -float(sched(1)) * np.sign(g["w"]), rtol=1e-5)
  ref = optax.adam(0.1, b1=0.9, b2=0.98, eps=1e-9)
  mine = make_optimizer(0.1)
  s1, s2 = ref.init(p), mine.init(p)
  for i in range(3):
    gi = {"w": g["w"] * (i + 1) - i}
    u1, s1 = ref.update(gi, s1, p)
    u2, s2 = mine.update(gi, s2, p)
    np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)


def test_optimizer_clipping_and_weight_decay():
  p = {"w": jnp.ones(2)}
  g = {"w": jnp.array([300.0, 400.0])}
  clipped = make_optimizer(1.0, clip_grad_norm=1.0, b1=0.0, b2=0.0, eps=0.0)
  u, _ = clipped.update(g, clipped.init(p), p)
  np.testing.assert_allclose(u["w"], -np.sign(g["w"]), rtol=1e-5)
  wd = make_optimizer(0.1, weight_decay=0.5)
  u, _ = wd.update({"w": jnp.zeros(2)}, wd.init(p), p)
  np.testing.assert_allclose(u["w"], -0.1 * 0.5 * np.ones(2), rtol=1e-5)


@pytest.mark.slow   # ~10 s of compiling: the full suite runs it
def test_tiny_model_learns_to_reverse_sequences():
  """Loss, masks, teacher forcing and the optimizer work together: reverse random strings."""
  V, L, B, BOS, EOS = 16, 6, 64, 1, 2
  cfg = seq2seq.TransformerConfig(vocab_size=V, d_model=64, num_heads=4, num_encoder_layers=2,
                                  num_decoder_layers=2, d_ff=128, dropout_rate=0.0, max_len=16)
  model = seq2seq.Transformer(cfg)

  def batch(key):
    src = jax.random.randint(key, (B, L), 4, V)
    tgt = jnp.concatenate([src[:, ::-1], jnp.full((B, 1), EOS)], axis=1)
    return src, tgt

  params = model.init(jax.random.key(0), *batch(jax.random.key(1)))
  opt = make_optimizer(warmup_rsqrt_schedule(64, 100, scale=1.0))
  state = (params, opt.init(params))

  @jax.jit
  def step(state, key):
    params, opt_state = state
    src, tgt = batch(key)
    def loss_fn(p):
      logits = model.apply(p, src, shift_right(tgt, BOS))
      s, n = cross_entropy(logits, tgt, 0.0)
      return s / n, logits
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    upd, opt_state = opt.update(grads, opt_state, params)
    c, n = accuracy(logits, tgt)
    return (optax.apply_updates(params, upd), opt_state), c / n

  accs = []
  for i in range(600):
    state, acc = step(state, jax.random.key(100 + i))
    accs.append(float(acc))
    if i >= 20 and min(accs[-10:]) >= 0.99:
      break
  assert min(accs[-10:]) >= 0.99, f"token accuracy only {accs[-1]:.3f} after {len(accs)} steps"
  assert accs[0] < 0.5  # it really had to learn


@pytest.mark.parametrize("variant", [   # each compiles two train steps: one in the fast tier
    dict(), pytest.param(dict(tie_output=False), marks=pytest.mark.slow),
    pytest.param(dict(share_embeddings=False, tie_output=True), marks=pytest.mark.slow)])
def test_train_step_loss_equals_readable_path_for_every_head_variant(variant):
  """The train/eval step's loss (on CPU the fused head + loss of kernels/cpu_head.py) equals
  logits from `model.apply` followed by `cross_entropy` / `accuracy`, for the tied head, an
  untied head with bias, and a tied head with unshared embeddings; the evaluation's NLL
  equals NumPy's."""
  from seq2seq import train_lib
  from seq2seq.config import Config, TrainConfig
  from seq2seq.model import Transformer
  mc = seq2seq.get_config("tiny", vocab_size=29).replace(dropout_rate=0.0, **variant)
  cfg = Config(model=mc, train=TrainConfig(label_smoothing=0.1))
  rng = np.random.default_rng(0)
  src = jnp.asarray(rng.integers(3, 29, (3, 7)), jnp.int32).at[0, 5:].set(0)
  tgt = jnp.asarray(rng.integers(3, 29, (3, 6)), jnp.int32).at[1, 4:].set(0)
  params = Transformer(mc).init(jax.random.key(0), src, tgt)["params"]
  m = train_lib.eval_step(params, {"src": src, "tgt": tgt}, cfg=cfg, bos_id=1)
  logits = Transformer(mc).apply({"params": params}, src, shift_right(tgt, 1))
  s, n = cross_entropy(logits, tgt, 0.1)
  np.testing.assert_allclose(m["loss_sum"], s, rtol=1e-5)
  assert float(m["tokens"]) == float(n) == 16
  assert float(m["correct"]) == float(accuracy(logits, tgt)[0])
  # The evaluation's NLL (what perplexity is of) has no smoothing: -Σ log p(target), NumPy.
  z = np.asarray(logits, np.float64)
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  t = np.asarray(tgt)
  want_nll = -np.take_along_axis(logp, t[..., None], -1)[..., 0][t != 0].sum()
  np.testing.assert_allclose(m["nll_sum"], want_nll, rtol=1e-5)
  assert abs(float(m["nll_sum"]) - float(s)) > 0.01 * want_nll   # not the smoothed loss


@pytest.mark.slow   # ~10 s of compiling: the full suite runs it
def test_train_step_applies_adam_when_finite_and_skips_a_nonfinite_step():
  """train_step == the optimizer applied by hand (optax.adam on grads / tokens) when the
  loss is finite; with a non-finite loss the parameters and Adam's moments are left
  bit-for-bit as they were, the step counter advances and the bad step is reported."""
  from seq2seq import train_lib
  from seq2seq.config import Config, TrainConfig
  mc = seq2seq.get_config("tiny", vocab_size=29).replace(dropout_rate=0.0)
  # adam_eps well above rounding noise: Adam's first step with ε≈0 is lr·sign(g), which
  # flips for a gradient near 0 between two differently compiled programs.
  cfg = Config(model=mc, train=TrainConfig(label_smoothing=0.1, warmup_steps=5, adam_eps=1e-4))
  rng = np.random.default_rng(0)
  batch = {"src": jnp.asarray(rng.integers(3, 29, (4, 7)), jnp.int32),
           "tgt": jnp.asarray(rng.integers(3, 29, (4, 6)), jnp.int32).at[1, 4:].set(0)}
  state = train_lib.init_state(cfg, jax.random.key(0))
  step = jax.jit(lambda s, b: train_lib.train_step(s, b, cfg=cfg, bos_id=1))

  new, m = step(state, batch)
  grads = jax.jit(jax.grad(
      lambda p: train_lib.loss_and_metrics(cfg, p, batch, 1, train=True)[0]))(state.params)
  grads = jax.tree_util.tree_map(lambda g: g / m["tokens"], grads)
  upd, opt = jax.jit(train_lib.optimizer(cfg).update)(grads, state.opt_state, state.params)
  assert int(new.step) == 1 and int(m["first_bad_step"]) == train_lib._NO_STEP
  for a, b in zip(jax.tree_util.tree_leaves(new.opt_state), jax.tree_util.tree_leaves(opt)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
  delta = jax.tree_util.tree_map(jnp.subtract, new.params, state.params)
  size = max(float(jnp.abs(u).max()) for u in jax.tree_util.tree_leaves(upd))
  assert size > 1e-4
  for a, b in zip(jax.tree_util.tree_leaves(delta), jax.tree_util.tree_leaves(upd)):
    np.testing.assert_allclose(a, b, atol=1e-3 * size)

  bad = new.replace(params=jax.tree_util.tree_map(lambda p: p, new.params))
  bad.params["decoder"]["layers"]["ffn"]["wo"]["kernel"] = (       # layer 0's
      bad.params["decoder"]["layers"]["ffn"]["wo"]["kernel"].at[0, 0, 0].set(jnp.inf))
  after, m2 = step(bad, batch)
  assert not np.isfinite(float(m2["loss_sum"]))
  assert int(after.step) == 2 and int(m2["first_bad_step"]) == 2
  for a, b in zip(jax.tree_util.tree_leaves((after.params, after.opt_state)),
                  jax.tree_util.tree_leaves((bad.params, bad.opt_state))):
    np.testing.assert_array_equal(a, b)
