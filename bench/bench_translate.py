"""Translating a real text file: `translate_nbest` beside CTranslate2, same model, same CPU.

bench_decode.py and bench_peers_ct2.py time a fixed workload (random weights, every row
exactly 64 new tokens). A real file differs: sources of many lengths, outputs that end
when the model says so, a batch that runs until its slowest row is done. This script
translates one file with a trained workdir, in our decoder and in CTranslate2 (the
workdir exported by `python -m seq2seq.export ctranslate2`, run by the peer's own
interpreter through peer_ct2_translate.py), and reports seconds, new tokens per second and
BLEU against the reference, and beside each of our rows the ceiling the matmuls put on its
tokens/s (`matmuls`: the file's source tokens through the encoder's matmuls and its target
tokens through a decode step's, one per sentence and step, those matmuls alone timed in the
same run; `+attn`: with a step's attention too, at the file's mean lengths; `matmul_ceiling`
in the JSON):

    python bench/bench_translate.py --workdir runs/bible \\
        --source $D/test.en --reference $D/test.fr \\
        --peer_python /work/venvs/ct2/bin/python            # ~5 min for 1,007 verses

Ours: `translate_nbest` (what decode.py runs) at each `--dtypes`, `--batch_size` sentences
at a time, with `--batching`: auto (the default, decode.py's: `translate.resolve_batching`),
slots (decode slots that refill: `useful` is the share of slot-steps that made a token of
a returned translation, `busy` in the JSON the share that stepped a sentence still
searching) and/or fixed (batches each run until their slowest sentence ends); with slots
and fixed, the line after the table says on how many sentences they agree. The first pass
compiles (its time is reported apart), then `--repeats` passes, the median reported.
`beam4` is our beam search with decode.py's stop rule (exact), `beam4_best` and
`beam4_count` with the others (search.Beam.stop; count is CTranslate2's). CTranslate2:
`translate_batch` with max_batch_size=batch_size, intra_threads=2, at each
`--compute_types`, after one warm-up batch, median of `--repeats` passes. Beam search:
size 4, length penalty 0.6 for both (CTranslate2 divides by length ** 0.6, we by GNMT's
((5 + length) / 6) ** 0.6); greedy is the same search in both. Length limit: ours is
each source's length + 50, CTranslate2's `--max_decoding_length` (it has no per-source
limit). Both read the same source ids (`translate.encode_sources`: normalised, cut to the
model's max_len). New tokens: the best hypothesis of each sentence, EOS counted.
Writes bench/results/translate.json.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

# name -> (beam size, our stop rule); CTranslate2 runs greedy and beam4 with its own rule.
STRATEGIES = {"greedy": (1, None), "beam4": (4, "exact"), "beam4_best": (4, "best"),
              "beam4_count": (4, "count")}
PEER_STRATEGIES = ("greedy", "beam4")
ALPHA = 0.6


def _lines(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return f.read().splitlines()


def run_ours(model_cfg, params, tok, sentences, strategy_name, batch_size, repeats,
             batching="auto"):
  """`params` already as `decoding.decode_params(model_cfg, ...)` makes them. The first pass
  compiles (from an empty compile cache: this process enables none)."""
  from seq2seq.search import Beam, Greedy
  from seq2seq.slots import StreamStats
  from seq2seq.translate import resolve_batching, translate_nbest
  beam, stop = STRATEGIES[strategy_name]
  strategy = Beam(size=beam, alpha=ALPHA, stop=stop) if beam > 1 else Greedy()
  asked, batching = batching, resolve_batching(batching, strategy, len(sentences),
                                                batch_size, model_cfg)
  seconds = []
  for _ in range(repeats + 1):
    stats = StreamStats()
    t = time.perf_counter()
    out = translate_nbest(params, model_cfg, tok, sentences, strategy, batch_size=batch_size,
                          batching=batching, stats=stats)
    seconds.append(time.perf_counter() - t)
  row = dict(system="seq2seq", precision=model_cfg.dtype, strategy=strategy_name,
             batching=batching, batching_asked=asked,
             auto_batching=resolve_batching("auto", strategy, len(sentences), batch_size,
                                            model_cfg),
             first_pass_s=seconds[0],
             seconds=seconds[1:],
             new_tokens=out.num_tokens, hypotheses=[t[0] for t in out.texts])
  if batching == "slots":   # the share of slot-steps that made a token of a best hypothesis
    row.update(useful=stats.useful, busy=stats.busy, loop_returns=stats.runs)
  return row


def _loop_seconds(model_cfg, fn, *args, repeats: int) -> float:
  """Median seconds of `fn(*args)`, jitted with the decode loop's compiler options."""
  import jax
  from seq2seq import kernels
  from bench_train import timed_calls
  options = kernels.get(model_cfg.kernels).decode_compiler_options(model_cfg) or None
  return statistics.median(timed_calls(jax.jit(fn, compiler_options=options), *args,
                                       repeats=repeats))


