"""Plot a run's curves from its <workdir>/metrics.jsonl: train and validation loss, BLEU/chrF.

    python bench/plot_metrics.py --workdir runs/bible --out docs/bible_run.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--title", default="")
  args = ap.parse_args(argv)
  path = os.path.join(args.workdir, "metrics.jsonl")
  if not os.path.exists(path):
    sys.exit(f"error: no metrics.jsonl in {args.workdir}")
  rows = [json.loads(l) for l in open(path)]
  by = lambda split: [r for r in rows if r.get("split") == split]
  tr, va, te = by("train"), by("validation"), by("test")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
  a0.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=1, label="train (dropout on)")
  a0.plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="validation")
  a0.set_xlabel("step"); a0.set_ylabel("label-smoothed cross-entropy"); a0.legend()
  a0.set_title(args.title or os.path.basename(os.path.normpath(args.workdir)))
  a1.plot([r["step"] for r in va], [r["bleu"] for r in va], "o-", label="validation BLEU")
  a1.plot([r["step"] for r in va], [r["chrf"] for r in va], "s-", label="validation chrF")
  for r in te:
    a1.plot([r["step"]], [r["bleu"]], "r*", ms=12)
    a1.annotate(f"test BLEU {r['bleu']:.1f}, chrF {r['chrf']:.1f}", (r["step"], r["bleu"]),
                textcoords="offset points", xytext=(-150, 12))
  a1.set_xlabel("step"); a1.set_ylabel("sacreBLEU / chrF"); a1.legend(loc="upper left")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fig.savefig(args.out, dpi=100)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
