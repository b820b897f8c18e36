"""Plot a run's curves from its <workdir>/metrics.jsonl: train and validation loss, BLEU/chrF.

    python bench/plot_metrics.py --workdir runs/bible --out docs/bible_run.png
"""
from __future__ import annotations

import os
import sys

from seq2seq.errors import ArgumentParser
from seq2seq.metrics import read_metrics


def main(argv=None):
  ap = ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument("--title", default="")
  args = ap.parse_args(argv)
  if not os.path.exists(os.path.join(args.workdir, "metrics.jsonl")):
    sys.exit(f"error: no metrics.jsonl in {args.workdir}")
  rows = read_metrics(args.workdir)
  if not rows:
    sys.exit(f"error: {args.workdir}/metrics.jsonl holds no metrics yet")
  def curve(split, key):  # (steps, values) of the rows of `split` that hold `key`
    pts = [(r["step"], r[key]) for r in rows if r.get("split") == split and key in r]
    return [p[0] for p in pts], [p[1] for p in pts]

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.2))
  from seq2seq.checkpoint import read_config
  try:
    cfg = read_config(args.workdir)
  except ValueError:   # an unreadable config.json: the curves do not need it
    cfg = None
  dropout = cfg is not None and cfg.model.dropout_rate > 0
  a0.plot(*curve("train", "loss"), lw=1, label="train (dropout on)" if dropout else "train")
  a0.plot(*curve("validation", "loss"), "o-", label="validation")
  a0.set_xlabel("step"); a0.set_ylabel("label-smoothed cross-entropy"); a0.legend()
  a0.set_title(args.title or os.path.basename(os.path.normpath(args.workdir)))
  a1.plot(*curve("validation", "bleu"), "o-", label="validation BLEU")
  a1.plot(*curve("validation", "chrf"), "s-", label="validation chrF")
  for r in rows:
    if r.get("split") == "test" and "bleu" in r:
      a1.plot([r["step"]], [r["bleu"]], "r*", ms=12)
      a1.annotate(f"test BLEU {r['bleu']:.1f}, chrF {r.get('chrf', float('nan')):.1f}",
                  (r["step"], r["bleu"]), textcoords="offset points", xytext=(-150, 12))
  a1.set_xlabel("step"); a1.set_ylabel("sacreBLEU / chrF"); a1.legend(loc="upper left")
  fig.tight_layout()
  try:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=100)
  except (OSError, ValueError) as e:  # unwritable place, unknown image suffix
    sys.exit(f"error: cannot write {args.out}: {e}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
