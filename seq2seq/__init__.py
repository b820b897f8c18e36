"""seq2seq: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax.

The names below load on first use, so `train.py --help` and bad flags answer without
importing JAX."""
import importlib

_WHERE = {
    "Config": "config", "ConfigError": "config", "DataConfig": "config", "TrainConfig": "config",
    "TransformerConfig": "config", "get_config": "config", "UserError": "errors",
    "Transformer": "model", "init_cache": "model", "count_params": "layout",
    "shift_right": "losses", "cross_entropy": "losses", "accuracy": "losses",
    "warmup_rsqrt_schedule": "optim", "make_optimizer": "optim",
    "Greedy": "search", "Sample": "search", "Beam": "search", "decode": "decoding",
    "load_workdir": "load",
}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name):
  if name in _WHERE:
    return getattr(importlib.import_module(f"seq2seq.{_WHERE[name]}"), name)
  raise AttributeError(f"module 'seq2seq' has no attribute {name!r}")
