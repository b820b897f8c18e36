"""CTranslate2 peer on bench_decode.py's workloads: cached decode tokens/s, batch-1 latency.

CTranslate2 (OpenNMT's C++ inference engine for Transformers) decoding the same model as
`bench/bench_decode.py --modes cached` with the same shapes, and, like `bench_decode.py
--latency`, one interactive sentence at a time. It does not import `seq2seq` (the constants
and the layout of the parameters are copied below), so it runs from a venv of its own:

    python3 -m venv /work/venvs/ct2 && /work/venvs/ct2/bin/pip install ctranslate2 numpy

    /work/venvs/ct2/bin/python bench/bench_peers_ct2.py                  # ~5 min on 2 idle cores
    /work/venvs/ct2/bin/python bench/bench_peers_ct2.py --presets small --compute_types float32

The model: random weights drawn as `seq2seq` initialises them (embedding N(0, d^-1/2);
every Dense kernel Glorot-uniform over its flattened fan-in x fan-out; zero biases; unit
LayerNorm scales), in `seq2seq`'s parameter tree, then written with CTranslate2's spec API
(`ctranslate2.specs.TransformerSpec`) by the same mapping as `python -m seq2seq.export
ctranslate2`: post-LN, ReLU, LayerNorm epsilon 1e-6, embeddings x sqrt(d_model) plus our
sinusoid table (interleaved sin/cos from position 0), source and target embeddings shared
and tied to the output layer, zero key bias, PAD's logit -1e9, "</s>" appended to the source,
the decoder starting from "<s>". Saved (float32 weights) to a temporary directory and loaded
with `ctranslate2.Translator(compute_type=..., intra_threads=2, inter_threads=1)`: the
compute type converts the weights at load time. That this mapping computes our model is
checked in tests/test_export.py (test_bench_peer_model_is_ours: this script's random
parameters, fed to our Transformer and to the CTranslate2 model it writes, give the same
per-token log-probabilities), since this script cannot import seq2seq to check it itself.

Workloads (bench_decode.py's): `small` = vocab 8,000, d_model 256, 3+3 layers, 4 heads, d_ff
1,024, batch 16; `base` = vocab 32,000, d_model 512, 6+6 layers, 8 heads, d_ff 2,048, batch 8.
Sources: 32 tokens per row, EOS last (the same random ids as bench_decode.py: numpy
default_rng(0).integers(3, vocab)), no padding. Exactly 64 new tokens per row
(min_decoding_length = max_decoding_length = 64: EOS cannot end a row early; checked).
Strategies: greedy (beam_size 1) and beam4 (beam_size 4, length_penalty 0.6). tokens/s =
batch x 64 / call time, median of `--repeats` calls after one warm-up call.

Length penalty: CTranslate2 divides a finished hypothesis' log-probability by
length ** length_penalty; seq2seq.decoding.Beam by GNMT's ((5 + length) / 6) ** alpha. With
every hypothesis 64 tokens long here, neither changes which beam wins, and both searches do
the same work; on real text the two can rank beams of different lengths differently.

Latency: one sentence of about 20 words (28 source tokens, EOS last), exactly 30 new tokens,
greedy and beam4, batch 1: milliseconds per sentence, median of `--latency_repeats` calls
after 2 warm-up calls; the same measurement as `bench_decode.py --latency`.

Compute types: float32 and int8 (int8 weights; CTranslate2 reports it as int8_float32 on a
CPU, where it is the same thing), and whatever else `--compute_types` asks for: a type the
CPU backend refuses (bfloat16, int8_bfloat16, float16 on CPUs, whatever their ISA) is
recorded with CTranslate2's message. Prints a table, the CPU (/proc/cpuinfo model name, its
AVX-512 / AVX512-BF16 / AMX flags) and CTranslate2's own choice of ISA and GEMM backend
(logged by a child process with CT2_VERBOSE=1); writes JSON to bench/results/peers_ct2.json.

Run it on an idle machine: CTranslate2's OpenMP threads wait for each other after every op,
so while another process holds one of 2 cores a 2-thread call can take many times longer
(small greedy float32 went from 0.09 s to 5.8 s a call beside a test run; `--intra_threads
1` was steady).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# Copied from bench_decode.py / seq2seq.config / seq2seq.data.tokenizer (no seq2seq import).
MODELS = {"small": dict(vocab_size=8000, d_model=256, num_heads=4, num_encoder_layers=3,
                        num_decoder_layers=3, d_ff=1024),
          "base": dict(vocab_size=32000, d_model=512, num_heads=8, num_encoder_layers=6,
                       num_decoder_layers=6, d_ff=2048)}
BATCH = {"small": 16, "base": 8}
SRC_LEN, NEW_TOKENS = 32, 64
LATENCY_SRC_LEN, LATENCY_NEW_TOKENS = 28, 30
MAX_LEN = 256                       # TransformerConfig.max_len
POSITIONS = 1024                    # rows of the position table seq2seq.export writes
PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
STRATEGIES = {"greedy": 1, "beam4": 4}
LENGTH_PENALTY = 0.6
PAD_LOGIT_BIAS = -1e9
COMPUTE_TYPES = ("float32", "int8", "int8_float32", "bfloat16", "int8_bfloat16")


# --- the model ------------------------------------------------------------------------------

def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """seq2seq.layers.sinusoidal_positions: PE(pos, 2i) = sin(pos / 10000^(2i/d)),
  PE(pos, 2i+1) = cos(...)."""
  pos = np.arange(max_len, dtype=np.float64)[:, None]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
  angle = pos / np.power(10000.0, two_i / d_model)
  pe = np.zeros((max_len, d_model), dtype=np.float64)
  pe[:, 0::2] = np.sin(angle)
  pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
  return pe.astype(np.float32)


def random_params(sizes: dict, seed: int = 0) -> dict:
  """Random parameters in seq2seq's tree (post-LN, shared embedding, tied head), drawn
  with seq2seq's initialisers."""
  rng = np.random.default_rng(seed)
  d, f, v = sizes["d_model"], sizes["d_ff"], sizes["vocab_size"]
  heads = (sizes["num_heads"], d // sizes["num_heads"])

  def kernel(shape_in, shape_out):  # flax xavier_uniform over (fan_in, fan_out)
    fan_in, fan_out = math.prod(shape_in), math.prod(shape_out)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32).reshape(
        shape_in + shape_out)

  def dense(shape_in, shape_out, bias=True):
    p = {"kernel": kernel(shape_in, shape_out)}
    if bias:
      p["bias"] = np.zeros(shape_out, np.float32)
    return p

  def attention():
    return {"query": dense((d,), heads), "key": dense((d,), heads, bias=False),
            "value": dense((d,), heads), "out": dense(heads, (d,))}

  def norm():
    return {"norm": {"scale": np.ones(d, np.float32), "bias": np.zeros(d, np.float32)}}

  def ffn():
    return {"wi": dense((d,), (f,)), "wo": dense((f,), (d,))}

  encoder = {f"layers_{i}": {"self_attn": attention(), "self_attn_norm": norm(), "ffn": ffn(),
                             "ffn_norm": norm()} for i in range(sizes["num_encoder_layers"])}
  decoder = {f"layers_{i}": {"self_attn": attention(), "self_attn_norm": norm(),
                             "cross_attn": attention(), "cross_attn_norm": norm(),
                             "ffn": ffn(), "ffn_norm": norm()}
             for i in range(sizes["num_decoder_layers"])}
  embedding = (rng.standard_normal((v, d)) * d ** -0.5).astype(np.float32)
  return {"embed": {"embedding": embedding}, "encoder": encoder, "decoder": decoder}


