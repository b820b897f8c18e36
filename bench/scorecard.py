"""The project's speed targets on this machine: runs every benchmark, then one table, met or
missed. The targets were set as multiples of PyTorch peers' figures (nn.Transformer training,
MarianMT decoding) measured on a reference CPU with AMX (REFERENCE_PEERS below).

    python bench/scorecard.py            # all of them: ~11 min on 2 CPU cores
    python bench/scorecard.py --read     # only re-read the results in bench/results/scorecard/
    python bench/scorecard.py --runs decode_bf16,cache   # re-run only those
    python bench/scorecard.py --read --peers bench/results/peers_torch.json   # + PyTorch peers
    python bench/scorecard.py --read --ct2 bench/results/peers_ct2.json   # + CTranslate2 decode
    python bench/scorecard.py --rounds 3   # train and decode speed 3 times, median: ~17 min
    python bench/scorecard.py --read --translate bench/results/translate.json   # + real text

The runs, one after another (each its own process, so none shares the cores with another):
    train.json           bench_train.py --steps 8             small and base, f32 and bf16
    decode_f32.json      bench_decode.py --modes cached
    decode_bf16.json     bench_decode.py --modes cached --dtype bfloat16
    cache.json           bench_decode.py --models small --strategies greedy --modes cached,full
    time_to_target.json  bench_time_to_target.py              `python train.py`, cold
    input.json           bench_input.py
    precision.json       bench_precision.py                   bf16 vs f32 curves (+ .png)
Then scorecard.md (the table, for a note) and scorecard.json beside them. A result measured
on another workload than the targets' (say `--new_tokens 8`), or a time to target with a
warm compile cache, is shown but not counted. The decode targets name no dtype: each dtype
gets its row. Mixed precision is met when even its worst bf16 - f32 pair (mean |d| / loss
over the last 100 of 300 steps) is below the closest seed-to-seed pair: inside the noise.
With --ct2 (bench_peers_ct2.py's JSON, CTranslate2 run in its own venv on this machine), a
second table puts our cached decode beside CTranslate2's: our float32 against its float32
(goal 1.3x) and our fastest precision against its fastest, int8 included (goal 1.0x).
With --translate (bench_translate.py's JSON: a trained workdir translating a real file, ours
beside CTranslate2 in the same run), a third table: float32 against float32 and fastest
against fastest (greedy goal 1.3x, beam 4 goal 1.0x: ours with decode.py's stop rule,
exact, and, where the run has beam4_count, with CTranslate2's, count), the share of our
slot-steps that produce a token (goal 90%), our first pass and both engines' BLEU.
Peers come from bench_peers_torch.py, run in its own venv (see its docstring): with
--peers, each row also says whether ours, over the peer measured here, reaches the multiple
of the reference peer figure that its target asks for ("x peer verdict"), a view that does
not depend on how fast this machine is.

On a shared machine one run of a speed benchmark can land a quarter above or below the
next. `--rounds N` runs the train and decode speed benchmarks N times, interleaved (train,
decode f32, decode bf16, then again), keeps each round's JSON (train.round1.json, ...) and
writes train.json etc. with, per workload, the round of median tokens/s (the lower middle
one for an even N) with all its figures, and every round's tokens/s beside it.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_input import REQUIRED_RATIO  # noqa: E402
from bench_time_to_target import TARGET_S  # noqa: E402
import bench_decode  # noqa: E402
import bench_train  # noqa: E402

RUNS = {  # name -> (command after `python bench/`, what, minutes on 2 AVX-512 cores)
    "train": (["bench_train.py", "--steps", "8"], "train step: small and base, f32 and bf16",
              3),
    "decode_f32": (["bench_decode.py", "--modes", "cached"], "cached decoding, f32", 1),
    "decode_bf16": (["bench_decode.py", "--modes", "cached", "--dtype", "bfloat16"],
                    "cached decoding, bf16", 1),
    "cache": (["bench_decode.py", "--models", "small", "--strategies", "greedy", "--modes",
               "cached,full"], "KV cache against recomputation", 1),
    "time_to_target": (["bench_time_to_target.py"], "python train.py from a cold start", 1),
    "input": (["bench_input.py"], "input pipeline against the train step", 1),
    "precision": (["bench_precision.py"], "bf16 against f32 loss curves, 3 seeds x 300 steps",
                  5),
}
ROUNDED = ("train", "decode_f32", "decode_bf16")   # figures that move with the machine's load
# The peers' figures the targets were set from (PyTorch 2.13 on the reference CPU, with AMX),
# tokens/s, keyed as Row.key. Each target is a multiple of them: ours / the peer's, measured
# side by side on another machine, is judged against that multiple (the "x peer" verdict).
REFERENCE_PEERS = {
    ("train", "small", "float32"): 2250, ("train", "small", "bfloat16"): 3500,
    ("train", "base", "float32"): 390, ("train", "base", "bfloat16"): 700,
    ("decode_cached", "small", "float32", "greedy"): 3240,
    ("decode_cached", "small", "float32", "beam4"): 1490,
    ("decode_cached", "small", "bfloat16", "greedy"): 4330,
    ("decode_cached", "small", "bfloat16", "beam4"): 2060,
    ("decode_cached", "base", "float32", "greedy"): 475,
    ("decode_cached", "base", "float32", "beam4"): 190,
    ("decode_cached", "base", "bfloat16", "greedy"): 780,
    ("decode_cached", "base", "bfloat16", "beam4"): 390,
}
SHORT = {"float32": "f32", "bfloat16": "bf16"}


@dataclasses.dataclass
class Row:
  what: str
  target: float | None = None
  higher_is_better: bool = True
  reported_only: bool = False     # a figure reported beside the targets, with no target
  key: tuple = ()                 # (mode, preset, dtype[, strategy]): where a peer's figure goes
  value: float | None = None      # None: not measured
  detail: str = ""
  not_counted: str = ""           # why a measured value doesn't count
  peer: float | None = None

  @property
  def verdict(self) -> str:
    if self.value is None:
      return "not measured"
    if self.not_counted:
      return "not counted"
    if self.reported_only:
      return ""
    ok = self.value >= self.target if self.higher_is_better else self.value <= self.target
    return "met" if ok else "MISSED"

  @property
  def peer_ratio(self) -> float | None:
    """Ours / the peer's, both measured here."""
    if not self.peer or self.value in (None, float("inf")):
      return None
    return self.value / self.peer

  @property
  def peer_ratio_needed(self) -> float | None:
    """The target as a multiple of the reference peer figure it was set from."""
    return self.target / REFERENCE_PEERS[self.key] if self.key in REFERENCE_PEERS else None

  @property
  def peer_verdict(self) -> str:
    """met / MISSED: ours reaches, against the peer measured here, the multiple of the
    reference peer figure that the target asks for ('' where there is nothing to judge)."""
    if self.peer_ratio is None or self.peer_ratio_needed is None or self.not_counted:
      return ""
    return "met" if self.peer_ratio >= self.peer_ratio_needed else "MISSED"


