"""The embedded tiny model (Qwen2 architecture, ≈1.3 M parameters) and its locally built tokenizer."""

from offpolicy.models.cache import cache_root, load_tiny_model, tiny_model_dir, tiny_model_info, tiny_model_path
from offpolicy.models.tiny import TINY_CONFIG, TINY_MODEL_VERSION, build_tiny_model, tiny_config
from offpolicy.models.tokenizer import VOCAB_SIZE, build_tokenizer
from offpolicy.models.warm_start import encode_examples, evaluate_reward, warm_start

__all__ = [
    "TINY_CONFIG",
    "TINY_MODEL_VERSION",
    "VOCAB_SIZE",
    "build_tiny_model",
    "build_tokenizer",
    "cache_root",
    "encode_examples",
    "evaluate_reward",
    "load_tiny_model",
    "tiny_config",
    "tiny_model_dir",
    "tiny_model_info",
    "tiny_model_path",
    "warm_start",
]