def vocabulary(vocab_size: int) -> list[str]:
  return SPECIALS + [f"t{i}" for i in range(len(SPECIALS), vocab_size)]


def _out_in(k: np.ndarray, n_in: int) -> np.ndarray:
  """A kernel [in..., out...] as CTranslate2's [out, in]."""
  return np.ascontiguousarray(k.reshape(math.prod(k.shape[:n_in]), -1).T)


def model_spec(sizes: dict, params: dict):
  """The CTranslate2 TransformerSpec of `params` (seq2seq.export's mapping)."""
  from ctranslate2.specs import common_spec, transformer_spec
  d = sizes["d_model"]
  enc = transformer_spec.TransformerEncoderSpec(
      sizes["num_encoder_layers"], sizes["num_heads"], pre_norm=False,
      activation=common_spec.Activation.RELU)
  dec = transformer_spec.TransformerDecoderSpec(
      sizes["num_decoder_layers"], sizes["num_heads"], pre_norm=False,
      activation=common_spec.Activation.RELU)
  spec = transformer_spec.TransformerSpec(enc, dec)

  def norm(s, p):
    s.gamma, s.beta = p["norm"]["scale"], p["norm"]["bias"]

  def linear(s, p, n_in=1):
    s.weight, s.bias = _out_in(p["kernel"], n_in), p["bias"].reshape(-1)

  def qkv(a):
    w = [_out_in(a[n]["kernel"], 1) for n in ("query", "key", "value")]
    return w, [a["query"]["bias"].reshape(-1), np.zeros(d, np.float32),
               a["value"]["bias"].reshape(-1)]

  def self_attention(s, a, n):
    w, b = qkv(a)
    s.linear[0].weight, s.linear[0].bias = np.concatenate(w), np.concatenate(b)
    linear(s.linear[1], a["out"], n_in=2)
    norm(s.layer_norm, n)

  def cross_attention(s, a, n):
    w, b = qkv(a)
    s.linear[0].weight, s.linear[0].bias = w[0], b[0]
    s.linear[1].weight, s.linear[1].bias = np.concatenate(w[1:]), np.concatenate(b[1:])
    linear(s.linear[2], a["out"], n_in=2)
    norm(s.layer_norm, n)

  def ffn(s, p, n):
    linear(s.linear_0, p["wi"])
    linear(s.linear_1, p["wo"])
    norm(s.layer_norm, n)

  emb = params["embed"]["embedding"]
  positions = sinusoidal_positions(max(MAX_LEN, POSITIONS), d)
  enc.embeddings[0].weight, enc.position_encodings.encodings = emb, positions
  dec.embeddings.weight, dec.position_encodings.encodings = emb, positions
  dec.projection.weight = emb
  dec.projection.bias = np.zeros(sizes["vocab_size"], np.float32)
  dec.projection.bias[PAD] = PAD_LOGIT_BIAS
  for i, layer in enumerate(enc.layer):
    p = params["encoder"][f"layers_{i}"]
    self_attention(layer.self_attention, p["self_attn"], p["self_attn_norm"])
    ffn(layer.ffn, p["ffn"], p["ffn_norm"])
  for i, layer in enumerate(dec.layer):
    p = params["decoder"][f"layers_{i}"]
    self_attention(layer.self_attention, p["self_attn"], p["self_attn_norm"])
    cross_attention(layer.attention, p["cross_attn"], p["cross_attn_norm"])
    ffn(layer.ffn, p["ffn"], p["ffn_norm"])
  tokens = vocabulary(sizes["vocab_size"])
  spec.register_source_vocabulary(tokens)
  spec.register_target_vocabulary(tokens)
  c = spec.config
  c.layer_norm_epsilon = 1e-6
  c.unk_token, c.bos_token, c.eos_token, c.decoder_start_token = "<unk>", "<s>", "</s>", "<s>"
  c.add_source_bos, c.add_source_eos = False, True
  return spec