def _rounds(r: dict) -> str:
  speeds = r.get("rounds_tokens_per_s", [])
  return (f"; median of {len(speeds)} rounds: {' / '.join(f'{x:,.0f}' for x in speeds)}"
          if len(speeds) > 1 else "")


def merge_rounds(name: str, rounds: list[dict]) -> dict:
  """One JSON of run `name` (train or decode_*) from its rounds' JSON: per workload, the
  round with the median tokens/s (the lower middle one for an even count) with all its
  figures (a decode record also gets its round's `matmul_peak`), plus `rounds_tokens_per_s`,
  every round's, in order. A workload that failed in a round is left out of it."""
  train = name == "train"
  by = collections.defaultdict(list)   # workload -> [(tokens/s, record)], one per round
  for res in rounds:
    for r in res["results"]:
      if r.get("failed") or not (train or "cached" in r):
        continue
      if train:
        by[(r["preset"], r["dtype"])].append((r["tokens_per_s"], r))
      else:   # a decode record's % of peak is against its own round's peak
        by[(r["model"], r["strategy"])].append(
            (r["cached"]["tokens_per_s"], dict(r, matmul_peak=res["meta"]["matmul_peak"])))
  merged = []
  for runs in by.values():
    speeds = [speed for speed, _ in runs]
    median = runs[speeds.index(statistics.median_low(speeds))][1]
    merged.append(dict(median, rounds_tokens_per_s=speeds))
  return dict(meta=dict(rounds[0]["meta"], rounds=len(rounds)), results=merged)


