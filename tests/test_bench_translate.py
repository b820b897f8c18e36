"""bench/bench_translate.py on the trained default model: both systems translate the same
held-out sentences, the JSON's BLEU is sacreBLEU's of the translations it wrote, and the
CTranslate2 export's greedy translations are ours (the same model, the same search)."""
import json
import os
import subprocess
import sys

import pytest
import sacrebleu

from seq2seq import translate as tr
from seq2seq.data import numbers
from seq2seq.load import load_workdir

pytest.importorskip("ctranslate2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_translates_a_file_with_both_systems(default_run, tmp_path):
  test = numbers.split_numbers()["test"][::5]
  src, ref = tmp_path / "src.en", tmp_path / "ref.fr"
  src.write_text("".join(numbers.number_words(int(n), "en") + "\n" for n in test))
  ref.write_text("".join(numbers.number_words(int(n), "fr") + "\n" for n in test))
  out, hyps = tmp_path / "translate.json", tmp_path / "hyps"
  p = subprocess.run(
      [sys.executable, "bench/bench_translate.py", "--workdir", str(default_run[0]),
       "--source", str(src), "--reference", str(ref), "--strategies", "greedy,beam4",
       "--dtypes", "float32", "--compute_types", "float32", "--repeats", "1",
       "--batch_size", "32", "--hypotheses_dir", str(hyps), "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  result = json.loads(out.read_text())
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  from bench_train import cpu_name
  assert result["cpu"] == cpu_name() and result["cpu"] in p.stdout   # the CPU named
  rows = {(r["system"], r["strategy"]): r for r in result["rows"]}
  cfg, _, tok = load_workdir(str(default_run[0]))
  assert set(rows) == {(s, t) for s in ("seq2seq", "ctranslate2") for t in ("greedy", "beam4")}
  references = ref.read_text().splitlines()
  for (system, strategy), r in rows.items():
    texts = (hyps / f"{system}.float32.{strategy}.txt").read_text().splitlines()
    assert len(texts) == len(test)
    assert r["bleu"] == pytest.approx(sacrebleu.corpus_bleu(texts, [references]).score)
    assert r["bleu"] > 90   # a trained model, every sentence translated
    assert r["tokens_per_sec"] == pytest.approx(r["new_tokens"] / r["median_s"])
    if system == "seq2seq":   # the step's matmuls alone: 32 sentences of 1 or 4 rows
      ceiling = r["matmul_ceiling"]
      assert ceiling["rows"] == 32 * (4 if strategy == "beam4" else 1)
      assert ceiling["step_s"] > 0
      assert ceiling["tokens_per_sec"] == pytest.approx(32 / ceiling["step_s"])
      # ... and the file's: its target tokens at 32 per step plus its source tokens
      # through the encoder's matmuls (the ids both engines read, EOS included)
      src_ids = tr.encode_sources(tok, src.read_text().splitlines(), cfg.model.max_len)[0]
      src_tokens = sum(map(len, src_ids))
      seconds = (r["new_tokens"] * ceiling["step_s"] / 32
                 + src_tokens * ceiling["encoder_s_per_token"])
      assert ceiling["encoder_s_per_token"] > 0
      assert ceiling["file_tokens_per_sec"] == pytest.approx(r["new_tokens"] / seconds)
      assert ceiling["file_tokens_per_sec"] < ceiling["tokens_per_sec"]
      # ... and with a step's attention at the file's mean lengths
      sentences = len(src_ids)
      assert ceiling["attention_keys"] == [round(r["new_tokens"] / sentences / 2),
                                           round(src_tokens / sentences)]
      seconds += r["new_tokens"] * ceiling["attention_step_s"] / 32
      assert ceiling["file_with_attention_tokens_per_sec"] == pytest.approx(
          r["new_tokens"] / seconds)
  ours = (hyps / "seq2seq.float32.greedy.txt").read_text()
  assert (hyps / "ctranslate2.float32.greedy.txt").read_text() == ours
