"""`python -m seq2seq.export ctranslate2`: the exported CTranslate2 model is the same model.

Tiny random models (post-LN and pre-LN, shared or separate embeddings, tied or untied head;
biases and LayerNorm parameters drawn at random too, so that a misplaced one shows) are
written as real workdirs (config.json, vocab.model, an Orbax checkpoint), exported with the
command line, loaded by CTranslate2 and compared with our forward pass: per-token
log-probabilities (`Translator.score_batch`) to float32 noise, greedy tokens exactly; int8,
int8_float32 and bfloat16 exports close to them. The slow test exports `python train.py`'s
model and translates the 1,002 held-out numbers: greedy float32 exactly as ours, int8 at
least 95% alike, beam search (alpha 0) with our translations and scores.

test_bench_peer_* are the cross-check of bench/bench_peers_ct2.py, which writes its random
models with the CTranslate2 spec API itself (it cannot import seq2seq): its parameters give
the same log-probabilities through our Transformer and through its CTranslate2 model.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2")

from seq2seq import checkpoint as ckpt_lib  # noqa: E402
from seq2seq import export, train_lib  # noqa: E402
from seq2seq.config import get_experiment  # noqa: E402
from seq2seq.data import numbers  # noqa: E402
from seq2seq.data.testing import sentence_pairs  # noqa: E402
from seq2seq.data.tokenizer import BOS_ID, EOS_ID, Tokenizer  # noqa: E402
from seq2seq.load import load_workdir  # noqa: E402
from seq2seq.model import Transformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAIRS = sentence_pairs(40, seed=3)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  path = tmp_path_factory.mktemp("vocab") / "vocab.model"
  pairs = sentence_pairs(300)
  Tokenizer.train([s for p in pairs for s in p], str(path), vocab_size=300)
  return path


def write_workdir(path: Path, vocab: Path, **model) -> tuple:
  """A workdir holding a random tiny model (every parameter perturbed: zero biases and unit
  LayerNorm scales would hide a misplaced one) at step 1: (config, params, tokenizer)."""
  path.mkdir()
  (path / "vocab.model").write_bytes(vocab.read_bytes())
  tok = Tokenizer.load(str(path / "vocab.model"))
  cfg = get_experiment("numbers")
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=tok.vocab_size, d_model=32, num_heads=4,
                                            d_ff=64, **model))
  ckpt_lib.write_config(path, cfg)
  state = train_lib.init_state(cfg, jax.random.key(1))
  leaves, tree = jax.tree_util.tree_flatten(state.params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree_util.tree_unflatten(
      tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  ckpts = ckpt_lib.Checkpoints(path, async_save=False)
  ckpts.save(1, train_lib.TrainState(step=state.step, params=params,
                                     opt_state=state.opt_state), {"step": 1})
  ckpts.close()
  return cfg, params, tok


def run_export(capsys, *argv):
  """(exit code, stdout, stderr) of `python -m seq2seq.export`, in this process."""
  try:
    code = export.main([str(a) for a in argv])
  except SystemExit as e:  # argparse
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def batch(tok, pairs):
  """Our arrays for teacher forcing: source (pieces + EOS), decoder input (BOS + pieces),
  decoder target (pieces + EOS), right-padded with 0; and the id lists."""
  srcs = [tok.encode(s) + [EOS_ID] for s, _ in pairs]
  tgts = [tok.encode(t) for _, t in pairs]
  src = np.zeros((len(pairs), max(map(len, srcs))), np.int32)
  tgt_in = np.zeros((len(pairs), max(map(len, tgts)) + 1), np.int32)
  tgt_out = np.zeros_like(tgt_in)
  for i, (s, t) in enumerate(zip(srcs, tgts)):
    src[i, :len(s)] = s
    tgt_in[i, :len(t) + 1] = [BOS_ID] + t
    tgt_out[i, :len(t) + 1] = t + [EOS_ID]
  return src, tgt_in, tgt_out, srcs, tgts


def our_log_probs(cfg, params, tok, pairs) -> list[np.ndarray]:
  """Per target token (EOS included) log-probabilities of our model, one array a pair, as
  seq2seq.decoding defines them: PAD's logit is -inf (it is never predicted)."""
  src, tgt_in, tgt_out, _, tgts = batch(tok, pairs)
  logits = Transformer(cfg.model).apply({"params": params}, src, tgt_in)
  logits = logits.astype(jnp.float32).at[..., tok.pad_id].set(-jnp.inf)
  lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  return [lp[i, np.arange(len(t) + 1), tgt_out[i, :len(t) + 1]] for i, t in enumerate(tgts)]