def _train_rows(res: dict | None) -> list[Row]:
  got = {(r["preset"], r["dtype"]): r for r in (res or {}).get("results", [])
         if not r.get("failed")}
  rows = []
  for (preset, dtype), target in bench_train.TARGETS.items():
    row = Row(f"train {preset} {SHORT[dtype]}, target tokens/s", target,
              key=("train", preset, dtype))
    r = got.get((preset, dtype))
    if r:
      w = bench_train.WORKLOADS[preset]
      row.value = r["tokens_per_s"]
      row.detail = (f"MFU {100 * r['mfu']:.0f}% of {r['matmul_peak_flops_per_s'] / 1e9:.0f} "
                    f"GFLOP/s; at 100% MFU {r['limit_tokens_per_s']:,.0f}{_rounds(r)}")
      if (r["batch"], r["length"], r["vocab"]) != (w["batch"], w["length"], w["vocab_size"]):
        row.not_counted = f"batch {r['batch']}x{r['length']}, vocab {r['vocab']}"
    rows.append(row)
  base = [r for (p, _), r in sorted(got.items()) if p == "base"]
  compile_row = Row("train base, first-step compile s", bench_train.TARGET_BASE_COMPILE_S,
                    higher_is_better=False)
  if base:
    compile_row.value = max(r["compile_s"] for r in base)
    compile_row.detail = ", ".join(f"{SHORT[r['dtype']]} {r['compile_s']:.1f}" for r in base)
  rows.append(compile_row)
  for preset in bench_train.WORKLOADS:
    mine = [r for (p, _), r in sorted(got.items()) if p == preset]
    rss = Row(f"train {preset}, peak RSS GB", reported_only=True)
    if mine:
      rss.value = max(r["peak_rss_mb"] for r in mine) / 1024
      rss.detail = ", ".join(f"{SHORT[r['dtype']]} {r['peak_rss_mb'] / 1024:.1f}" for r in mine)
    rows.append(rss)
  return rows


def _decode_workload_mismatch(res: dict) -> str:
  """'' if `res` (a bench_decode.py JSON) measured the targets' decode workload, else how
  it differs."""
  args = res.get("meta", {}).get("args", {})
  wrong = [f"{k} {args.get(k)}" for k, v in (("new_tokens", 64), ("src_len", 32))
           if args.get(k) != v]
  return ", ".join(wrong)


