"""CTranslate2's half of bench_translate.py: translates token pieces with an exported model.

Run by bench_translate.py with the peer's own interpreter (it imports ctranslate2 and the
standard library only, never seq2seq):

    python bench/peer_ct2_translate.py JOB.json     # prints one JSON object

JOB: {"model_dir", "sources": [[piece, ...], ...] (no "</s>": the model adds it),
"compute_types", "strategies": [[name, beam_size], ...], "length_penalty", "batch_size",
"max_decoding_length", "repeats", "intra_threads"}. For each compute type and strategy: one
untimed call on the first batch, then `repeats` timed passes over all sources
(translate_batch with max_batch_size=batch_size, which sorts them by length and batches
them, as translate_nbest does); reports each pass' seconds and the last pass' best
hypotheses as pieces.
"""
import json
import sys
import time

import ctranslate2


def main(path):
  with open(path) as f:
    job = json.load(f)
  sources, out = job["sources"], []
  for compute_type in job["compute_types"]:
    try:
      translator = ctranslate2.Translator(job["model_dir"], compute_type=compute_type,
                                          intra_threads=job["intra_threads"], inter_threads=1)
    except (ValueError, RuntimeError) as e:   # a compute type this CPU refuses
      out.append(dict(compute_type=compute_type, error=str(e).splitlines()[0]))
      continue
    for name, beam in job["strategies"]:
      kw = dict(beam_size=beam, length_penalty=job["length_penalty"] if beam > 1 else 0.0,
                max_batch_size=job["batch_size"], min_decoding_length=0,
                max_decoding_length=job["max_decoding_length"])
      translator.translate_batch(sources[:job["batch_size"]], **kw)   # warm-up
      seconds = []
      for _ in range(job["repeats"]):
        t = time.perf_counter()
        res = translator.translate_batch(sources, **kw)
        seconds.append(time.perf_counter() - t)
      out.append(dict(compute_type=compute_type, strategy=name, seconds=seconds,
                      hypotheses=[r.hypotheses[0] for r in res]))
  print(json.dumps(dict(version=ctranslate2.__version__, results=out)))


if __name__ == "__main__":
  main(sys.argv[1])
