"""Your own parallel text as a TFDS dataset: Moses-style aligned files or a two-column TSV.

    --config.data.dataset=parallel_text --config.data.train_files=corpus/train
        reads corpus/train.en and corpus/train.fr (line i translates line i), with
        src_lang=en, tgt_lang=fr; validation_files / test_files likewise (optional).
    --config.data.train_files=pairs.tsv       one `source<TAB>target` pair per line
    --config.data.train_files=corpus/         a directory: corpus/train.*, and
                                              corpus/{validation,valid,dev}.* and corpus/test.*
                                              when present

Files are checked before anything is built; every problem is one line (`UserError`): a
missing file, an empty file, invalid UTF-8 (file and line), different line counts (both
files and both counts), a TSV line without exactly two columns. Lines are split on "\\n"
only (never on the other Unicode line separators, which would silently misalign a corpus);
a trailing "\\r" is removed.

The builder config is named after the training file and a hash of every file's contents,
so a changed corpus is rebuilt and different corpora share one data_dir.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re

import tensorflow_datasets as tfds

from seq2seq import textio
from seq2seq.errors import UserError

_VALIDATION_NAMES = ("validation", "valid", "dev")


@dataclasses.dataclass(frozen=True)
class SplitFiles:
  """One split: a TSV file, or a pair of aligned files (source, target)."""
  paths: tuple[str, ...]

  @property
  def is_tsv(self) -> bool:
    return len(self.paths) == 1


def _is_tsv(path: str) -> bool:
  return path.endswith((".tsv", ".tsv.txt"))


def resolve_files(train_files: str, validation_files: str = "", test_files: str = "",
                  src_lang: str = "en", tgt_lang: str = "fr") -> dict[str, SplitFiles]:
  """Maps split name -> files from the config strings (train is required)."""
  if not train_files:
    raise UserError("dataset=parallel_text needs --config.data.train_files: a prefix "
                    f"(PREFIX.{src_lang} + PREFIX.{tgt_lang}), a .tsv file or a directory")
  if src_lang == tgt_lang:
    raise UserError(f"parallel_text: src_lang and tgt_lang are both {src_lang!r}")
  given = {"train": train_files, "validation": validation_files, "test": test_files}
  if os.path.isdir(train_files):
    def find(names):
      for name in names:
        prefix = os.path.join(train_files, name)
        if os.path.exists(f"{prefix}.{src_lang}"):
          return prefix
        if os.path.exists(f"{prefix}.tsv"):
          return f"{prefix}.tsv"
      return ""
    given["train"] = find(("train",)) or os.path.join(train_files, "train")
    given["validation"] = validation_files or find(_VALIDATION_NAMES)
    given["test"] = test_files or find(("test",))
  out = {}
  for split, spec in given.items():
    if not spec:
      continue
    if _is_tsv(spec):
      out[split] = SplitFiles((spec,))
    else:
      out[split] = SplitFiles((f"{spec}.{src_lang}", f"{spec}.{tgt_lang}"))
  return out


def read_lines(path: str) -> list[str]:
  """The lines of a UTF-8 text file; UserError if missing, empty or not UTF-8."""
  if not os.path.exists(path):
    raise UserError(f"parallel_text: no such file: {path}")
  if os.path.isdir(path):
    raise UserError(f"parallel_text: {path} is a directory, expected a text file")
  lines = textio.read_lines(path)
  if not any(line.strip() for line in lines):
    raise UserError(f"parallel_text: {path} is empty")
  return lines


def read_pairs(files: SplitFiles) -> tuple[list[str], list[str]]:
  """(sources, targets) of one split, checked."""
  if files.is_tsv:
    path = files.paths[0]
    src, tgt = [], []
    for i, line in enumerate(read_lines(path), 1):
      cols = line.split("\t")
      if len(cols) != 2:
        raise UserError(f"parallel_text: {path} line {i}: expected 2 tab-separated columns "
                        f"(source<TAB>target), found {len(cols)}")
      src.append(cols[0])
      tgt.append(cols[1])
    return src, tgt
  a, b = files.paths
  src, tgt = read_lines(a), read_lines(b)
  if len(src) != len(tgt):
    raise UserError(f"parallel_text: {a} has {len(src)} lines but {b} has {len(tgt)} lines")
  return src, tgt


def check_files(files: dict[str, SplitFiles]) -> dict[str, int]:
  """Reads every split once (raising UserError on any problem); returns pair counts."""
  return {split: len(read_pairs(f)[0]) for split, f in files.items()}


def config_name(files: dict[str, SplitFiles], src_lang: str, tgt_lang: str) -> str:
  """`<train file>-<src>-<tgt>-<hash of every file's bytes>`."""
  h = hashlib.sha256(f"{src_lang}>{tgt_lang}".encode())
  for split in sorted(files):
    h.update(split.encode())
    for path in files[split].paths:
      if not os.path.isfile(path):
        raise UserError(f"parallel_text: no such file: {path}")
      with open(path, "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
  stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(files["train"].paths[0]))[:40]
  return f"{stem or 'corpus'}-{src_lang}-{tgt_lang}-{h.hexdigest()[:12]}"


@dataclasses.dataclass(eq=False)
class ParallelTextConfig(tfds.core.BuilderConfig):
  files: tuple[tuple[str, tuple[str, ...]], ...] = ()  # ((split, paths), ...)
  src_lang: str = "en"
  tgt_lang: str = "fr"


class ParallelText(tfds.core.GeneratorBasedBuilder):
  """Aligned text files -> {src_lang: text, tgt_lang: text}. Built via `make_builder`."""
  name = "parallel_text"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Moses-style aligned files or two-column TSV."}
  BUILDER_CONFIGS = []

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__,
        features=tfds.features.FeaturesDict({cfg.src_lang: tfds.features.Text(),
                                              cfg.tgt_lang: tfds.features.Text()}),
        supervised_keys=(cfg.src_lang, cfg.tgt_lang))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {split: self._generate_examples(SplitFiles(paths))
            for split, paths in self.builder_config.files}

  def _generate_examples(self, files: SplitFiles):
    cfg = self.builder_config
    src, tgt = read_pairs(files)
    for i, (s, t) in enumerate(zip(src, tgt)):
      yield i, {cfg.src_lang: s, cfg.tgt_lang: t}


def make_builder(train_files: str, validation_files: str = "", test_files: str = "",
                 src_lang: str = "en", tgt_lang: str = "fr",
                 data_dir: str | None = None) -> ParallelText:
  """Checks the files (UserError on any problem) and returns the (unbuilt) builder."""
  files = resolve_files(train_files, validation_files, test_files, src_lang, tgt_lang)
  config = ParallelTextConfig(
      name=config_name(files, src_lang, tgt_lang),
      files=tuple((s, tuple(os.path.abspath(p) for p in f.paths)) for s, f in files.items()),
      src_lang=src_lang, tgt_lang=tgt_lang)
  builder = ParallelText(config=config, data_dir=data_dir or None, file_format="array_record")
  if not builder.is_prepared():  # (a prepared config has the same bytes: already checked)
    check_files(files)
  return builder