def _decode_rows(results: dict[str, dict | None]) -> list[Row]:
  rows, compiles = [], []
  for name, dtype in (("decode_f32", "float32"), ("decode_bf16", "bfloat16")):
    res = results.get(name) or {}
    if res and res["meta"]["args"].get("dtype") != dtype:
      raise ValueError(f"{name}.json holds a {res['meta']['args'].get('dtype')} run")
    wrong = _decode_workload_mismatch(res) if res else ""
    got = {(r["model"], r["strategy"]): r for r in res.get("results", []) if "cached" in r}
    for (model, strategy), target in bench_decode.TARGETS.items():
      row = Row(f"decode {model} {strategy} {SHORT[dtype]}, tokens/s", target,
                key=("decode_cached", model, dtype, strategy))
      r = got.get((model, strategy))
      if r:
        c = r["cached"]
        row.value = c["tokens_per_s"]
        peak = r.get("matmul_peak", res["meta"]["matmul_peak"])["flops_per_s"]
        row.detail = (f"{100 * c['roofline']['fraction_of_peak']:.0f}% of "
                      f"{peak / 1e9:.0f} GFLOP/s; "
                      f"roofline limit {c['roofline']['limit_tokens_per_s']:,.0f}{_rounds(r)}")
        row.not_counted = wrong or ("" if r["batch"] == bench_decode.WORKLOADS[model]["batch"]
                                    else f"batch {r['batch']}")
        if not row.not_counted:
          compiles.append((f"{model} {strategy} {SHORT[dtype]}", c["compile_s"]))
      rows.append(row)
  compile_row = Row("decode loop compile s (slowest)", bench_decode.TARGET_COMPILE_S,
                    higher_is_better=False)
  if compiles:
    slowest = max(compiles, key=lambda x: x[1])
    compile_row.value, compile_row.detail = slowest[1], slowest[0]
  rows.append(compile_row)

  speed = Row("KV cache speedup over recomputation, small greedy",
              bench_decode.TARGET_SPEEDUP)
  res = results.get("cache") or {}
  r = next((r for r in res.get("results", []) if (r["model"], r["strategy"]) ==
            ("small", "greedy") and "speedup" in r), None)
  if r:
    speed.value = r["speedup"]
    speed.detail = (f"{res['meta']['args'].get('dtype')}: {r['cached']['tokens_per_s']:,.0f} "
                    f"vs {r['full']['tokens_per_s']:,.0f} tok/s")
    speed.not_counted = _decode_workload_mismatch(res)
  rows.append(speed)
  return rows


def _time_row(res: dict | None) -> Row:
  row = Row("time to 99% exact match of python train.py, s", TARGET_S, higher_is_better=False)
  if not res:
    return row
  if res.get("time_to_target_s") is None:
    row.value, row.detail = float("inf"), "target not reached"
  else:
    row.value = res["time_to_target_s"]
    row.detail = f"step {res['target_step']}, whole run {res['total_s']:.0f} s"
  if res.get("command") != "python train.py" or res.get("target") != 0.99:
    row.not_counted = f"ran {res.get('command')!r} to {res.get('target')}"
  elif res.get("compile_cache") != "empty":
    row.not_counted = "warm compile cache"
  return row


def _input_rows(res: dict | None) -> list[Row]:
  rows = []
  for name, p in (res or {}).get("pipelines", {}).items():
    rows.append(Row(f"input pipeline {name}, x the train step's batches/s", REQUIRED_RATIO,
                    value=p["ratio_to_train_step"],
                    detail=f"{p['batches_per_s']:,.0f} batches/s"))
  return rows or [Row("input pipeline, x the train step's batches/s", REQUIRED_RATIO)]


def _precision_row(res: dict | None) -> Row:
  row = Row("bf16 vs f32 loss: worst pair's mean difference / loss, last 100 steps, %",
            higher_is_better=False)
  summary = (res or {}).get("summary", {})
  if "dtype" not in summary:
    return row
  d = summary["dtype"]["mean_rel_diff"]
  row.value = 100 * d[1]
  args = res["meta"]["args"]
  if "seed" not in summary:
    row.not_counted = "one seed: no seed-to-seed noise to judge against"
    return row
  s = summary["seed"]["mean_rel_diff"]
  row.target = 100 * s[0]   # the closest seed-to-seed pair
  row.detail = (f"bf16 - f32 {100 * d[0]:.2f}-{100 * d[1]:.2f}%, seed to seed "
                f"{100 * s[0]:.2f}-{100 * s[1]:.2f}% ({summary['seed']['pairs']} pairs)")
  if args.get("steps") not in (None, 300):
    row.not_counted = f"{args.get('steps')} steps"
  return row


def _add_peers(rows: list[Row], peers: dict) -> None:
  got = {}
  for r in peers.get("results", []):
    if not r.get("failed"):
      strategy = (r["strategy"],) if r["mode"] == "decode_cached" else ()
      got[(r["mode"], r["preset"], r["dtype"]) + strategy] = r["tokens_per_s"]
  for row in rows:
    row.peer = got.get(row.key) if row.key else None