def matmul_ceiling(model_cfg, sources: int, beam: int, repeats: int = 30,
                   encoder_rows: int = 256) -> dict:
  """The ceiling the matmuls put on our tokens/s, measured now: one decode step's dense
  products for `sources` sentences of `beam` rows each (Q, K, V; the attention output; the
  cross-attention query and output; the FFN; per decoder layer, then the output head), and
  the encoder's for `encoder_rows` source tokens (per encoder layer Q, K, V, output, FFN;
  then every decoder layer's cross-attention keys and values), each through the kernels'
  own `dense`, compiled as the decode loop is. Each sentence gains at most one token per
  step, so `sources` / (the step's matmul time) is what any loop built on these matmuls
  can reach with attention and all else free (`tokens_per_sec`); `file_ceiling` adds the
  encoder's time for a file's source tokens."""
  import jax
  import jax.numpy as jnp
  from seq2seq import kernels
  ops, c = kernels.get(model_cfg.kernels), model_cfg
  d, f = c.d_model, c.d_ff
  key = iter(jax.random.split(jax.random.key(0), 64))

  def chain_seconds(rows: int, shapes) -> float:
    weights = [jax.random.normal(next(key), s, jnp.float32).astype(c.dtype) * s[0] ** -0.5
               for s in shapes]
    x = jax.random.normal(next(key), (rows, d), jnp.float32)

    def step(y, weights):
      for w in weights:    # each product feeds the next, so they run one after another
        k = w.shape[0]
        x = y[:, :k] if y.shape[1] >= k else jnp.tile(y, (1, -(-k // y.shape[1])))[:, :k]
        y = ops.dense(x, [(w, None)], c.dtype)[0]
      return y
    return _loop_seconds(c, step, x, weights, repeats=repeats)
  step_s = chain_seconds(sources * beam, [(d, 3 * d), (d, d), (d, d), (d, d), (d, f), (f, d)]
                         * c.num_decoder_layers + [(d, c.vocab_size)])
  encoder_s = chain_seconds(encoder_rows, [(d, 3 * d), (d, d), (d, f), (f, d)]
                            * c.num_encoder_layers + [(d, 2 * d)] * c.num_decoder_layers)
  return dict(rows=sources * beam, step_s=step_s, tokens_per_sec=sources / step_s,
              encoder_rows=encoder_rows, encoder_s_per_token=encoder_s / encoder_rows)


def attention_seconds(model_cfg, sources: int, beam: int, self_keys: int, cross_keys: int,
                      repeats: int = 30) -> float:
  """One decode step's attention alone, measured now: per decoder layer the kernels' own
  attention of `sources` sentences of `beam` rows, one query each, over `self_keys` cached
  keys, then over `cross_keys` encoder keys (one copy per sentence), every key visible,
  keys and values stored as the decode loop stores them (`cache_dtype`)."""
  import jax
  import jax.numpy as jnp
  from seq2seq import kernels
  ops, c = kernels.get(model_cfg.kernels), model_cfg
  store, rows, h, dh = ops.cache_dtype(c), sources * beam, c.num_heads, c.head_dim
  key = iter(jax.random.split(jax.random.key(1), 4 * c.num_decoder_layers + 1))
  kv = lambda n, length: ops.cache_store(  # noqa: E731
      jax.random.normal(next(key), (n, h, length, dh), jnp.float32).astype(c.dtype), store)
  caches = [(kv(rows, self_keys), kv(rows, self_keys), kv(sources, cross_keys),
             kv(sources, cross_keys)) for _ in range(c.num_decoder_layers)]
  q = jax.random.normal(next(key), (rows, h, 1, dh), jnp.float32).astype(c.dtype)

  def step(q, caches):
    for k, v, ck, cv in caches:   # each attention's output is the next one's query
      q = ops.attention(q, k, v, jnp.ones((rows, 1, 1, self_keys), bool)).astype(c.dtype)
      q = ops.attention(q, ck, cv, jnp.ones((sources, 1, 1, cross_keys), bool)).astype(c.dtype)
    return q
  return _loop_seconds(c, step, q, caches, repeats=repeats)


def file_ceiling(ceiling: dict, sources: int, source_tokens: int, target_tokens: int,
                 attention_s: float = 0.0) -> float:
  """Tokens/s the matmuls (and, given one step's `attention_s`, the attention) allow for a
  whole file: its target tokens at one per sentence and step (`sources` sentences stepping
  together), plus its source tokens through the encoder."""
  seconds = (target_tokens * (ceiling["step_s"] + attention_s) / sources
             + source_tokens * ceiling["encoder_s_per_token"])
  return target_tokens / seconds


def run_peer(peer_python, model_dir, max_len, tok, sentences, compute_types, strategies,
             batch_size, max_decoding_length, repeats, intra_threads):
  from seq2seq.translate import encode_sources
  ids, _ = encode_sources(tok, sentences, max_len)
  skip = [len(s) == 1 for s in ids]   # empty: "" without decoding, as translate_nbest does
  pieces = [[tok.id_to_piece(i) for i in s[:-1]] for s, e in zip(ids, skip) if not e]
  job = dict(model_dir=model_dir, sources=pieces, compute_types=compute_types,
             strategies=[(s, STRATEGIES[s][0]) for s in strategies if s in PEER_STRATEGIES],
             length_penalty=ALPHA,
             batch_size=batch_size, max_decoding_length=max_decoding_length,
             repeats=repeats, intra_threads=intra_threads)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(job, f)
  try:
    p = subprocess.run([peer_python, os.path.join(ROOT, "bench", "peer_ct2_translate.py"),
                        f.name], capture_output=True, text=True, timeout=6 * 3600)
  finally:
    os.unlink(f.name)
  if p.returncode:
    raise SystemExit(f"peer_ct2_translate.py failed:\n{p.stderr[-3000:]}")
  res = json.loads(p.stdout.strip().splitlines()[-1])
  piece_id = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
  rows = []
  for r in res["results"]:
    if "error" in r:
      rows.append(dict(system="ctranslate2", precision=r["compute_type"], error=r["error"]))
      continue
    hyps = iter(r["hypotheses"])
    texts = ["" if e else tok.decode([piece_id[p] for p in next(hyps)]) for e in skip]
    rows.append(dict(system="ctranslate2", precision=r["compute_type"],
                     strategy=r["strategy"], seconds=r["seconds"],
                     new_tokens=sum(len(h) + 1 for h in r["hypotheses"]), hypotheses=texts))
  return res["version"], rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--source", required=True, help="one sentence per line")
  ap.add_argument("--reference", help="its translations, one per line: BLEU")
  ap.add_argument("--strategies", default="greedy,beam4",
                  help=f"of {', '.join(STRATEGIES)} (beam4_*: our other beam stop rules)")
  ap.add_argument("--dtypes", default="float32,bfloat16", help="ours")
  ap.add_argument("--batching", default="auto", help="ours: auto (what decode.py runs), slots "
                  "(decode slots that refill) and/or fixed (fixed batches)")
  ap.add_argument("--compute_types", default="float32,int8", help="CTranslate2's")
  ap.add_argument("--batch_size", type=int, default=64, help="sentences per batch")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--max_decoding_length", type=int, default=256)
  ap.add_argument("--peer_python", default=sys.executable,
                  help="interpreter with ctranslate2 (its own venv); 'none' skips the peer")
  ap.add_argument("--ct2_model", help="an existing export of --workdir (default: export now)")
  ap.add_argument("--intra_threads", type=int, default=2)
  ap.add_argument("--hypotheses_dir", help="write each row's translations here")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "translate.json"))
  args = ap.parse_args(argv)
  from bench_train import cpu_name
  from seq2seq import decoding, metrics
  from seq2seq.load import load_workdir
  sentences = _lines(args.source)
  references = _lines(args.reference) if args.reference else None
  if references is not None and len(references) != len(sentences):
    raise SystemExit(f"{args.reference} has {len(references)} lines, "
                     f"{args.source} {len(sentences)}")
  strategies = args.strategies.split(",")
  cfg, params, tok = load_workdir(args.workdir)
  from seq2seq.translate import encode_sources
  source_lengths = [len(s) for s in encode_sources(tok, sentences, cfg.model.max_len)[0]]
  decoded = [n for n in source_lengths if n > 1]   # EOS included; empty lines: not decoded
  source_tokens = sum(decoded)
  rows = []
  unknown = [s for s in strategies if s not in STRATEGIES]
  if unknown:
    raise SystemExit(f"unknown strategy {unknown[0]!r}: choose of {', '.join(STRATEGIES)}")
  for dtype in args.dtypes.split(","):
    model_cfg = cfg.model.replace(dtype=dtype)
    decode_params = decoding.decode_params(model_cfg, params)
    for s in strategies:
      for batching in args.batching.split(","):
        rows.append(run_ours(model_cfg, decode_params, tok, sentences, s, args.batch_size,
                             args.repeats, batching))
        sources, beam, tokens = (min(args.batch_size, len(sentences)), STRATEGIES[s][0],
                                 rows[-1]["new_tokens"])
        ceiling = matmul_ceiling(model_cfg, sources, beam)
        ceiling["file_tokens_per_sec"] = file_ceiling(ceiling, sources, source_tokens, tokens)
        # ... and with the attention of a step at the file's mean lengths: half its mean
        # translation cached, its mean source
        ceiling["attention_keys"] = (max(1, round(tokens / len(decoded) / 2)),
                                     max(1, round(source_tokens / len(decoded))))
        ceiling["attention_step_s"] = attention_seconds(model_cfg, sources, beam,
                                                        *ceiling["attention_keys"])
        ceiling["file_with_attention_tokens_per_sec"] = file_ceiling(
            ceiling, sources, source_tokens, tokens, ceiling["attention_step_s"])
        rows[-1]["matmul_ceiling"] = ceiling
        print(f"ours {dtype} {s} {batching}: {statistics.median(rows[-1]['seconds']):.1f} s",
              flush=True)
  version = None
  if args.peer_python != "none":
    with tempfile.TemporaryDirectory() as tmp:
      model_dir = args.ct2_model
      if model_dir is None:
        from seq2seq.export import export_ctranslate2
        model_dir = export_ctranslate2(args.workdir, os.path.join(tmp, "ct2"))["output"]
      version, peer = run_peer(args.peer_python, model_dir, cfg.model.max_len, tok, sentences,
                               args.compute_types.split(","), strategies, args.batch_size,
                               args.max_decoding_length, args.repeats, args.intra_threads)
    rows += peer

  cpu = cpu_name()
  print(f"\n{len(sentences)} sentences of {args.source}, batch {args.batch_size}; "
        f"{cpu}; CTranslate2 {version}")
  print(f"{'system':12} {'precision':10} {'strategy':11} {'batching':8} {'seconds':>8} "
        f"{'first':>6} {'tokens/s':>9} {'BLEU':>6} {'useful':>6} {'matmuls':>8} {'+attn':>7}")
  for r in rows:
    if "error" in r:
      print(f"{r['system']:12} {r['precision']:10} refused: {r['error']}")
      continue
    r["median_s"] = statistics.median(r["seconds"])
    r["tokens_per_sec"] = r["new_tokens"] / r["median_s"]
    if references is not None:
      r["bleu"] = metrics.bleu(r["hypotheses"], references)
    first = f"{r['first_pass_s']:6.1f}" if "first_pass_s" in r else f"{'':6}"
    useful = f"{r['useful']:6.1%}" if "useful" in r else f"{'':6}"
    ceiling = r.get("matmul_ceiling", {})
    ceilings = (f"{ceiling['file_tokens_per_sec']:8.0f} "
                f"{ceiling['file_with_attention_tokens_per_sec']:7.0f}" if ceiling else "")
    print(f"{r['system']:12} {r['precision']:10} {r['strategy']:11} {r.get('batching', ''):8} "
          f"{r['median_s']:8.1f} {first} {r['tokens_per_sec']:9.0f} "
          f"{r.get('bleu', float('nan')):6.2f} {useful} " + ceilings)
  # Our two batchings translate alike (greedy and beam search: the same search per sentence).
  by_key = collections.defaultdict(dict)
  for r in rows:
    if r["system"] == "seq2seq":
      by_key[(r["precision"], r["strategy"])][r["batching"]] = r["hypotheses"]
  for (precision, strategy), h in by_key.items():
    if len(h) == 2:
      same = sum(a == b for a, b in zip(h["slots"], h["fixed"]))
      print(f"ours {precision} {strategy}: slots and fixed batches alike on {same} of "
            f"{len(sentences)} sentences")
      for r in rows:
        if (r["system"], r.get("precision"), r.get("strategy")) == ("seq2seq", precision,
                                                                    strategy):
          r["same_as_other_batching"] = same
  if args.hypotheses_dir:
    os.makedirs(args.hypotheses_dir, exist_ok=True)
    for r in rows:
      if "hypotheses" in r:
        name = ".".join([r["system"], r["precision"], r["strategy"]]
                        + ([r["batching"]] if r.get("batching_asked", "auto") != "auto"
                           else [])) + ".txt"
        with open(os.path.join(args.hypotheses_dir, name), "w", encoding="utf-8") as f:
          f.write("".join(h + "\n" for h in r["hypotheses"]))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(date=datetime.datetime.now().isoformat(timespec="seconds"), cpu=cpu,
                   ctranslate2=version, source=args.source, sentences=len(sentences),
                   batch_size=args.batch_size,
                   rows=[{k: v for k, v in r.items() if k != "hypotheses"} for r in rows]),
              f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
