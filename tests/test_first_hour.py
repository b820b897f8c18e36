"""What a newcomer reads and meets first, checked against the code: the README's figures and
advice, the numbers task's lower-cased sources, the record of the training sources that
decode.py warns from, train.py's closing lines. (decode.py's and train.py's own runs are in
test_decode_cli.py.)"""
import dataclasses
import json
import re
import shlex
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from num2words import num2words

import seq2seq
from seq2seq import checkpoint as ckpt_lib
from seq2seq import train_lib
from seq2seq.config import Config, get_experiment
from seq2seq.data import catalog, load_dataset, sources
from seq2seq.errors import UserError
from seq2seq.layout import count_params
from seq2seq.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _params(model_cfg) -> int:
  shapes = jax.eval_shape(lambda: Transformer(model_cfg).init(
      jax.random.key(0), jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32)))
  return count_params(shapes["params"])


def test_readme_parameter_counts_are_the_models():
  """Every row of the experiments table: the count of its model, with a 37,000-token
  vocabulary unless the row names its own (numbers)."""
  rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \|(?:[^|]*\|){4} ([^|]+) \|", README, re.M)
  assert {name for name, _ in rows} == set(seq2seq.config.EXPERIMENTS)
  for name, cell in rows:
    figure = re.match(r"([\d.]+) M", cell)
    assert figure, (name, cell)
    vocab = re.search(r"its ([\d,]+)-id vocabulary", cell)
    v = int(vocab[1].replace(",", "")) if vocab else 37000
    n = _params(get_experiment(name).model.replace(vocab_size=v))
    decimals = len(figure[1].split(".")[1])
    assert f"{n / 1e6:.{decimals}f}" == figure[1], (name, n, cell)


def test_readme_troubleshooting_names_the_flag_the_error_names(tmp_path, monkeypatch):
  """The row for a TFDS dataset that cannot be downloaded gives the flag the message gives."""
  row = next(l for l in README.splitlines() if "is not prepared in" in l)
  flags = re.findall(r"`(--[\w.]+)`", row)
  assert flags == ["--data_dir"], row
  monkeypatch.setattr(catalog, "_offline_reason", lambda: "no network: test")
  cfg = Config(data=seq2seq.DataConfig(dataset="ted_hrlr_translate/pt_to_en",
                                       data_dir=str(tmp_path / "tfds")))
  with pytest.raises(UserError) as e:
    load_dataset(cfg, str(tmp_path / "w"), process_index=0, process_count=1)
  assert "point --data_dir" in str(e.value) and "--config.data" not in str(e.value)


def test_the_numbers_experiment_lower_cases_its_sources_and_old_configs_read_so():
  cfg = get_experiment("numbers")
  assert cfg.data.lowercase_source
  assert not get_experiment("small_cpu").data.lowercase_source
  old = cfg.to_dict()
  del old["data"]["lowercase_source"]      # a config.json written before the field
  assert Config.from_dict(old) == cfg
  mine = get_experiment("small_cpu").to_dict()
  del mine["data"]["lowercase_source"]
  assert not Config.from_dict(mine).data.lowercase_source


# --- the record of the training sources ------------------------------------------------------