def score(results: dict[str, dict | None], peers: dict | None = None) -> list[Row]:
  """The scorecard's rows from the benchmarks' JSON (None or absent: not run)."""
  rows = (_train_rows(results.get("train")) + _decode_rows(results)
          + [_time_row(results.get("time_to_target"))] + _input_rows(results.get("input"))
          + [_precision_row(results.get("precision"))])
  if peers:
    _add_peers(rows, peers)
  return rows


def _num(x: float | None) -> str:
  if x is None:
    return "-"
  if x == float("inf"):
    return "never"
  return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"


# Against CTranslate2 measured on this machine (bench_peers_ct2.py): our float32 at this
# multiple of its float32, and our fastest precision at this multiple of its fastest.
CT2_SAME_PRECISION, CT2_FASTEST = 1.3, 1.0


def ct2_rows(results: dict[str, dict | None], ct2: dict) -> list[dict]:
  """Per decode workload (preset, strategy) measured by both: ours and CTranslate2's cached
  decode tokens/s in float32, and each side's fastest precision (ours f32 or bf16, its
  float32 or int8), with the ratios and whether they reach their multiples."""
  ours: dict = collections.defaultdict(dict)
  for name, dtype in (("decode_f32", "float32"), ("decode_bf16", "bfloat16")):
    for r in (results.get(name) or {}).get("results", []):
      if "cached" in r and not r.get("failed"):
        ours[(r["model"], r["strategy"])][dtype] = r["cached"]["tokens_per_s"]
  theirs: dict = collections.defaultdict(dict)
  for r in ct2.get("results", []):
    theirs[(r["preset"], r["strategy"])][r["compute_type"]] = r["tokens_per_s"]
  out = []
  for key in sorted(ours.keys() & theirs.keys(), key=lambda k: (k[0] != "small", k[1])):
    o, t = ours[key], theirs[key]
    row = dict(preset=key[0], strategy=key[1], ours_f32=o.get("float32"),
               ct2_f32=t.get("float32"))
    row["f32_ratio"] = (row["ours_f32"] / row["ct2_f32"]
                        if row["ours_f32"] and row["ct2_f32"] else None)
    (row["ours_best_dtype"], row["ours_best"]), (row["ct2_best_type"], row["ct2_best"]) = (
        max(d.items(), key=lambda kv: kv[1]) for d in (o, t))
    row["best_ratio"] = row["ours_best"] / row["ct2_best"]
    out.append(row)
  return out


def _verdict(ratio: float | None, need: float) -> str:
  return "" if ratio is None else ("met" if ratio >= need else "MISSED")