def save_model(sizes: dict, params: dict, output_dir: str) -> str:
  """Writes the float32 CTranslate2 model of `params` to `output_dir` (created)."""
  spec = model_spec(sizes, params)
  spec.validate()
  spec.optimize(quantization="float32")
  os.makedirs(output_dir)
  spec.save(output_dir)
  return output_dir


def sources(vocab_size: int, batch: int, length: int) -> list[list[str]]:
  """bench_decode.workload's random sources (ids in [3, vocab), EOS last) as tokens, EOS
  left to CTranslate2 (add_source_eos)."""
  ids = np.random.default_rng(0).integers(3, vocab_size, (batch, length))
  tokens = vocabulary(vocab_size)
  return [[tokens[i] for i in row[:-1]] for row in ids]


# --- timing ---------------------------------------------------------------------------------

def _calls(translator, src, beam: int, new_tokens: int, repeats: int, warmup: int) -> dict:
  kw = dict(beam_size=beam, min_decoding_length=new_tokens, max_decoding_length=new_tokens,
            max_batch_size=0)
  if beam > 1:
    kw["length_penalty"] = LENGTH_PENALTY

  def call():
    t, c = time.perf_counter(), time.process_time()
    out = translator.translate_batch(src, **kw)
    return time.perf_counter() - t, time.process_time() - c, out

  first_s, _, out = call()
  for r in out:   # every row decoded exactly new_tokens tokens, none of them EOS
    hyp = r.hypotheses[0]
    assert len(hyp) == new_tokens and "</s>" not in hyp, (len(hyp), hyp[-3:])
  for _ in range(warmup - 1):
    call()
  runs = [call()[:2] for _ in range(repeats)]
  return dict(first_call_s=first_s, run_s=statistics.median(r[0] for r in runs),
              runs_s=[r[0] for r in runs], cpu_s=statistics.median(r[1] for r in runs))