# CTranslate2 runs with 1 thread in these tests: its OpenMP threads wait for each other at
# every op, which on a busy 2-core machine can slow a 2-thread run down many-fold.


def ct2_log_probs(translator, tok, pairs) -> list[np.ndarray]:
  pieces = lambda ids: [tok.id_to_piece(i) for i in ids]
  results = translator.score_batch([pieces(tok.encode(s)) for s, _ in pairs],
                                   [pieces(tok.encode(t)) for _, t in pairs])
  for r, (_, t) in zip(results, pairs):
    assert r.tokens == pieces(tok.encode(t)) + ["</s>"], r.tokens
  return [np.asarray(r.log_probs, np.float32) for r in results]


@pytest.mark.parametrize("model", [
    pytest.param(dict(pre_ln=False), marks=pytest.mark.slow),
    pytest.param(dict(pre_ln=False, share_embeddings=False, tie_output=False),
                 marks=pytest.mark.slow),
    pytest.param(dict(pre_ln=True, share_embeddings=True, tie_output=False),
                 marks=pytest.mark.slow),
    pytest.param(dict(pre_ln=True, share_embeddings=False, tie_output=True),
                 marks=pytest.mark.slow),
], ids=["post_ln", "post_ln-separate-untied", "pre_ln-untied", "pre_ln-separate"])
def test_ct2_log_probs_and_greedy_tokens_equal_ours(model, vocab, tmp_path, capsys):
  cfg, params, tok = write_workdir(tmp_path / "w", vocab, **model)
  code, out, err = run_export(capsys, "ctranslate2", "--workdir", tmp_path / "w",
                              "--output", tmp_path / "ct2")
  assert code == 0, err
  assert out.startswith(f"wrote {tmp_path / 'ct2'}: CTranslate2 "), out
  assert sorted(os.listdir(tmp_path / "ct2")) == [
      "config.json", "model.bin", "shared_vocabulary.json", "vocab.model"]
  vocabulary = json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text())
  assert vocabulary == [tok.id_to_piece(i) for i in range(tok.vocab_size)]
  assert vocabulary[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
  # Our LayerNorm's epsilon: CTranslate2's default (1e-5) is too close to tell by outputs.
  assert json.loads((tmp_path / "ct2" / "config.json").read_text())["layer_norm_epsilon"] \
      == 1e-6

  translator = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type="float32",
                                      intra_threads=1)
  ours, theirs = our_log_probs(cfg, params, tok, PAIRS), ct2_log_probs(translator, tok, PAIRS)
  worst = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
  spread = float(np.std(np.concatenate(ours)))
  assert worst < 1e-4 and spread > 0.5, (worst, spread)

  # Greedy decoding: the same tokens, EOS or not (the random model rarely ends).
  from seq2seq.decoding import decode
  from seq2seq.search import Greedy
  src, *_ = batch(tok, PAIRS[:8])
  res = decode(cfg.model, params, src, Greedy(), bos_id=BOS_ID, eos_id=EOS_ID, max_len=20)
  hyps = translator.translate_batch([[tok.id_to_piece(i) for i in tok.encode(s)]
                                     for s, _ in PAIRS[:8]], beam_size=1,
                                    max_decoding_length=20)
  ids = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
  theirs = [[ids[p] for p in h.hypotheses[0]] for h in hyps]
  assert theirs == res.token_lists(EOS_ID)


