"""Configuration: the model (`TransformerConfig`), the data (`DataConfig`) and the run
(`TrainConfig`), bundled in one frozen `Config` that is passed whole and varied with
`.replace(...)` or `override(cfg, ["model.d_model=256", "steps=100"])`.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


from seq2seq.errors import UserError


class ConfigError(UserError):
  """An invalid configuration value or key."""


def _check(cond: bool, msg: str):
  if not cond:
    raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Every hyper-parameter of the model. Defaults are the paper's base model."""
  vocab_size: int = 32000
  d_model: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_ff: int = 2048
  dropout_rate: float = 0.1     # the paper's: sublayer outputs and embedding sums
  attention_dropout_rate: float = 0.0  # on attention weights: not in the paper
  ffn_dropout_rate: float = 0.0  # on the FFN's ReLU output: not in the paper (Flax WMT: 0.1)
  max_len: int = 256            # longest sequence the position table covers
  share_embeddings: bool = True  # one token embedding for source and target
  tie_output: bool = True        # output projection = target embedding transposed
  pre_ln: bool = False           # False: the paper's post-LN, LayerNorm(x + Sublayer(x))
  dtype: str = "float32"         # compute dtype of matmul inputs ("bfloat16" for mixed)
  param_dtype: str = "float32"
  # Who computes matmuls, attention, dropout masks and the train step's head + loss
  # (seq2seq/kernels): "reference" (plain JAX, the paper as written), "cpu" (XLA:CPU speed
  # work), "accelerator" (jax.nn.dot_product_attention) or "auto" (cpu on CPU, accelerator
  # elsewhere). All compute the same function; parameters are the same.
  kernels: str = "auto"
  # The N identical layers of the encoder and of the decoder as one layer traced once and run
  # N times (flax nn.scan: parameters stacked on a leading axis `layers`): a train step
  # compiles in a fraction of the time. False: one module per layer (`layers_0`, ...), as
  # runs written before the field existed and as decoding reads them (layout.unroll_layers).
  scan_layers: bool = True

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_heads", "num_encoder_layers",
                 "num_decoder_layers", "d_ff", "max_len"):
      v = getattr(self, name)
      _check(isinstance(v, int) and not isinstance(v, bool) and v > 0,
             f"{name} must be a positive integer, got {v!r}")
    _check(self.d_model % self.num_heads == 0,
           f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
    for name in ("dropout_rate", "attention_dropout_rate", "ffn_dropout_rate"):
      v = getattr(self, name)
      _check(isinstance(v, (int, float)) and 0.0 <= v < 1.0,
             f"{name} must be in [0, 1), got {v!r}")
    for name in ("dtype", "param_dtype"):
      _check(getattr(self, name) in ("float32", "bfloat16", "float16"),
             f"{name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
    _check(self.kernels in ("auto", "reference", "cpu", "accelerator"),
           f"kernels must be auto, reference, cpu or accelerator, got {self.kernels!r}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def replace(self, **kw) -> "TransformerConfig":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to batch it."""
  dataset: str = "numbers"       # "numbers" (embedded), "parallel_text", or a TFDS name
  data_dir: str = ""             # "" -> ~/tensorflow_datasets (or $TFDS_DATA_DIR)
  target_lang: str = "fr"        # embedded numbers task: fr or de
  # parallel_text: Moses-style files `<prefix>.<src_lang>` / `<prefix>.<tgt_lang>` or a TSV.
  train_files: str = ""          # prefix ("corpus/train") or a .tsv path
  validation_files: str = ""
  test_files: str = ""
  src_lang: str = "en"
  tgt_lang: str = "fr"
  reverse: bool = False          # swap source and target of a TFDS translation dataset
  # Lower-case every source before tokenizing it, in training and in translation (decode.py
  # and the Python API read it from the workdir): for data whose sources are all lower case,
  # such as the numbers task, so "Forty-Two" reads as "forty-two".
  lowercase_source: bool = False
  vocab_size: int = 8000
  spm_model_type: str = "unigram"
  character_coverage: float = 1.0
  max_src_len: int = 64          # tokens, EOS included
  max_tgt_len: int = 64
  length_policy: str = "drop"    # over-long training pairs: "drop" or "truncate"
  pack: bool = True              # pack training rows (segment ids) or pad one pair per row
  # The training set is split into `num_shards` shards (0 = one per host); each global batch
  # takes batch_size / num_shards rows from every shard, and a host reads only its shards.
  # Fix it (e.g. to the largest host count you will use) and the batches no longer depend
  # on how many hosts run: 1 host and 2 hosts then train on exactly the same data.
  num_shards: int = 0

  def __post_init__(self):
    _check(self.length_policy in ("drop", "truncate"),
           f"length_policy must be 'drop' or 'truncate', got {self.length_policy!r}")
    _check(self.vocab_size >= 4 + 256 + 2, f"vocab_size {self.vocab_size} is too small: byte "
           f"fallback alone needs 260 ids plus a few pieces")
    _check(self.max_src_len > 1 and self.max_tgt_len > 1, "max_src_len/max_tgt_len must be > 1")
    _check(0.0 < self.character_coverage <= 1.0,
           f"character_coverage must be in (0, 1], got {self.character_coverage}")
    _check(self.num_shards >= 0, f"num_shards must be >= 0, got {self.num_shards}")

  def with_absolute_paths(self) -> "DataConfig":
    """The data files and data_dir as absolute paths (as of the current directory), so that
    a run stored with them resumes from any directory."""
    import os
    return self.replace(**{k: os.path.abspath(os.path.expanduser(v)) for k in
                           ("data_dir", "train_files", "validation_files", "test_files")
                           if (v := getattr(self, k))})

  def replace(self, **kw) -> "DataConfig":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The run: optimisation, evaluation, checkpoints, parallelism."""
  seed: int = 0
  steps: int = 10000
  batch_size: int = 64           # rows per global batch (packed rows when data.pack)
  seq_len: int = 64              # row length of a packed/padded batch
  learning_rate_scale: float = 1.0  # the schedule's `scale`
  warmup_steps: int = 4000
  cooldown_steps: int = 0        # lr down linearly over the last N of `steps` (0 = paper)
  label_smoothing: float = 0.1
  adam_b1: float = 0.9
  adam_b2: float = 0.98
  adam_eps: float = 1e-9
  weight_decay: float = 0.0
  clip_grad_norm: float = 0.0    # 0 = off
  grad_accum_steps: int = 1
  eval_every: int = 1000
  eval_batch_size: int = 64
  num_eval_examples: int = 0     # periodic evaluations read this many (0 = all); the final
                                 # evaluation always reads the whole split
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3
  log_every: int = 50
  decode_strategy: str = "greedy"  # eval decoding: "greedy" or "beam"
  beam_size: int = 4
  length_penalty: float = 0.6
  mesh_shape: str = ""           # e.g. "data=4,fsdp=2"; "" = all devices on `data`
  fsdp: bool = False

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "warmup_steps", "grad_accum_steps",
                 "eval_every", "eval_batch_size", "checkpoint_every", "keep_checkpoints",
                 "log_every", "beam_size"):
      v = getattr(self, name)
      _check(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
    _check(0.0 <= self.label_smoothing < 1.0,
           f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
    for name in ("learning_rate_scale", "adam_eps", "weight_decay", "clip_grad_norm"):
      v = getattr(self, name)
      _check(isinstance(v, (int, float)) and math.isfinite(v),
             f"{name} must be a finite number, got {v!r}")
    _check(self.learning_rate_scale > 0, "learning_rate_scale must be > 0")
    for name in ("adam_b1", "adam_b2"):
      _check(0.0 <= getattr(self, name) < 1.0, f"{name} must be in [0, 1), got "
             f"{getattr(self, name)}")
    _check(self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}")
    for name in ("weight_decay", "clip_grad_norm"):
      _check(getattr(self, name) >= 0, f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
    _check(isinstance(self.cooldown_steps, int) and self.cooldown_steps >= 0,
           f"cooldown_steps must be an integer >= 0, got {self.cooldown_steps!r}")
    _check(isinstance(self.seed, int) and 0 <= self.seed < 2 ** 32,
           f"seed must be an integer in [0, 2**32), got {self.seed!r}")
    _check(self.steps < 2 ** 31, f"steps must be < 2**31, got {self.steps}")
    _check(isinstance(self.num_eval_examples, int) and self.num_eval_examples >= 0,
           f"num_eval_examples must be an integer >= 0 (0 = all), got "
           f"{self.num_eval_examples!r}")
    _check(math.isfinite(self.length_penalty) and self.length_penalty >= 0,
           f"length_penalty must be >= 0, got {self.length_penalty}")
    _check(self.decode_strategy in ("greedy", "beam"),
           f"decode_strategy must be 'greedy' or 'beam', got {self.decode_strategy!r}")
    _check(self.batch_size % self.grad_accum_steps == 0,
           f"batch_size ({self.batch_size}) must be divisible by grad_accum_steps "
           f"({self.grad_accum_steps})")

  def replace(self, **kw) -> "TrainConfig":
    return dataclasses.replace(self, **kw)


# Adam moves each weight by about the learning rate per step (its update is m/sqrt(v), about
# 1 per coordinate), while a Transformer's weights start at about d_model^-0.5 (0.04 for the
# base model) and its LayerNorm gains at 1: from a learning rate of 1 on, every step moves
# every weight by more than its whole size, and no run trains. The recipes here peak at
# 7e-4 (the paper's base) to 3.6e-3 (numbers): the bound is 280 times the highest.
MAX_PEAK_LEARNING_RATE = 1.0


def peak_learning_rate(cfg: "Config") -> float:
  """The schedule's highest value: scale · d_model^-0.5 · warmup^-0.5, at the last warmup
  step (seq2seq.optim.warmup_rsqrt_schedule)."""
  t = cfg.train
  return t.learning_rate_scale * cfg.model.d_model ** -0.5 * t.warmup_steps ** -0.5


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything about one run. Written to `<workdir>/config.json`."""
  model: TransformerConfig = TransformerConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()

  def __post_init__(self):
    # Positions past model.max_len have no row in the sinusoid table (a gather would clamp
    # them silently); training rows and evaluation batches hold up to max_*_len tokens.
    for name in ("max_src_len", "max_tgt_len"):
      v = getattr(self.data, name)
      _check(v <= self.model.max_len, f"data.{name} ({v}) must be <= model.max_len "
             f"({self.model.max_len}), the longest sequence the positions cover")
    peak = peak_learning_rate(self)
    _check(peak <= MAX_PEAK_LEARNING_RATE,
           f"learning_rate_scale {self.train.learning_rate_scale:g} gives a peak learning rate "
           f"of {peak:.3g} (d_model {self.model.d_model}, warmup_steps "
           f"{self.train.warmup_steps}); at most {MAX_PEAK_LEARNING_RATE:g} trains (the "
           f"paper's base model peaks at 7e-4)")
    files = [n for n in ("train_files", "validation_files", "test_files")
             if getattr(self.data, n)]
    _check(not files or self.data.dataset == "parallel_text",
           f"data.{files[0] if files else ''} is read only when the dataset is "
           f"parallel_text, not {self.data.dataset!r} (--dataset parallel_text)")

  def replace(self, **kw) -> "Config":
    return dataclasses.replace(self, **kw)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "Config":
    try:
      data = dict(d["data"])
      # Written before the field existed: the numbers task's sources were lower case already.
      data.setdefault("lowercase_source", data.get("dataset", "numbers") == "numbers")
      model = dict(d["model"])
      model.setdefault("scan_layers", False)   # its checkpoints hold one module per layer
      return cls(model=TransformerConfig(**model), data=DataConfig(**data),
                 train=TrainConfig(**d["train"]))
    except (KeyError, TypeError) as e:
      raise ConfigError(f"config does not match this version of seq2seq: {e}") from None


# ---------------------------------------------------------------------------------------
# Presets. Parameter counts are for a shared 37,000-token vocabulary (tests check them).

_MODEL_PRESETS = {
    # ~0.4M params + embeddings: unit tests and the embedded numbers task.
    "tiny": dict(d_model=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                 d_ff=256, dropout_rate=0.1),
    # The benchmark's `small` workload: d 256, 3+3 layers, 4 heads, FFN 1024.
    "small": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3,
                  d_ff=1024, dropout_rate=0.1),
    # The paper's base model (65M with a 37k shared vocabulary).
    "base": dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6,
                 d_ff=2048, dropout_rate=0.1),
    # The paper's big model (213M); dropout 0.3 as for EN-DE.
    "big": dict(d_model=1024, num_heads=16, num_encoder_layers=6, num_decoder_layers=6,
                d_ff=4096, dropout_rate=0.3),
}


def get_config(name: str, vocab_size: int = 37000) -> TransformerConfig:
  """A model preset: tiny, small, base or big."""
  if name not in _MODEL_PRESETS:
    raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(_MODEL_PRESETS)}")
  return TransformerConfig(vocab_size=vocab_size, **_MODEL_PRESETS[name])