def ct2_table(rows: list[dict]) -> str:
  if not rows:
    return "CTranslate2: no decode workload measured by both."
  lines = ["| decode (CTranslate2 measured here) | ours f32 | CT2 float32 | x | "
           f"{CT2_SAME_PRECISION}x | ours fastest | CT2 fastest | x | {CT2_FASTEST}x |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    f32 = "-" if r["f32_ratio"] is None else f"{r['f32_ratio']:.2f}"
    lines.append(
        f"| {r['preset']} {r['strategy']} | {_num(r['ours_f32'])} | {_num(r['ct2_f32'])} | "
        f"{f32} | {_verdict(r['f32_ratio'], CT2_SAME_PRECISION)} | {_num(r['ours_best'])} "
        f"{SHORT.get(r['ours_best_dtype'], r['ours_best_dtype'])} | {_num(r['ct2_best'])} "
        f"{r['ct2_best_type']} | {r['best_ratio']:.2f} | "
        f"{_verdict(r['best_ratio'], CT2_FASTEST)} |")
  return "\n".join(lines)


# Real text (bench_translate.py: a trained workdir translating a file, ours beside
# CTranslate2 in the same run): our float32 against its float32 and our fastest against its
# fastest, greedy at this multiple, beam search at that; and the share of our slot-steps that
# step a sentence still searching (greedy: each makes a token of its translation). Beam
# search twice: with decode.py's stop rule ("exact") and with CTranslate2's ("count": a
# sentence ends once 4 hypotheses have), both against its beam4.
TEXT_GOALS, USEFUL_GOAL = {"greedy": 1.3, "beam4": 1.0, "beam4_count": 1.0}, 0.9
TEXT_LABELS = {"beam4": "beam4 (exact, decode.py's)", "beam4_count": "beam4 (count, CT2's rule)"}


def translate_rows(files: dict[str, dict]) -> list[dict]:
  """Per file (its JSON's path -> content) and strategy measured by both engines: tokens/s
  of each precision's fastest warm pass, the ratios, our first pass (compiles included), our
  useful share of slot-steps and both engines' BLEU."""
  out = []
  for path, res in files.items():
    ours, theirs = collections.defaultdict(dict), collections.defaultdict(dict)
    rows = [r for r in res.get("rows", []) if "error" not in r]
    # Ours as decode.py runs it (batching "auto", as the row records it resolves; results
    # written before rows said so: slots for greedy, fixed for beam search).
    auto = lambda r: r["batching"] == r.get("auto_batching", (  # noqa: E731
        "fixed" if r["strategy"].startswith("beam") else "slots"))
    for r in rows:
      if r["system"] == "seq2seq":
        if auto(r):
          ours[r["strategy"]][r["precision"]] = r
      else:   # CTranslate2's beam4 (its own stop rule) beside both of ours
        for strategy in [r["strategy"]] + (["beam4_count"] if r["strategy"] == "beam4" else []):
          theirs[strategy][r["precision"]] = r
    for strategy in [s for s in TEXT_GOALS if s in ours and s in theirs]:
      o, t = ours[strategy], theirs[strategy]
      best = lambda d: max(d.values(), key=lambda r: r["tokens_per_sec"])  # noqa: E731
      ob, tb = best(o), best(t)
      f32 = (o["float32"]["tokens_per_sec"] / t["float32"]["tokens_per_sec"]
             if "float32" in o and "float32" in t else None)
      out.append(dict(
          source=os.path.basename(res.get("source", path)), sentences=res.get("sentences"),
          strategy=strategy, goal=TEXT_GOALS[strategy],
          ours_f32=o.get("float32", {}).get("tokens_per_sec"),
          ct2_f32=t.get("float32", {}).get("tokens_per_sec"), f32_ratio=f32,
          ours_best=ob["tokens_per_sec"], ours_best_dtype=ob["precision"],
          ct2_best=tb["tokens_per_sec"], ct2_best_type=tb["precision"],
          best_ratio=ob["tokens_per_sec"] / tb["tokens_per_sec"],
          useful=min((r["useful"] for r in o.values() if "useful" in r), default=None),
          busy=min((r["busy"] for r in o.values() if "busy" in r), default=None),
          first_pass_s=max((r["first_pass_s"] for r in o.values()), default=None),
          bleu_ours=ob.get("bleu"), bleu_ct2=tb.get("bleu")))
  return out


def translate_table(rows: list[dict]) -> str:
  if not rows:
    return "Real text: no file translated by both engines."
  lines = ["| real text (bench_translate.py) | ours f32 | CT2 float32 | x | goal | ours fastest"
           " | CT2 fastest | x | goal | busy (≥ 90%) | first pass s | BLEU ours / CT2 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    f32 = "-" if r["f32_ratio"] is None else f"{r['f32_ratio']:.2f}"
    # Judged on the slot-steps that stepped a sentence still searching (`busy`, where the
    # run recorded it): beam search's steps past its returned hypothesis are its stop rule's.
    judged = r["useful"] if r.get("busy") is None else r["busy"]
    useful = ("-" if judged is None else f"{judged:.1%} {_verdict(judged, USEFUL_GOAL)}"
              + (f" (tokens {r['useful']:.1%})" if r.get("busy") not in (None, r["useful"])
                 else ""))
    bleu = ("-" if r["bleu_ours"] is None else
            f"{r['bleu_ours']:.2f} / {r['bleu_ct2']:.2f}")
    lines.append(
        f"| {r['source']} ({r['sentences']}) {TEXT_LABELS.get(r['strategy'], r['strategy'])} | "
        f"{_num(r['ours_f32'])} | "
        f"{_num(r['ct2_f32'])} | {f32} | {r['goal']}x {_verdict(r['f32_ratio'], r['goal'])} | "
        f"{_num(r['ours_best'])} {SHORT.get(r['ours_best_dtype'], r['ours_best_dtype'])} | "
        f"{_num(r['ct2_best'])} {r['ct2_best_type']} | {r['best_ratio']:.2f} | "
        f"{r['goal']}x {_verdict(r['best_ratio'], r['goal'])} | {useful} | "
        f"{_num(r['first_pass_s'])} | {bleu} |")
  return "\n".join(lines)


def table(rows: list[Row]) -> str:
  """A Markdown table (readable as text too)."""
  peers = any(r.peer is not None for r in rows)
  head = ["what", "measured", "target", "verdict",
          *(["peer", "x peer", "x peer needed", "x peer verdict"] if peers else []), "detail"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    target = "" if r.target is None else ("≥ " if r.higher_is_better else "≤ ") + _num(r.target)
    verdict = r.verdict + (f" ({r.not_counted})" if r.not_counted else "")
    cells = [r.what, _num(r.value), target, verdict]
    if peers:
      ratio, needed = r.peer_ratio, r.peer_ratio_needed
      cells += [_num(r.peer), "-" if ratio is None else f"{ratio:.2f}",
                "" if needed is None else f"{needed:.2f}", r.peer_verdict]
    lines.append("| " + " | ".join(cells + [r.detail]) + " |")
  return "\n".join(lines)


def summary(rows: list[Row]) -> str:
  verdicts = [r.verdict for r in rows if not r.reported_only]
  out = (f"{verdicts.count('met')} of {len(verdicts)} targets met, "
         f"{verdicts.count('MISSED')} missed, {verdicts.count('not measured')} not measured, "
         f"{verdicts.count('not counted')} not counted")
  against_peers = [r.peer_verdict for r in rows if r.peer_verdict]
  if against_peers:
    out += (f"; against the peers measured here, {against_peers.count('met')} of "
            f"{len(against_peers)} reach the multiple of the reference peer figure their "
            f"target asks for")
  return out


def read_results(directory: str) -> dict[str, dict | None]:
  out = {}
  for name in RUNS:
    path = os.path.join(directory, f"{name}.json")
    if not os.path.exists(path):
      out[name] = None
      continue
    try:
      with open(path) as f:
        out[name] = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"{path}: not a benchmark's JSON ({e})") from None
  return out


def run(names: list[str], directory: str, rounds: int = 1) -> list[str]:
  """Runs the benchmarks `names` one after another (each replacing its JSON in `directory`;
  those in ROUNDED `rounds` times, interleaved, then merged); returns the ones that failed."""
  os.makedirs(directory, exist_ok=True)
  rounded = [n for n in names if n in ROUNDED] if rounds > 1 else []
  round_files = {n: [f"{n}.round{k}.json" for k in range(1, rounds + 1)] for n in rounded}
  plan = [(n, round_files[n][k], f", round {k + 1} of {rounds}")
          for k in range(rounds) for n in rounded]
  plan += [(n, f"{n}.json", "") for n in names if n not in rounded]
  for n in names:   # a run that fails must not leave an older result to be read
    for f in [f"{n}.json", *round_files.get(n, [])]:
      if os.path.exists(os.path.join(directory, f)):
        os.remove(os.path.join(directory, f))
  failed, t0 = [], time.time()
  left = sum(RUNS[n][2] for n, _, _ in plan)
  for i, (name, filename, round_k) in enumerate(plan):
    cmd, what, minutes = RUNS[name]
    out = os.path.join(directory, filename)
    print(f"\n[{i + 1}/{len(plan)}] {what}{round_k}: python bench/{' '.join(cmd)} "
          f"(~{minutes} min; ~{left} min left)", file=sys.stderr, flush=True)
    t = time.time()
    proc = subprocess.run([sys.executable, os.path.join(HERE, cmd[0]), *cmd[1:], "--out", out])
    left -= minutes
    print(f"[{i + 1}/{len(plan)}] {name}: {'done' if proc.returncode == 0 else 'FAILED'} in "
          f"{time.time() - t:.0f} s ({(time.time() - t0) / 60:.1f} min in all)",
          file=sys.stderr, flush=True)
    if proc.returncode != 0 and name not in failed:
      failed.append(name)
  for name in rounded:
    results = []
    for f in round_files[name]:
      if os.path.exists(os.path.join(directory, f)):
        with open(os.path.join(directory, f)) as fh:
          results.append(json.load(fh))
    if results:
      with open(os.path.join(directory, f"{name}.json"), "w") as fh:
        json.dump(merge_rounds(name, results), fh, indent=2)
  return failed


def _read_peer_file(flag: str, path: str) -> dict | None:
  """A peer benchmark's JSON named by `flag` (None if not given); a bad file is one line."""
  if not path:
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    sys.exit(f"error: {flag} {path}: {e}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dir", default=os.path.join(HERE, "results", "scorecard"),
                  help="where the benchmarks' JSON and the scorecard go")
  ap.add_argument("--read", action="store_true", help="run nothing, read what --dir holds")
  ap.add_argument("--runs", default=",".join(RUNS), help="which benchmarks to run")
  ap.add_argument("--peers", default="", help="bench_peers_torch.py's JSON, for peer columns")
  ap.add_argument("--ct2", default="", help="bench_peers_ct2.py's JSON: a table of our decode "
                  "beside CTranslate2's")
  ap.add_argument("--translate", default="", help="bench_translate.py's JSON files, comma-"
                  "separated: a table of real-text translation beside CTranslate2")
  ap.add_argument("--rounds", type=int, default=1,
                  help="run the train and decode speed benchmarks this many times, interleaved, "
                       "and score each workload's median round")
  args = ap.parse_args(argv)
  if args.rounds < 1:
    sys.exit(f"error: --rounds must be at least 1, got {args.rounds}")
  names = [n for n in args.runs.split(",") if n]
  unknown = [n for n in names if n not in RUNS]
  if unknown:
    sys.exit(f"error: unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
  peers, ct2 = _read_peer_file("--peers", args.peers), _read_peer_file("--ct2", args.ct2)
  texts = {p: _read_peer_file("--translate", p) for p in args.translate.split(",") if p}
  if args.read and not os.path.isdir(args.dir):
    sys.exit(f"error: {args.dir} does not exist: run without --read first")
  failed = [] if args.read else run(names, args.dir, args.rounds)
  try:
    results = read_results(args.dir)
    rows = score(results, peers)
    against_ct2 = None if ct2 is None else ct2_rows(results, ct2)
    ct2_part = "" if ct2 is None else f"\n{ct2_table(against_ct2)}\n"
    real_text = translate_rows(texts) if texts else None
    if texts:
      ct2_part += f"\n{translate_table(real_text)}\n"
  except (ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: {e}" if isinstance(e, ValueError)
             else f"error: a result in {args.dir} lacks {e}: re-run its benchmark")
  host = bench_train.cpu_name()
  md = (f"Speed targets scorecard, {time.strftime('%Y-%m-%d %H:%M')}, {host}; results in "
        f"{args.dir}\n\n{table(rows)}\n\n{summary(rows)}\n{ct2_part}")
  print("\n" + md)
  os.makedirs(args.dir, exist_ok=True)
  with open(os.path.join(args.dir, "scorecard.md"), "w") as f:
    f.write(md)
  with open(os.path.join(args.dir, "scorecard.json"), "w") as f:
    json.dump(dict(machine=host, summary=summary(rows), ctranslate2=against_ct2,
                   real_text=real_text,
                   rows=[dict(dataclasses.asdict(r), verdict=r.verdict,
                              peer_ratio=r.peer_ratio, peer_ratio_needed=r.peer_ratio_needed,
                              peer_verdict=r.peer_verdict,
                              value=None if r.value == float("inf") else r.value)
                         for r in rows]),
              f, indent=2)
  if failed:
    print(f"error: {', '.join(failed)} failed (see above)", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
