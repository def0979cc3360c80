"""Per-token dumps from this project and from other frameworks, read into one :class:`TokenData` for the report.

Three sources, told apart by their keys (file suffix ``.jsonl``, ``.pt``/``.pth`` or ``.safetensors``):

* **offpolicy** (``offpolicy inspect --out DIR`` writes ``DIR/tokens.jsonl``): the versioned schema of
  :mod:`offpolicy.inspect.dump` — records with ``schema_version``.
* **verl** — the tensors of a training batch (``DataProto.batch``) after ``compute_log_prob``; save them with
  ``torch.save({k: batch.batch[k].cpu() for k in ("responses", "response_mask", "old_log_probs",
  "rollout_log_probs", "prompts", "attention_mask", "advantages") if k in batch.batch.keys()}, "step.pt")``, or as
  JSONL records with those keys (lists). μ = ``rollout_log_probs`` (the rollout engine, present when the rollout
  returns log-probs: ``actor_rollout_ref.rollout.calculate_log_probs=True``), π = ``old_log_probs`` (the actor's
  forward), tokens = ``responses``, mask = ``response_mask``; optional ``prompts`` (left-padded, its padding given by
  the first columns of ``attention_mask``) and token-level ``advantages``. verl's own ``trainer.rollout_data_dir``
  writes decoded text only, no log-probs: it cannot be diagnosed.
* **TRL** (``GRPOTrainer``) — the dict ``_generate_and_score_completions`` returns (``inputs`` of ``_compute_loss``):
  μ = ``sampling_per_token_logps`` (vLLM's log-probs), π = ``old_per_token_logps``, tokens = ``completion_ids``, mask =
  ``completion_mask`` (× ``tool_mask`` when present); optional ``prompt_ids``/``prompt_mask`` (left-padded) and
  ``advantages`` [B]. TRL computes ``old_per_token_logps`` only with vLLM importance sampling on or when generation
  and optimisation steps are misaligned. TRL writes NaN where vLLM could not score a token and leaves it out of its
  ratio; so does this reader (with a warning), while a NaN anywhere else is an error.

Every malformed input is a one-line ``ValueError`` naming the file, the record (JSONL line or batch row) and the field.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from offpolicy.inspect.dump import DumpError, parse_record, read_jsonl, tokens_from_records
from offpolicy.inspect.measurements import TokenData, pad_time
from offpolicy.ratios import per_sequence

VERL_KEYS = {"rollout": "rollout_log_probs", "trainer": "old_log_probs", "ids": "responses", "mask": "response_mask"}
TRL_KEYS = {"rollout": "sampling_per_token_logps", "trainer": "old_per_token_logps", "ids": "completion_ids",
            "mask": "completion_mask"}
TENSOR_SUFFIXES = (".pt", ".pth", ".safetensors")


def detect_format(keys: set[str]) -> str | None:
    """Which source a record's (or a tensor file's) keys come from, or None.

    >>> detect_format({"responses", "response_mask", "old_log_probs", "rollout_log_probs"})
    'verl'
    >>> detect_format({"completion_ids", "sampling_per_token_logps"}), detect_format({"step", "reward/mean"})
    ('trl', None)
    """
    if "schema_version" in keys:
        return "offpolicy"
    if keys & {"rollout_log_probs", "old_log_probs", "response_mask"}:
        return "verl"
    if keys & {"sampling_per_token_logps", "old_per_token_logps", "completion_mask"}:
        return "trl"
    return None


def is_dump(path: str | Path) -> bool:
    """True for a file this module reads (a tensor file, or JSONL whose first record is a dump record) — False for
    a ``metrics.jsonl`` of a training run, which ``offpolicy diagnose`` tabulates instead."""
    p = Path(path)
    if p.suffix in TENSOR_SUFFIXES:
        return True
    if p.suffix != ".jsonl" or not p.is_file():
        return False
    with p.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and detect_format(set(first)) is not None
    return False


def _load_tensors(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DumpError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise DumpError(f"{path}: empty file: no records")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(path))
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file becomes one line naming it
        raise DumpError(f"{path}: cannot be read as {path.suffix} tensors ({type(err).__name__}: {err})") from None
    if hasattr(data, "batch") and hasattr(data.batch, "keys"):  # a verl DataProto that was torch.save'd whole
        data = {k: data.batch[k] for k in data.batch.keys()}
    if not isinstance(data, dict):
        raise DumpError(f"{path}: holds a {type(data).__name__}; expected a dict of tensors (verl's batch tensors or "
                        "TRL's inputs dict)")
    return dict(data)


def _tensor(data: dict, key: str, source: str, *, fmt: str, ndim: int = 2) -> torch.Tensor:
    if key not in data:
        raise DumpError(f"{source}: field {key!r} missing ({fmt} dump needs {', '.join(_required(fmt))})")
    x = data[key]
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError) as err:
            raise DumpError(f"{source}: field {key!r} is not a tensor ({err})") from None
    if x.dim() != ndim:
        raise DumpError(f"{source}: field {key!r} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def _required(fmt: str) -> list[str]:
    keys = VERL_KEYS if fmt == "verl" else TRL_KEYS
    return [keys["ids"], keys["mask"], keys["rollout"], keys["trainer"]]


def _prompts(data: dict, fmt: str, source: str, b: int) -> list[list[int]] | None:
    """The prompts without their left padding, or None."""
    if fmt == "verl" and "prompts" in data:
        ids = _tensor(data, "prompts", source, fmt=fmt)
        if "attention_mask" in data:
            keep = _tensor(data, "attention_mask", source, fmt=fmt)[:, : ids.shape[1]].bool()
        else:
            keep = torch.ones_like(ids, dtype=torch.bool)
    elif fmt == "trl" and "prompt_ids" in data:
        ids = _tensor(data, "prompt_ids", source, fmt=fmt)
        keep = _tensor(data, "prompt_mask", source, fmt=fmt).bool() if "prompt_mask" in data else torch.ones_like(
            ids, dtype=torch.bool)
    else:
        return None
    if ids.shape[0] != b or keep.shape != ids.shape:
        raise DumpError(f"{source}: the prompts have shape {tuple(ids.shape)}, the responses {b} rows")
    return [row[m].tolist() for row, m in zip(ids, keep)]


def _advantages(data: dict, fmt: str, source: str, mask: torch.Tensor) -> torch.Tensor | None:
    if "advantages" not in data:
        return None
    a = data["advantages"]
    a = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
    if a.dim() == 2:  # verl: token-level, one value repeated over the response — take the mean over valid tokens
        if a.shape != mask.shape:
            raise DumpError(f"{source}: field 'advantages' has shape {tuple(a.shape)}, the mask {tuple(mask.shape)}")
        a = per_sequence(a, mask, "mean")
    if a.dim() != 1 or a.shape[0] != mask.shape[0]:
        raise DumpError(f"{source}: field 'advantages' must be [B] or [B, T], got shape {tuple(a.shape)}")
    return a.float()


def convert_batch(data: dict[str, Any], fmt: str, source: str, record_numbers: list[int] | None = None) -> TokenData:
    """verl's or TRL's batch tensors (:data:`VERL_KEYS` / :data:`TRL_KEYS`) as :class:`TokenData`, validated row by row.

    ``record_numbers``: how errors name each row (default: its 1-based index; JSONL input passes the line numbers).
    """
    if fmt not in ("verl", "trl"):
        raise ValueError(f"fmt must be 'verl' or 'trl', got {fmt!r}")
    keys = VERL_KEYS if fmt == "verl" else TRL_KEYS
    ids = _tensor(data, keys["ids"], source, fmt=fmt)
    shape = tuple(ids.shape)
    tensors = {}
    for role in ("mask", "rollout", "trainer"):
        x = _tensor(data, keys[role], source, fmt=fmt)
        if tuple(x.shape) != shape:
            raise DumpError(f"{source}: field {keys[role]!r} has shape {tuple(x.shape)} but {keys['ids']!r} has {shape}")
        tensors[role] = x
    mask = tensors["mask"].bool()
    if fmt == "trl" and "tool_mask" in data:
        mask = mask & _tensor(data, "tool_mask", source, fmt=fmt).bool()
    rollout, trainer = tensors["rollout"].float(), tensors["trainer"].float()
    if fmt == "trl":  # TRL's NaN = "vLLM could not score this token": TRL leaves it out, so do we
        unscored = mask & torch.isnan(rollout)
        if bool(unscored.any()):
            warnings.warn(f"{source}: {int(unscored.sum())} token(s) with NaN in {keys['rollout']!r} (vLLM could not "
                          "score them; TRL leaves them out of its ratio) are left out", stacklevel=2)
            mask = mask & ~unscored
    for role, x in (("rollout", rollout), ("trainer", trainer)):
        bad = mask & (torch.isnan(x) | (x == math.inf))
        if bool(bad.any()):
            row, pos = (int(v) for v in bad.nonzero()[0])
            record = record_numbers[row] if record_numbers else row + 1
            raise DumpError(f"{source}: record {record}, field {keys[role]!r}: position {pos} is a valid (mask 1) "
                            f"position and holds {float(x[row, pos])}, not a finite log-prob")
    empty = ~mask.any(-1)
    if bool(empty.all()):
        raise DumpError(f"{source}: field {keys['mask']!r} has no valid token in any record")
    return TokenData(
        completion_ids=ids.long(), mask=mask, rollout_logp=torch.where(mask, rollout, 0.0),
        trainer_logp=torch.where(mask, trainer, 0.0), advantages=_advantages(data, fmt, source, mask.float()),
        prompt_ids=_prompts(data, fmt, source, shape[0]),
    )


def _records_to_batch(records: list[tuple[int, dict]], fmt: str, source: str) -> TokenData:
    """verl/TRL JSONL records (one sequence each, lists under the framework's keys) → their batch tensors."""
    keys = VERL_KEYS if fmt == "verl" else TRL_KEYS
    b = len(records)
    lengths = []
    for lineno, rec in records:
        if not isinstance(rec, dict):
            raise DumpError(f"{source}: record {lineno}: is a JSON {type(rec).__name__}, not an object")
        for key in _required(fmt):
            if key not in rec:
                raise DumpError(f"{source}: record {lineno}, field {key!r}: missing")
            if not isinstance(rec[key], list):
                raise DumpError(f"{source}: record {lineno}, field {key!r}: must be a list")
        n = len(rec[keys["ids"]])
        for key in _required(fmt)[1:]:
            if len(rec[key]) != n:
                raise DumpError(f"{source}: record {lineno}, field {key!r}: has {len(rec[key])} values but "
                                f"{keys['ids']!r} has {n}")
        lengths.append(n)
    t = max(lengths)
    data: dict[str, Any] = {}
    for role, dtype in (("ids", torch.long), ("mask", torch.long), ("rollout", torch.float32),
                        ("trainer", torch.float32)):
        x = torch.zeros((b, t), dtype=dtype)
        for i, (lineno, rec) in enumerate(records):
            try:
                row = [math.nan if v is None else float(v) if role in ("rollout", "trainer") else int(v)
                       for v in rec[keys[role]]]
            except (TypeError, ValueError) as err:
                raise DumpError(f"{source}: record {lineno}, field {keys[role]!r}: {err}") from None
            x[i, : len(row)] = torch.tensor(row, dtype=dtype)
        data[keys[role]] = x
    if all("advantages" in rec for _, rec in records):  # a number per record, or verl's per-token list
        data["advantages"] = torch.tensor([_mean_of(rec["advantages"], source, n) for n, rec in records])
    tokens = convert_batch(data, fmt, source, record_numbers=[lineno for lineno, _ in records])
    prompt_key = "prompts" if fmt == "verl" else "prompt_ids"
    if all(isinstance(rec.get(prompt_key), list) for _, rec in records):  # unpadded lists in JSONL
        tokens.prompt_ids = [[int(v) for v in rec[prompt_key]] for _, rec in records]
    return tokens


def _mean_of(value: Any, source: str, lineno: int) -> float:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise DumpError(f"{source}: record {lineno}, field 'advantages': must be a number or a list of numbers")
    return float(sum(values) / len(values))


def read_any(path: str | Path) -> tuple[TokenData, str]:
    """One dump file → ``(TokenData, format)``; the format from its keys (:func:`detect_format`)."""
    p = Path(path)
    source = str(p)
    if p.suffix in TENSOR_SUFFIXES:
        data = _load_tensors(p)
        fmt = detect_format(set(data))
        if fmt not in ("verl", "trl"):
            raise DumpError(f"{source}: keys {sorted(data)[:8]} are neither verl's ({', '.join(_required('verl'))}) "
                            f"nor TRL's ({', '.join(_required('trl'))})")
        return convert_batch(data, fmt, source), fmt
    records = read_jsonl(p)
    lineno, first = records[0]
    fmt = detect_format(set(first)) if isinstance(first, dict) else None
    if fmt is None:
        raise DumpError(f"{source}: record {lineno}: not a dump record (no schema_version, and neither verl's nor "
                        "TRL's log-prob keys)")
    if fmt == "offpolicy":
        return tokens_from_records([parse_record(rec, source, n) for n, rec in records], source), fmt
    return _records_to_batch(records, fmt, source), fmt


def concat_tokens(parts: list[TokenData]) -> TokenData:
    """Several dumps as one batch (padded to the longest); a field kept only if every part has it."""
    if len(parts) == 1:
        return parts[0]
    t = max(p.mask.shape[1] for p in parts)

    def cat(name: str):
        xs = [getattr(p, name) for p in parts]
        if any(x is None for x in xs):
            return None
        if name in ("topk_ids", "rollout_topk_logp", "trainer_topk_logp") and len({x.shape[2] for x in xs}) > 1:
            return None
        return torch.cat([pad_time(x, t) for x in xs])

    kinds = {p.kl_kind for p in parts}
    kw = {name: cat(name) for name in ("completion_ids", "mask", "rollout_logp", "trainer_logp", "kl_upper",
                                       "kl_reverse", "tv", "topk_overlap", "eps_max", "topk_ids", "rollout_topk_logp",
                                       "trainer_topk_logp")}
    kl = cat("kl") if len(kinds) == 1 else None
    adv = [p.advantages for p in parts if p.advantages is not None]  # kept when every part has them
    prompts = [p.prompt_ids for p in parts if p.prompt_ids is not None]
    return TokenData(**kw, kl=kl, kl_kind=kinds.pop() if kl is not None else None,
                     advantages=torch.cat(adv) if len(adv) == len(parts) else None,
                     prompt_ids=sum(prompts, []) if len(prompts) == len(parts) else None)


def load_dumps(paths: Sequence[str | Path]) -> tuple[TokenData, list[str]]:
    """Every file read with :func:`read_any` and concatenated; returns ``(tokens, formats)``."""
    if not paths:
        raise ValueError("no dump files given")
    got = [read_any(p) for p in paths]
    return concat_tokens([t for t, _ in got]), [f for _, f in got]


def topk_kl_from_logprobs(rollout_topk_logp: torch.Tensor, trainer_topk_logp: torch.Tensor) -> torch.Tensor:
    """KL of the (K + 1)-bucket coarse-graining from both sides' log-probs of the same K tokens ``[..., K]`` → ``[...]``:
    Σ_i q_i log(q_i / p_i) + q_rest log(q_rest / p_rest), q_rest = 1 − Σ q_i, p_rest = 1 − Σ p_i — a lower bound on
    KL(μ‖π) (data processing; :func:`offpolicy.topk_kl_lower_bound` computes the same from π's full logits).

    >>> q = torch.tensor([0.5]).log(); p = torch.tensor([0.25]).log()   # ½ log 2 + ½ log(½ / ¾) = 0.1438
    >>> topk_kl_from_logprobs(q, p)
    tensor(0.1438)
    """
    lq, lp = rollout_topk_logp.double(), trainer_topk_logp.double()
    q, p = lq.exp(), lp.exp()
    head = torch.where(q > 0, q * (lq - lp), torch.zeros_like(q)).sum(-1)
    q_rest = (1 - q.sum(-1)).clamp(min=0)
    p_rest = (1 - p.sum(-1)).clamp(min=1e-300)
    tail = torch.where(q_rest > 0, q_rest * (q_rest.clamp(min=1e-300).log() - p_rest.log()), torch.zeros_like(q_rest))
    return (head + tail).clamp(min=0).float()


def measurements_from_dumps(paths: Sequence[str | Path]):  # -> Measurements
    """The report's input from dump files alone: per-token data, no vocabulary, DVP grid or layers (those need the
    model). A dump with both sides' top-k log-probs but no KL gets the top-k lower bound (:func:`topk_kl_from_logprobs`).
    """
    from offpolicy.inspect.measurements import Measurements

    tokens, formats = load_dumps(paths)
    if tokens.kl is None and tokens.rollout_topk_logp is not None and tokens.trainer_topk_logp is not None:
        kl = topk_kl_from_logprobs(tokens.rollout_topk_logp, tokens.trainer_topk_logp)
        tokens.kl, tokens.kl_kind = torch.where(tokens.mask, kl, 0.0), "topk"
    meta = {"source": ", ".join(str(p) for p in paths), "formats": formats,
            "rollout": {"name": "dump", "description": "the rollout log-probs of " + ", ".join(map(str, paths))},
            "trainer": {"name": "dump", "description": "the trainer log-probs of the same records"},
            "positions": int(tokens.mask.sum())}
    return Measurements(tokens=tokens, meta=meta)