PRESETS = tuple(_MODEL_PRESETS)


def get_experiment(name: str = "numbers") -> Config:
  """A whole run: `numbers` (the embedded task, the default of train.py), a model preset
  (`tiny`, `small`, `base`, `big`) with the paper's training recipe, `small_cpu` (the
  `small` model on your own parallel text in about half an hour on a CPU) or `bible_gpu`
  (the base model on the Bible corpus on one datacenter GPU)."""
  if name == "numbers":
    # python train.py   ~1.5-2.5 min on 2 CPU cores; 100% exact match on the 1,002 held-out
    # test numbers. Not the paper's: gradient clipping, adam_b2=0.99 and a cooldown over the
    # last 100 steps, each against a late loss spike (docs/default_run.md).
    return Config(
        model=TransformerConfig(d_model=64, num_heads=4, num_encoder_layers=2,
                                num_decoder_layers=2, d_ff=256, dropout_rate=0.0, max_len=64),
        data=DataConfig(dataset="numbers", max_src_len=48, max_tgt_len=48,
                        lowercase_source=True),
        train=TrainConfig(steps=300, batch_size=64, seq_len=64, warmup_steps=150,
                          learning_rate_scale=0.35, clip_grad_norm=1.0, adam_b2=0.99,
                          cooldown_steps=100, eval_every=100, checkpoint_every=100, log_every=25,
                          eval_batch_size=256, num_eval_examples=200))
  if name == "small_cpu":
    # python train.py --workdir runs/bible --config small_cpu --config.model.dtype=bfloat16 \
    #     --train_files data/bible/train --validation_files data/bible/validation \
    #     --test_files data/bible/test        (data: python -m seq2seq.data.bible data/bible)
    # ~31 min on 2 CPU cores (AVX512-BF16); test BLEU 17.5 greedy, 18.8 beam 4 (18.7 with
    # beam search's `count` stop rule).
    # Not the paper's recipe, which needs far more compute: 64 packed rows of 64 tokens per
    # batch, warmup 400 steps to a higher peak (scale 0.7), a cooldown over the last 500
    # steps, and dropout on the FFN's hidden units too.
    return Config(
        model=get_config("small").replace(ffn_dropout_rate=0.1),
        data=DataConfig(dataset="parallel_text"),
        train=TrainConfig(steps=2300, batch_size=64, seq_len=64, warmup_steps=400,
                          learning_rate_scale=0.7, cooldown_steps=500, eval_every=100,
                          num_eval_examples=200))
  if name == "bible_gpu":
    # python -m seq2seq.data.bible data/bible
    # python train.py --workdir runs/bible_gpu --config bible_gpu \
    #     --train_files data/bible/train --validation_files data/bible/validation \
    #     --test_files data/bible/test
    # python decode.py --workdir runs/bible_gpu --input data/bible/test.en \
    #     --reference data/bible/test.fr > test.hyp.fr          # beam 4
    # For one datacenter GPU (an H100): the base model in bf16 on the Bible, 4,000 steps of
    # 128 packed rows of 64 tokens (~30M target tokens, ~25 passes over the corpus, 3.5x
    # small_cpu's), planned to train in under 5 minutes and reach test BLEU >= 25 with
    # beam 4. Measured on an H200: 367 s, test BLEU 4.3 with beam 4 (validation loss lowest,
    # 3.06, at step 2,000: it overfits); bench/gpu/run.sh bible measures it. Otherwise
    # small_cpu's recipe scaled to base: dropout 0.2 on sublayers and 0.1 on the FFN's hidden
    # units (none on attention weights, so the accelerator kernels answer), warmup 800 to a
    # peak of 1.1e-3, a cooldown over the last 1,000 steps.
    return Config(
        model=get_config("base").replace(dtype="bfloat16", dropout_rate=0.2,
                                         ffn_dropout_rate=0.1),
        data=DataConfig(dataset="parallel_text"),
        train=TrainConfig(steps=4000, batch_size=128, seq_len=64, warmup_steps=800,
                          learning_rate_scale=0.7, cooldown_steps=1000, eval_every=1000,
                          checkpoint_every=1000, log_every=100, eval_batch_size=256,
                          num_eval_examples=200))
  model = get_config(name)
  if name in ("tiny", "small"):
    return Config(model=model, train=TrainConfig(steps=20000, batch_size=128, seq_len=128,
                                                 warmup_steps=4000))
  # base/big: about the paper's 25k source + 25k target tokens per batch (128 packed rows
  # of 256 slots, which first-fit packing fills to ~92%: ~30k tokens a side; 104 rows
  # would be 25k, but 128 divides across any power-of-two device count), 100k (base) or
  # 300k (big) steps, warmup 4000.
  return Config(model=model, data=DataConfig(vocab_size=32000, max_src_len=256, max_tgt_len=256),
                train=TrainConfig(steps=100000 if name == "base" else 300000, batch_size=128,
                                  seq_len=256, warmup_steps=4000))


