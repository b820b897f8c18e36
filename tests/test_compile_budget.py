"""The compile budget: what a run asks the compiler for stays small. The `bible_gpu` train
step lowers to at most 6,000 StableHLO ops (4,736 with each stack's layers traced once),
through the accelerator's cuDNN path and its net as on a GPU; `train.py --steps 3` compiles
at most 19 programs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from conftest import USER_XLA_FLAGS
from seq2seq.config import get_experiment
from seq2seq.kernels import accelerator as acc
from seq2seq.steps import Trainer

ROOT = Path(__file__).resolve().parents[1]
BATCH_KEYS = ("src", "tgt", "src_segments", "tgt_segments", "src_positions", "tgt_positions")


def test_the_bible_gpu_train_step_stays_within_its_op_budget(monkeypatch):
  """bf16 at 128 x 64 with the accelerator kernels, every form of attention given cuDNN (a
  stand-in: XLA's attention, taken by the probes) as on a GPU whose probes all pass."""
  monkeypatch.setattr(acc, "_VERDICTS", {})
  monkeypatch.setattr(acc, "_verdicts_file", lambda: None)
  monkeypatch.setattr(acc, "unqualified", lambda q, mask=None: None)
  monkeypatch.setitem(acc.IMPLEMENTATIONS, "cudnn", acc.IMPLEMENTATIONS["xla"])
  monkeypatch.delenv(acc.ENV, raising=False)
  cfg = get_experiment("bible_gpu")
  cfg = cfg.replace(model=cfg.model.replace(vocab_size=8000, kernels="accelerator"),
                    train=cfg.train.replace(batch_size=128, seq_len=64))
  trainer = Trainer(cfg)
  tokens = jax.ShapeDtypeStruct((128, 64), jnp.int32)
  text = trainer.step.lower(trainer.abstract_state, {k: tokens for k in BATCH_KEYS}).as_text()
  assert trainer.attention.training(), "the step gave cuDNN no differentiated call"
  ops = sum(1 for line in text.splitlines() if " = stablehlo." in line or " = chlo." in line)
  assert ops <= 6000, ops


@pytest.mark.slow   # the default task's dataset, 3 steps and its evaluation (~1-2 min)
def test_train_py_compiles_at_most_19_programs(tmp_path):
  env = dict(os.environ, TFDS_DATA_DIR=str(tmp_path / "tfds"), SEQ2SEQ_COMPILE_CACHE="off",
             JAX_LOG_COMPILES="1")
  env.pop("XLA_FLAGS")   # as a user runs it
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  if USER_XLA_FLAGS is not None:
    env["XLA_FLAGS"] = USER_XLA_FLAGS
  p = subprocess.run([sys.executable, "train.py", "--steps", "3", "--workdir",
                      str(tmp_path / "w"), "--no_progress"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  programs = re.findall(r"Finished XLA compilation of (\S+)", p.stderr)
  assert 0 < len(programs) <= 19, programs