def cpu_info() -> dict:
  name, flags = platform.processor() or platform.machine(), set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name") and name in ("", platform.machine()):
          name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return dict(model_name=name, avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
              amx="amx_tile" in flags, cpu_count=os.cpu_count())


def ct2_backend(model_dir: str) -> list[str]:
  """CTranslate2's log of its CPU, ISA and GEMM backends (a child loads the model with
  CT2_VERBOSE=1: the log goes to the process' stderr, not to Python)."""
  code = ("import ctranslate2, sys; ctranslate2.Translator(sys.argv[1], compute_type='float32')")
  p = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True,
                     env={**os.environ, "CT2_VERBOSE": "1"}, timeout=300)
  keep = ("CPU:", "Selected ISA", "Use Intel MKL", "backend")
  return [line.split("] ", 3)[-1].strip() for line in p.stderr.splitlines()
          if any(k in line for k in keep)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="small,base")
  ap.add_argument("--strategies", default=",".join(STRATEGIES))
  ap.add_argument("--compute_types", default=",".join(COMPUTE_TYPES))
  ap.add_argument("--repeats", type=int, default=5, help="timed calls (throughput)")
  ap.add_argument("--latency_repeats", type=int, default=20, help="timed calls (latency)")
  ap.add_argument("--no_latency", action="store_true", help="skip the batch-1 latency rows")
  ap.add_argument("--intra_threads", type=int, default=2)
  ap.add_argument("--inter_threads", type=int, default=1)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "peers_ct2.json"))
  args = ap.parse_args(argv)
  import ctranslate2

  presets, strategies, ctypes = (s.split(",") for s in (args.presets, args.strategies,
                                                         args.compute_types))
  for name, vals, ok in (("preset", presets, MODELS), ("strategy", strategies, STRATEGIES),
                         ("compute type", ctypes, COMPUTE_TYPES)):
    for v in vals:
      if v not in ok:
        sys.exit(f"error: unknown {name} {v!r}; choose from {', '.join(ok)}")
  cpu = cpu_info()
  load_before = os.getloadavg()
  rows, refused, latency, backend = [], {}, [], None
  tmp = tempfile.mkdtemp(prefix="bench_ct2_")
  try:
    for preset in presets:
      sizes = MODELS[preset]
      model_dir = save_model(sizes, random_params(sizes), os.path.join(tmp, preset))
      backend = backend or ct2_backend(model_dir)
      src = sources(sizes["vocab_size"], BATCH[preset], SRC_LEN)
      src1 = sources(sizes["vocab_size"], 1, LATENCY_SRC_LEN)
      for ct in ctypes:
        try:
          translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=ct,
                                              intra_threads=args.intra_threads,
                                              inter_threads=args.inter_threads)
        except ValueError as e:
          refused[ct] = str(e)
          print(f"  {preset:5s} {ct:13s} refused: {e}", file=sys.stderr, flush=True)
          continue
        for sname in strategies:
          beam = STRATEGIES[sname]
          r = _calls(translator, src, beam, NEW_TOKENS, args.repeats, warmup=1)
          r.update(preset=preset, compute_type=ct, effective_compute_type=translator.compute_type,
                   strategy=sname, beam_size=beam, batch=BATCH[preset], src_len=SRC_LEN,
                   new_tokens=NEW_TOKENS, length_penalty=LENGTH_PENALTY if beam > 1 else None,
                   tokens_per_s=BATCH[preset] * NEW_TOKENS / r["run_s"])
          rows.append(r)
          print(f"  {preset:5s} {ct:13s} {sname:6s} {r['tokens_per_s']:8.0f} tok/s  call "
                f"{r['run_s']:.3f}s (cpu {r['cpu_s']:.2f}s)", file=sys.stderr, flush=True)
          if not args.no_latency:
            lat = _calls(translator, src1, beam, LATENCY_NEW_TOKENS, args.latency_repeats,
                         warmup=2)
            lat.update(preset=preset, compute_type=ct, strategy=sname, beam_size=beam,
                       src_len=LATENCY_SRC_LEN, new_tokens=LATENCY_NEW_TOKENS,
                       ms_per_sentence=1e3 * lat["run_s"])
            latency.append(lat)
            print(f"  {preset:5s} {ct:13s} {sname:6s} batch 1: {lat['ms_per_sentence']:7.1f} "
                  f"ms/sentence", file=sys.stderr, flush=True)
        del translator
  finally:
    shutil.rmtree(tmp, ignore_errors=True)

  print(f"\nCTranslate2 {ctranslate2.__version__} peer: {cpu['model_name']} ({cpu['cpu_count']} "
        f"CPUs; AVX-512 {'yes' if cpu['avx512f'] else 'no'}, AVX512-BF16 "
        f"{'yes' if cpu['avx512_bf16'] else 'no'}, AMX {'yes' if cpu['amx'] else 'no'}), "
        f"intra_threads {args.intra_threads}, inter_threads {args.inter_threads}, load "
        f"average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after")
  if backend:
    print("CTranslate2's choice: " + "; ".join(backend))
  head = (f"{'preset':6s} {'compute':13s} {'strategy':8s} {'batch':>5s} {'tok/s':>7s} "
          f"{'call s':>7s} {'cpu s':>6s} {'1st call s':>10s} {'batch-1 ms':>10s}")
  print(f"\nDecode: src_len {SRC_LEN}, exactly {NEW_TOKENS} new tokens per row; tokens/s = batch"
        f" x {NEW_TOKENS} / call, median of {args.repeats} calls after 1 warm-up. batch-1 ms: "
        f"one {LATENCY_SRC_LEN}-token source,\n{LATENCY_NEW_TOKENS} new tokens, median of "
        f"{args.latency_repeats} calls after 2 warm-up. beam4: length_penalty {LENGTH_PENALTY} "
        f"(CTranslate2: score / length^0.6)\n{head}\n{'-' * len(head)}")
  for r in rows:
    lat = next((x for x in latency if (x["preset"], x["compute_type"], x["strategy"]) ==
                (r["preset"], r["compute_type"], r["strategy"])), None)
    print(f"{r['preset']:6s} {r['compute_type']:13s} {r['strategy']:8s} {r['batch']:5d} "
          f"{r['tokens_per_s']:7.0f} {r['run_s']:7.3f} {r['cpu_s']:6.2f} "
          f"{r['first_call_s']:10.2f} {lat['ms_per_sentence'] if lat else float('nan'):10.1f}")
  for ct, msg in refused.items():
    print(f"refused: {ct}: {msg}")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              ctranslate2=ctranslate2.__version__, cpu=cpu, ct2_backend=backend,
              machine=platform.machine(), load_avg_before=load_before,
              load_avg_after=os.getloadavg(), args=vars(args),
              length_penalty=("CTranslate2: log-prob / length^length_penalty; seq2seq: "
                              "log-prob / ((5 + length) / 6)^alpha"),
              supported_compute_types=sorted(ctranslate2.get_supported_compute_types("cpu")))
  with open(args.out, "w") as f:
    json.dump(dict(meta=meta, results=rows, latency=latency, refused=refused), f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