@pytest.mark.parametrize("quantization, compute_type, mean_tol", [
    ("int8", "int8", 0.1), ("int8_float32", "int8_float32", 0.1),
    ("bfloat16", "float32", 0.05)])
def test_quantized_exports_run_and_mostly_agree(quantization, compute_type, mean_tol, vocab,
                                                tmp_path, capsys):
  """What the export writes: quantized weights and their scales. Loaded back as float32
  (CTranslate2 dequantizes them at load), they score like ours up to the quantization's
  error, on every CPU. With the quantized compute type, CTranslate2's own kernels run (their
  int8 arithmetic differs between CPUs: without AVX-512 VNNI the mean error reaches ~0.6
  on this random model; the trained model's int8 translations are checked in the slow
  test below)."""
  cfg, params, tok = write_workdir(tmp_path / "w", vocab)
  code, out, err = run_export(capsys, "ctranslate2", "--workdir", tmp_path / "w", "--output",
                              tmp_path / "ct2", "--quantization", quantization)
  assert code == 0 and f"{quantization} weights" in out, (out, err)
  ours = np.concatenate(our_log_probs(cfg, params, tok, PAIRS))
  stored = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type="float32",
                                  intra_threads=1)
  theirs = np.concatenate(ct2_log_probs(stored, tok, PAIRS))
  err = np.abs(ours - theirs)
  # Really quantized (not float32 noise), yet the same model: a small mean error, and the
  # log-probabilities still ordered alike.
  assert 1e-3 < err.mean() < mean_tol, err.mean()
  assert np.corrcoef(ours, theirs)[0, 1] > 0.99
  kernels = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type=compute_type,
                                   intra_threads=1)
  assert all(np.isfinite(lp).all() for lp in ct2_log_probs(kernels, tok, PAIRS))


def assert_refused(code, out, err, message):
  assert code == 2 and out == "", (code, out, err)
  assert err.startswith("error: ") and len(err.splitlines()) == 1, err
  assert message in err, err


def test_bad_input_is_one_line_and_exit_2_leaving_nothing(vocab, tmp_path, capsys, monkeypatch):
  write_workdir(tmp_path / "w", vocab)
  existing = tmp_path / "existing"
  existing.mkdir()
  (existing / "keep").write_text("x")
  for argv, message in [
      (["ctranslate2", "--workdir", tmp_path / "w", "--output", existing], "already exists"),
      (["onnx", "--workdir", tmp_path / "w", "--output", tmp_path / "o"], "invalid choice"),
      (["ctranslate2", "--workdir", tmp_path / "w", "--output", tmp_path / "o",
        "--quantization", "int4"], "invalid choice"),
      (["ctranslate2", "--workdir", tmp_path / "none", "--output", tmp_path / "o"],
       "does not exist"),
      (["ctranslate2", "--workdir", tmp_path / "w", "--output", tmp_path / "o",
        "--checkpoint-step", "7"], "no checkpoint at step 7"),
      (["ctranslate2", "--workdir", tmp_path / "w", "--output", tmp_path / "no" / "o"],
       "is not a directory")]:
    assert_refused(*run_export(capsys, *argv), message)
  assert (existing / "keep").read_text() == "x"

  # A workdir whose training never saved a checkpoint.
  nockpt = tmp_path / "nockpt"
  nockpt.mkdir()
  for name in ("config.json", "vocab.model"):
    (nockpt / name).write_bytes((tmp_path / "w" / name).read_bytes())
  assert_refused(*run_export(capsys, "ctranslate2", "--workdir", nockpt, "--output",
                             tmp_path / "o"), "holds no checkpoint")
  # ctranslate2 not installed (None in sys.modules makes its import fail like a missing one).
  monkeypatch.setitem(sys.modules, "ctranslate2", None)
  assert_refused(*run_export(capsys, "ctranslate2", "--workdir", tmp_path / "w", "--output",
                             tmp_path / "o"), "ctranslate2 is not installed: pip install")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "nockpt", "w"]