EXPERIMENTS = ("numbers",) + PRESETS + ("small_cpu", "bible_gpu")


# ---------------------------------------------------------------------------------------
# --config.KEY=VALUE overrides.

def _parse_value(field: dataclasses.Field, current: Any, text: str, key: str) -> Any:
  typ = type(current)
  try:
    if typ is bool:
      low = text.lower()
      if low in ("1", "true", "yes", "on"):
        return True
      if low in ("0", "false", "no", "off"):
        return False
      raise ValueError
    if typ is int:
      return int(text)
    if typ is float:
      return float(text)
    return text
  except ValueError:
    raise ConfigError(f"--config.{key}: cannot read {text!r} as {typ.__name__}") from None


def override(cfg: Config, items: list[str]) -> Config:
  """Applies `KEY=VALUE` items; KEY is `section.field` or a field name unique to a section."""
  sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  for item in items:
    if "=" not in item:
      raise ConfigError(f"--config.{item}: expected --config.KEY=VALUE")
    key, text = item.split("=", 1)
    if "." in key:
      sec, name = key.split(".", 1)
      if sec not in sections:
        raise ConfigError(f"--config.{key}: unknown section {sec!r} "
                          f"(model, data or train)")
      owners = [sec] if name in {f.name for f in dataclasses.fields(sections[sec])} else []
    else:
      name = key
      owners = [s for s, c in sections.items()
                if name in {f.name for f in dataclasses.fields(c)}]
    if not owners:
      import difflib
      every = [f"{s}.{f.name}" for s, c in sections.items() for f in dataclasses.fields(c)]
      close = difflib.get_close_matches(key, every + [e.split(".")[1] for e in every], n=1)
      hint = f"; did you mean {close[0]!r}?" if close else ""
      raise ConfigError(f"--config.{key}: unknown config key{hint}")
    if len(owners) > 1:
      raise ConfigError(f"--config.{key}: ambiguous, say one of "
                        + ", ".join(f"{o}.{name}" for o in owners))
    sec = owners[0]
    field = next(f for f in dataclasses.fields(sections[sec]) if f.name == name)
    value = _parse_value(field, getattr(sections[sec], name), text, key)
    sections[sec] = dataclasses.replace(sections[sec], **{name: value})
  return Config(**sections)
