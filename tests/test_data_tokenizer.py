"""SentencePiece tokenizer: fixed special ids, round trip (unseen characters too), decode
rules, save/load, one host trains while the others wait."""
import os
import threading

import numpy as np
import pytest

from seq2seq import UserError
from seq2seq.data import Tokenizer
from seq2seq.data import testing as dtest
from seq2seq.data.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def sentences():
  pairs = dtest.sentence_pairs(400, seed=5)
  return [s for s, _ in pairs] + [t for _, t in pairs] + ["Le café était très cher."]


@pytest.fixture(scope="module")
def tok(sentences, tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "vocab.model"
  return Tokenizer.train(sentences, str(path), vocab_size=320)


def test_special_ids_and_size(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
  assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
  assert 262 < tok.vocab_size <= 320
  assert os.path.exists(tok.path)


def test_round_trip_including_unseen_characters(tok, sentences):
  for text in sentences[:50] + [
      "Le café était très cher.",
      "naïve Ωmega — 日本語のテキスト 🙂 ŝ Ğ",      # characters never seen in training
      "tab-free text with digits 12345 and punctuation?!"]:
    ids = tok.encode(text)
    assert ids and all(4 <= i < tok.vocab_size for i in ids)  # no BOS/EOS/UNK/PAD
    assert tok.decode(ids) == text
  # unseen characters become byte pieces, not UNK
  assert tok.unk_id not in tok.encode("日本語 🙂")
  assert any(tok.id_to_piece(i).startswith("<0x") for i in tok.encode("🙂"))


def test_decode_stops_at_eos_and_skips_pad_bos(tok):
  a, b = tok.encode("red cat"), tok.encode("old dog")
  ids = [tok.bos_id] + a + [tok.pad_id, tok.eos_id] + b + [tok.pad_id]
  assert tok.decode(ids) == "red cat"
  assert tok.decode(np.asarray(ids, np.int32)) == "red cat"
  assert tok.decode([]) == "" and tok.decode([tok.eos_id] + a) == ""
  assert tok.decode_batch(np.asarray([a + [2, 0], b + [2, 7]])) == ["red cat", "old dog"]


def test_save_load_same_model(tok):
  again = Tokenizer.load(tok.path)
  assert again.model_proto == tok.model_proto and again.vocab_size == tok.vocab_size
  assert again.encode("the big river") == tok.encode("the big river")


def test_load_errors(tmp_path):
  with pytest.raises(UserError, match="no SentencePiece model"):
    Tokenizer.load(str(tmp_path / "nope.model"))
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"not a model")
  with pytest.raises(UserError):
    Tokenizer.load(str(bad))


def test_one_host_trains_the_others_wait(sentences, tmp_path):
  """Process 1 waits for the file process 0 writes (atomically: no partial file is ever
  visible), then both hold the same model; reusing the file retrains nothing."""
  path = str(tmp_path / "shared" / "vocab.model")
  got = {}

  def host(i):
    got[i] = get_tokenizer(path, lambda: iter(sentences), vocab_size=300,
                           model_type="unigram", character_coverage=1.0, process_index=i,
                           timeout=60)

  waiter = threading.Thread(target=host, args=(1,))
  waiter.start()
  host(0)
  waiter.join(60)
  assert got[0].model_proto == got[1].model_proto
  assert os.listdir(tmp_path / "shared") == ["vocab.model"]  # no temporary files left
  reused = get_tokenizer(path, lambda: pytest.fail("must not retrain"), vocab_size=999,
                         model_type="bpe", character_coverage=0.5)
  assert reused.model_proto == got[0].model_proto


def test_waiting_host_times_out_with_user_error(tmp_path):
  with pytest.raises(UserError, match="timed out"):
    get_tokenizer(str(tmp_path / "vocab.model"), lambda: [], vocab_size=300,
                  model_type="unigram", character_coverage=1.0, process_index=1,
                  timeout=0.3)


def test_bad_training_options(sentences):
  with pytest.raises(UserError, match="spm_model_type"):
    Tokenizer.train(sentences, vocab_size=300, model_type="wordpiece")
  with pytest.raises(UserError, match="too small"):
    Tokenizer.train(sentences, vocab_size=100)