def test_help_needs_no_ctranslate2():
  p = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ctranslate2'] = None; "
                      "from seq2seq.export import main; main(['--help'])"],
                     cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert p.returncode == 0 and "--quantization" in p.stdout, p.stderr


# --- the trained default model ------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(default_run, tmp_path_factory):
  """`python train.py`'s default run (conftest's `default_run`) in `w`, and its exports."""
  root = tmp_path_factory.mktemp("trained")
  (root / "w").symlink_to(default_run[0])
  for q in ("float32", "int8"):
    p = subprocess.run([sys.executable, "-m", "seq2seq.export", "ctranslate2", "--workdir",
                        str(root / "w"), "--output", str(root / q), "--quantization", q],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith(f"wrote {root / q}"), p.stderr[-2000:]
  return root


@pytest.mark.slow
def test_trained_model_translates_held_out_numbers_like_ours(trained):
  from seq2seq.search import Beam, Greedy
  from seq2seq.translate import translate, translate_nbest
  cfg, params, tok = load_workdir(trained / "w")
  test = numbers.split_numbers()["test"]
  sentences = [numbers.number_words(int(n), "en") for n in test]
  references = [numbers.number_words(int(n), "fr") for n in test]
  ours = translate(params, cfg.model, tok, sentences, Greedy(), max_len=48)

  ids = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
  sources = [[tok.id_to_piece(i) for i in tok.encode(s)] for s in sentences]

  def ct2(model_dir, compute_type):
    translator = ctranslate2.Translator(str(model_dir), compute_type=compute_type,
                                        intra_threads=1)
    out = translator.translate_batch(sources, beam_size=1, max_decoding_length=48,
                                     max_batch_size=64)
    return [tok.decode([ids[p] for p in h.hypotheses[0]]) for h in out]

  f32 = ct2(trained / "float32", "float32")
  assert np.mean([a == r for a, r in zip(ours, references)]) >= 0.95   # a trained model
  diff = [(s, a, b) for s, a, b in zip(sentences, ours, f32) if a != b]
  assert not diff, diff[:5]
  int8 = ct2(trained / "int8", "int8")
  agree = np.mean([a == b for a, b in zip(ours, int8)])
  assert agree >= 0.95, [(s, a, b) for s, a, b in zip(sentences, ours, int8) if a != b][:5]

  # Beam search ranking by log-probability (alpha 0 / length_penalty 0; the two length
  # penalties differ): the same translations with the same scores. min_decoding_length=0:
  # CTranslate2's default 1 would ban EOS first and renormalise the first step.
  some = slice(0, None, 16)   # 63 of them, one batch: our beam search is the slow part here
  beam = translate_nbest(params, cfg.model, tok, sentences[some], Beam(size=4, alpha=0.0),
                         max_len=48)
  translator = ctranslate2.Translator(str(trained / "float32"), compute_type="float32",
                                      intra_threads=1)
  out = translator.translate_batch(sources[some], beam_size=4, length_penalty=0.0,
                                   min_decoding_length=0, max_decoding_length=48,
                                   max_batch_size=64, return_scores=True)
  assert [tok.decode([ids[p] for p in h.hypotheses[0]]) for h in out] == [
      t[0] for t in beam.texts]
  np.testing.assert_allclose([h.scores[0] for h in out], [s[0] for s in beam.scores],
                             atol=1e-4)


# --- bench/bench_peers_ct2.py's model -------------------------------------------------------

def _bench_module(name):
  sys.path.insert(0, str(ROOT / "bench"))
  try:
    return __import__(name)
  finally:
    sys.path.remove(str(ROOT / "bench"))


@pytest.mark.slow   # the CTranslate2 benchmark's own model (~4 s)
def test_bench_peer_model_is_ours(tmp_path):
  """The peer benchmark cannot import seq2seq: its parameters (perturbed, so that biases and
  LayerNorms count) go through our Transformer and through the CTranslate2 model it writes,
  and give the same log-probabilities; its sources are bench_decode.py's."""
  from seq2seq.config import TransformerConfig
  bench = _bench_module("bench_peers_ct2")
  sizes = dict(vocab_size=300, d_model=32, num_heads=4, num_encoder_layers=2,
               num_decoder_layers=2, d_ff=64)
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map(lambda x: x + 0.3 * rng.standard_normal(x.shape, np.float32),
                                  bench.random_params(sizes, seed=0))
  cfg = TransformerConfig(**sizes, max_len=bench.MAX_LEN, dropout_rate=0.0,
                          scan_layers=False)   # the layout load_workdir gives
  x = jnp.ones((1, 4), jnp.int32)
  ours_shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), x, x)["params"])
  assert jax.tree_util.tree_map(np.shape, params) == jax.tree_util.tree_map(
      lambda a: a.shape, ours_shapes)

  bench.save_model(sizes, params, str(tmp_path / "ct2"))
  translator = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type="float32",
                                      intra_threads=1)
  tokens = bench.vocabulary(sizes["vocab_size"])
  ids = np.random.default_rng(2).integers(3, sizes["vocab_size"], (6, 20))
  src_lens, tgt_lens = [20, 17, 9, 13, 20, 5], [19, 4, 11, 20, 7, 12]
  srcs = [list(ids[i, :n]) for i, n in enumerate(src_lens)]
  tgts = [list(ids[::-1][i, :n]) for i, n in enumerate(tgt_lens)]
  results = translator.score_batch([[tokens[i] for i in s] for s in srcs],
                                   [[tokens[i] for i in t] for t in tgts])
  src = np.zeros((6, 21), np.int32)
  tgt_in, tgt_out = np.zeros((6, 21), np.int32), np.zeros((6, 21), np.int32)
  for i, (s, t) in enumerate(zip(srcs, tgts)):
    src[i, :len(s) + 1] = s + [EOS_ID]
    tgt_in[i, :len(t) + 1] = [BOS_ID] + t
    tgt_out[i, :len(t) + 1] = t + [EOS_ID]
  logits = Transformer(cfg).apply({"params": params}, src, tgt_in).astype(jnp.float32)
  lp = np.asarray(jax.nn.log_softmax(logits.at[..., 0].set(-jnp.inf), axis=-1))
  for i, (r, t) in enumerate(zip(results, tgts)):
    ours = lp[i, np.arange(len(t) + 1), tgt_out[i, :len(t) + 1]]
    np.testing.assert_allclose(r.log_probs, ours, atol=1e-4)

  # The same sources as bench_decode.py (which appends EOS itself; CTranslate2 adds it).
  bench_decode = _bench_module("bench_decode")
  want = bench_decode.random_sources(8000, 16, 32)
  got = bench.sources(8000, 16, 32)
  assert got == [[bench.vocabulary(8000)[i] for i in row[:-1]] for row in want]
  assert want[:, -1].tolist() == [EOS_ID] * 16


@pytest.mark.slow   # the CTranslate2 benchmark's own model (~4 s)
def test_bench_peer_init_scales_are_ours():
  """The peer's random weights have our initialisers' scales (per parameter, `small`)."""
  from seq2seq.config import get_config
  bench = _bench_module("bench_peers_ct2")
  peer = bench.random_params(bench.MODELS["small"], seed=0)
  cfg = get_config("small", vocab_size=8000).replace(scan_layers=False)
  x = jnp.ones((1, 4), jnp.int32)
  ours = jax.jit(Transformer(cfg).init)(jax.random.key(0), x, x)["params"]
  assert jax.tree_util.tree_structure(peer) == jax.tree_util.tree_structure(ours)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(peer),
                          jax.tree_util.tree_leaves(ours)):
    a, b = np.asarray(a), np.asarray(b)
    assert abs(a.mean() - b.mean()) < 0.01, jax.tree_util.keystr(path)
    assert a.std() == pytest.approx(b.std(), rel=0.02, abs=1e-6), jax.tree_util.keystr(path)
