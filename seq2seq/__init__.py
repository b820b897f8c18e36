"""seq2seq: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax."""
from seq2seq.config import (Config, ConfigError, DataConfig, TrainConfig, TransformerConfig,
                            get_config)
from seq2seq.errors import UserError
from seq2seq.losses import accuracy, cross_entropy, shift_right
from seq2seq.model import Transformer, count_params, init_cache
from seq2seq.optim import make_optimizer, warmup_rsqrt_schedule

__all__ = [
    "Config", "ConfigError", "UserError", "DataConfig", "TrainConfig", "TransformerConfig", "get_config",
    "Transformer", "init_cache", "count_params", "shift_right", "cross_entropy", "accuracy",
    "warmup_rsqrt_schedule", "make_optimizer",
]
__version__ = "0.1.0"
