"""The embedded models (Qwen2 architecture: ``tiny`` ≈1.3 M, ``lab`` ≈5 M parameters) and their locally built tokenizer."""

from offpolicy.models.cache import (
    cache_root,
    load_model,
    load_tiny_model,
    model_dir,
    model_path,
    tiny_model_dir,
    tiny_model_info,
    tiny_model_path,
)
from offpolicy.models.gguf import GGUF_WEIGHTS, export_gguf
from offpolicy.models.recipes import RECIPES, ModelRecipe, get_recipe
from offpolicy.models.tiny import TINY_CONFIG, TINY_MODEL_VERSION, build_tiny_model, tiny_config
from offpolicy.models.tokenizer import VOCAB_SIZE, build_tokenizer
from offpolicy.models.warm_start import WarmStartRecipe, encode_examples, evaluate_reward, warm_start

__all__ = [
    "GGUF_WEIGHTS",
    "export_gguf",
    "RECIPES",
    "ModelRecipe",
    "WarmStartRecipe",
    "get_recipe",
    "load_model",
    "model_dir",
    "model_path",
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