def _write_tsv(path, pairs):
  path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Mixed-case English numbers, 3 pairs too long to keep; a test split whose first source
  holds a character no training source has."""
  root = tmp_path_factory.mktemp("first_hour")
  train = [(num2words(n).title() if n % 2 else num2words(n), num2words(n, lang="fr"))
           for n in range(200)]
  train += [(" ".join([num2words(n)] * 12), "trop long") for n in (77, 78, 79)]
  test = [("quatre ☃", "x"), ("One Hundred And Seven", "cent sept"), ("twelve", "douze")]
  _write_tsv(root / "train.tsv", train)
  _write_tsv(root / "test.tsv", test)
  return root, train, test


def _load(root, tmp_path, lowercase):
  cfg = Config(data=seq2seq.DataConfig(
      dataset="parallel_text", train_files=str(root / "train.tsv"),
      test_files=str(root / "test.tsv"), data_dir=str(tmp_path / "tfds"), vocab_size=300,
      max_src_len=24, max_tgt_len=24, lowercase_source=lowercase),
      train=seq2seq.TrainConfig(batch_size=8, seq_len=32))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ds = load_dataset(cfg, str(tmp_path / "w"), process_index=0, process_count=1)
  return ds, [str(w.message) for w in caught]


@pytest.mark.parametrize("lowercase", [True, False])
def test_the_workdir_records_the_training_sources_and_a_held_out_example(
    corpus, tmp_path, lowercase):
  root, train, test = corpus
  ds, caught = _load(root, tmp_path, lowercase)
  tok = ds.tokenizer
  assert tok.lowercase_source == lowercase
  # Computed here: the kept sources (24 tokens at most, EOS included), normalised or not.
  kept = [tok.encode(s.lower() if lowercase else s) + [tok.eos_id] for s, _ in train]
  kept = [ids for ids in kept if len(ids) <= 24]
  assert len(kept) == len(train) - 3
  record = sources.read(tmp_path / "w")
  assert record.longest == max(map(len, kept))
  assert record.pieces == {i for ids in kept for i in ids[:-1]}
  # The first test source like the training sources: the snowman's is not.
  assert record.example == test[1][0]
  # The over-long pairs: one warning (a Python warning: one line under the scripts).
  assert caught == ["3 of 203 training pairs are longer than 24 source / 24 target tokens "
                    "(EOS included): dropped"]
  if lowercase:   # the vocabulary was trained on lower-cased sources: no piece has a capital
    assert all(tok.is_byte_or_unknown(i) for i in tok.encode("O")[1:])
    assert not sources.unfamiliar(tok.encode("one hundred") + [tok.eos_id], tok, record)[0]
  else:
    assert not any(tok.is_byte_or_unknown(i) for i in tok.encode("One"))


def test_unfamiliar_without_a_record_counts_the_vocabularys_gaps(corpus, tmp_path):
  root, _, _ = corpus
  ds, _ = _load(root, tmp_path, True)
  tok = ds.tokenizer
  assert sources.read(tmp_path / "nowhere") is None
  assert sources.unfamiliar(tok.encode("twelve ☃") + [2], tok, None) == (True, False)
  assert sources.unfamiliar(tok.encode("twelve " * 40) + [2], tok, None) == (False, False)


# --- train.py's closing lines --------------------------------------------------------------

METRICS = dict(loss=1.0, perplexity=2.7, accuracy=0.5, bleu=10.0, chrf=30.0,
               exact_match=0.25, examples=8)


def test_summary_of_a_numbers_run_shows_a_held_out_number_and_what_the_model_reads(tmp_path):
  workdir = tmp_path / "runs" / "my default"
  workdir.mkdir(parents=True)
  ckpt_lib.write_config(workdir, get_experiment("numbers"))
  example = "five thousand, six hundred and sixty-nine"
  sources.write(workdir, sources.TrainSources(17, frozenset({5, 6}), example))
  r = train_lib.TrainResult(step=300, workdir=str(workdir), train_metrics={"loss": 0.1},
                            eval_metrics=dict(METRICS, step=300), test_metrics={},
                            seconds=90.0)
  lines = train_lib.summary(r).splitlines()
  assert lines[0] == f"trained to step 300 in 90 s; workdir {workdir}"
  hint = lines[-2].removeprefix("translate with: ")
  assert shlex.split(hint) == ["python", "decode.py", "--workdir", str(workdir), example]
  assert lines[-1].startswith("this model reads English number words from zero to 999,999, "
                              "as num2words writes them")


def test_summary_of_a_run_that_took_no_step_says_so(tmp_path):
  """A workdir already at its last step: train() evaluates and returns no train metrics."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  cfg = get_experiment("numbers")
  ckpt_lib.write_config(workdir, cfg)
  r = train_lib.TrainResult(step=300, workdir=str(workdir), train_metrics={},
                            eval_metrics=dict(METRICS, step=300),
                            test_metrics=dict(METRICS, step=300), seconds=12.4)
  first = train_lib.summary(r).splitlines()[0]
  assert first == (f"nothing to train: workdir {workdir} is already at step 300 (train.steps "
                   f"300; --steps N trains on to step N); evaluated it in 12 s")
  r = dataclasses.replace(r, eval_metrics={}, test_metrics={})
  assert "evaluated" not in train_lib.summary(r)
