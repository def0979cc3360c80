"""GGUF export (``pip install 'offpolicy[llamacpp]'``): a transformers Qwen2 or Llama model and its byte-level BPE
tokenizer as one file that llama.cpp loads — F32, F16, BF16, Q8_0 or Q4_0 weights.

Written directly with the ``gguf`` package rather than llama.cpp's ``convert_hf_to_gguf.py``, which refuses a BPE
pre-tokenizer it does not know by hash (the embedded tokenizer is built locally). What the file holds:

* architecture ``qwen2`` (NEOX rope, q/k/v biases, weights as in transformers) or ``llama`` (its q/k rows are
  permuted from transformers' rotate-half layout to llama.cpp's interleaved one, as ``convert_hf_to_gguf.py`` does);
  tensor names from ``gguf.TensorNameMap``; a tied output projection is not written (llama.cpp reuses
  ``token_embd``).
* tokenizer ``gpt2`` (byte-level BPE): tokens, token types (specials CONTROL), merges, bos/eos/pad ids and the
  pre-tokenizer type. The embedded tokenizer splits digits one by one, then byte-level — llama.cpp's ``starcoder``
  pre-tokenizer (``default`` would split ``" ("`` differently); the test checks ``/tokenize`` against transformers.
* weights: 1-D tensors (norms, biases) stay F32 whatever ``weights`` says (llama.cpp's convention). Q8_0 / Q4_0
  quantise blocks of 32 along each row with one F16 scale (round to nearest; Q4_0 is asymmetric around −8), by
  ``gguf.quants``. The embedding matrix — here also the tied output projection — stays F16 under Q8_0 / Q4_0 unless
  ``embeddings`` says otherwise: the project's simulated int-N weights keep embeddings and lm_head in the engine's
  float dtype too, and ``llama-quantize`` gives the output tensor more bits than the body.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from offpolicy.atomic_files import replacing

GGUF_WEIGHTS: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0", "q4_0")
GGUF_MISSING = "GGUF export needs the gguf package: pip install 'offpolicy[llamacpp]'"
_ARCHES = {"qwen2": "QWEN2", "llama": "LLAMA"}
# file_type codes (gguf.LlamaFileType), spelled out so this table reads without the package
_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}


def _import_gguf():
    try:
        import gguf
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(GGUF_MISSING) from err
    return gguf


def _check_weights(name: str, value: str) -> str:
    v = str(value).lower()
    if v not in GGUF_WEIGHTS:
        raise ValueError(f"{name} must be one of {', '.join(GGUF_WEIGHTS)}, got {value!r}")
    return v


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict:
    """What GGUF's ``tokenizer.ggml.*`` keys need from a transformers fast byte-level BPE tokenizer.

    Returns ``tokens`` (``vocab_size`` strings, unused ids padded as ``[PAD<i>]``), ``types`` (1 normal, 3 control
    for special tokens, 5 unused), ``merges`` (``"a b"`` strings), ``pre`` (llama.cpp's pre-tokenizer name) and the
    bos/eos/pad ids. A tokenizer that is not byte-level BPE, or whose pre-tokenizer has no llama.cpp counterpart
    here, is refused (``ValueError`` naming the part).

    >>> from offpolicy.models.tokenizer import build_tokenizer
    >>> meta = tokenizer_metadata(build_tokenizer(), 4099)
    >>> meta["pre"], meta["tokens"][:3], meta["types"][:4], meta["merges"][0]
    ('starcoder', ['<|pad|>', '<|bos|>', '<|eos|>'], [3, 3, 3, 1], 'Ġ (')
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("tokenizer must be a transformers fast tokenizer (backend_tokenizer), got "
                         f"{type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer: GGUF export writes byte-level BPE (gpt2) tokenizers, got {model.get('type')!r}")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in spec.get("added_tokens") or []:
        if added["id"] >= vocab_size and added.get("special"):
            continue  # e.g. the <|endoftext|> unk Qwen2Tokenizer appends past the model's rows: it cannot be sampled
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"tokenizer has id {max(vocab.values())}, outside the model's vocabulary of {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = 3 if i in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if not merges:
        raise ValueError("tokenizer has no BPE merges: llama.cpp's gpt2 tokenizer needs them")
    ids = {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad")}
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre, **ids}


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer installs it when it loads a tokenizer.json, as
# AutoTokenizer does for the cached embedded models): llama.cpp's ``qwen2`` pre-tokenizer type.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a pre-tokenizer: digits one by one then byte-level is ``starcoder``; Qwen2's regex then
    byte-level is ``qwen2``; plain byte-level (GPT-2's regex) is ``gpt-2``."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    kinds = [(s.get("type"), s.get("individual_digits")) for s in steps]
    if kinds == [("Digits", True), ("ByteLevel", None)]:
        return "starcoder"
    if kinds == [("ByteLevel", None)]:
        return "gpt-2"
    if kinds == [("Split", None), ("ByteLevel", None)] and (steps[0].get("pattern") or {}).get("Regex") == QWEN2_SPLIT:
        return "qwen2"
    raise ValueError(f"tokenizer: pre-tokenizer {[k for k, _ in kinds]} has no llama.cpp counterpart here "
                     "(known: Digits(individual)+ByteLevel → starcoder, Qwen2's Split+ByteLevel → qwen2, ByteLevel → gpt-2)")


def _permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' rotate-half q/k rows → llama.cpp's interleaved pairs (``LlamaModel.permute`` of
    ``convert_hf_to_gguf.py``): within each head, rows (i, i + d/2) become neighbours (2i, 2i + 1).

    >>> _permute_qk(torch.arange(4.0)[:, None], 1).flatten().tolist()  # head_dim 4: rows 0,1 | 2,3 → 0,2,1,3
    [0.0, 2.0, 1.0, 3.0]
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model: torch.nn.Module, tokenizer, path: str | os.PathLike, *, weights: str = "f32",
                embeddings: str | None = None, name: str | None = None) -> Path:
    """Write ``model`` (transformers ``Qwen2ForCausalLM`` or ``LlamaForCausalLM``) and ``tokenizer`` to a GGUF file.

    Args:
        weights: type of the 2-D weight matrices, one of :data:`GGUF_WEIGHTS`.
        embeddings: type of the embedding matrix (the tied output projection); default ``weights`` for float
            types, ``"f16"`` for Q8_0 / Q4_0 (see the module docstring).
        name: ``general.name`` (default: the model's ``name_or_path`` or its architecture).

    The file is written under a temporary name and renamed into place (a server restarted on it never reads half a
    file). Returns ``path``.
    """
    gguf = _import_gguf()
    weights = _check_weights("weights", weights)
    embeddings = _check_weights("embeddings", embeddings or (weights if weights in ("f32", "f16", "bf16") else "f16"))
    cfg: Any = model.config  # a transformers PretrainedConfig (untyped attributes)
    arch = getattr(cfg, "model_type", None)
    if arch not in _ARCHES:
        raise ValueError(f"model: GGUF export knows {sorted(_ARCHES)} architectures, got model_type={arch!r}")
    n_layers, n_head = cfg.num_hidden_layers, cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError("model: rope scaling is not exported; only the default rope is written")
    meta = tokenizer_metadata(tokenizer, cfg.vocab_size)

    path = Path(path)
    with replacing(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), _ARCHES[arch].lower())
        try:
            writer.add_name(name or getattr(cfg, "name_or_path", "") or arch)
            writer.add_file_type(_FILE_TYPE[weights])
            writer.add_context_length(cfg.max_position_embeddings)
            writer.add_embedding_length(cfg.hidden_size)
            writer.add_block_count(n_layers)
            writer.add_feed_forward_length(cfg.intermediate_size)
            writer.add_head_count(n_head)
            writer.add_head_count_kv(n_kv)
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
            writer.add_rope_dimension_count(head_dim)
            writer.add_rope_freq_base(float(rope_theta))
            writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
            writer.add_vocab_size(cfg.vocab_size)
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(meta["pre"])
            writer.add_token_list(meta["tokens"])
            writer.add_token_types(meta["types"])
            writer.add_token_merges(meta["merges"])
            for key in ("bos", "eos", "pad"):
                if meta[key] is not None:
                    getattr(writer, f"add_{key}_token_id")(int(meta[key]))
            # Prompts reach the server as token ids (nothing added); for text, encode as transformers does (bos first).
            writer.add_add_bos_token(meta["bos"] is not None)
            _add_tensors(gguf, writer, model, arch, n_layers, n_head, n_kv, weights, embeddings)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        except BaseException:
            writer.close()
            raise
    return path


def _add_tensors(gguf, writer, model: torch.nn.Module, arch: str, n_layers: int, n_head: int, n_kv: int,
                 weights: str, embeddings: str) -> None:
    names = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, _ARCHES[arch]), n_layers)
    qtypes = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
              "q4_0": gguf.GGMLQuantizationType.Q4_0}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp uses token_embd as the output projection when `output` is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"model: no GGUF tensor name for {hf_name!r} ({arch})")
        w = tensor.detach().float().cpu()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute_qk(w, n_head)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute_qk(w, n_kv)
        kind = "f32" if w.dim() == 1 else (embeddings if gguf_name.startswith("token_embd") else weights)
        if kind in ("q8_0", "q4_0") and w.shape[-1] % 32:
            raise ValueError(f"model: {hf_name} has rows of {w.shape[-1]} values; {kind} needs a multiple of 32")
        data = w.numpy()
        if kind == "f32":
            writer.add_tensor(gguf_name, data)
        elif kind == "f16":
            writer.add_tensor(gguf_name, data.astype("float16"))
        else:
            qtype = qtypes[kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)  # byte shape
