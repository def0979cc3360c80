"""The per-token dump: what ``offpolicy inspect`` measured, one JSON record per sequence (JSONL), versioned.

``offpolicy diagnose dump.jsonl`` reads it back into the same report without a model. Schema version 1 — each line
is one JSON object:

======================  ==========================  =====================================================================
field                   type                        meaning
======================  ==========================  =====================================================================
``schema_version``      int, required               1
``completion_ids``      [T] int, required           the sampled tokens (T ≥ 1)
``rollout_logp``        [T] float, required         log μ of each sampled token as the rollout engine reported it
``trainer_logp``        [T] float, required         log π of the same tokens from the trainer's forward
``mask``                [T] 0/1, optional           1 for tokens that count (default: all)
``prompt_ids``          [P] int, optional           the prompt
``advantage``           float, optional             the sequence's advantage (OPSM masks only A < 0)
``kl``                  [T] float, optional         KL(μ‖π) of the next-token distributions at each position
``kl_kind``             str, with ``kl``            "exact" (full vocabulary) or "topk" (a lower bound)
``kl_upper``            [T] float, optional         top-k upper bound on KL(μ‖π)
``kl_reverse``          [T] float, optional         KL(π‖μ)
``tv``                  [T] float, optional         total variation
``topk_overlap``        [T] float, optional         |top-k(μ) ∩ top-k(π)| / k
``eps_max``             [T] float, optional         ½ (max − min) of z_μ/τ − z_π/τ (DVP Prop. 4.2's ε_max)
``topk_ids``            [T][K] int, optional        the rollout's K most likely tokens …
``rollout_topk_logp``   [T][K] float, with ids      … their log-probs under μ …
``trainer_topk_logp``   [T][K] float, with ids      … and under π (tempered, untruncated)
======================  ==========================  =====================================================================

JSON has no infinities: −∞ (a log-prob of a token the processed distribution removed) and +∞ (a KL with π = 0 where
μ > 0) are written as the strings ``"-inf"`` / ``"inf"``. NaN is never valid at a position with mask 1; at mask 0 any
value (or null) is ignored. A malformed file is a ``ValueError`` of one line naming the file, the record (1-based,
= the line) and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from offpolicy.inspect.measurements import Measurements, TokenData

SCHEMA_VERSION = 1
REQUIRED = ("completion_ids", "rollout_logp", "trainer_logp")
PER_TOKEN_FLOATS = ("kl", "kl_upper", "kl_reverse", "tv", "topk_overlap", "eps_max")
TOPK_FIELDS = ("topk_ids", "rollout_topk_logp", "trainer_topk_logp")
_LOGP_FIELDS = ("rollout_logp", "trainer_logp", "rollout_topk_logp", "trainer_topk_logp")
_KNOWN = {"schema_version", "mask", "prompt_ids", "advantage", "kl_kind", *REQUIRED, *PER_TOKEN_FLOATS, *TOPK_FIELDS}


def _encode(x: float) -> float | str:
    if math.isfinite(x):
        return x
    if math.isnan(x):
        raise ValueError("NaN at a valid position cannot be dumped")
    return "inf" if x > 0 else "-inf"


def _row(values: torch.Tensor, valid: list[bool]) -> list:
    """One record's floats: 0.0 at padding (its value is never read), ±inf as strings."""
    return [_encode(float(v)) if ok else 0.0 for v, ok in zip(values.tolist(), valid)]


def dump_records(tokens: TokenData) -> list[dict[str, Any]]:
    """Schema-v1 records (one per sequence) of ``tokens``; positions past a sequence's last valid token are cut."""
    records = []
    m = tokens.mask
    for i in range(m.shape[0]):
        valid_idx = m[i].nonzero().flatten()
        t = int(valid_idx.max()) + 1 if valid_idx.numel() else 0
        if t == 0:
            continue  # a sequence with no valid token carries nothing to diagnose
        valid = m[i, :t].tolist()
        rec: dict[str, Any] = {"schema_version": SCHEMA_VERSION,
                               "completion_ids": tokens.completion_ids[i, :t].tolist()}
        if not all(valid):
            rec["mask"] = [int(v) for v in valid]
        rec["rollout_logp"] = _row(tokens.rollout_logp[i, :t], valid)
        rec["trainer_logp"] = _row(tokens.trainer_logp[i, :t], valid)
        if tokens.prompt_ids is not None:
            rec["prompt_ids"] = list(tokens.prompt_ids[i])
        if tokens.advantages is not None:
            rec["advantage"] = float(tokens.advantages[i])
        for name in PER_TOKEN_FLOATS:
            x = getattr(tokens, name)
            if x is not None:
                rec[name] = _row(x[i, :t], valid)
        if tokens.kl is not None:
            rec["kl_kind"] = tokens.kl_kind
        if tokens.topk_ids is not None and tokens.rollout_topk_logp is not None and tokens.trainer_topk_logp is not None:
            rec["topk_ids"] = tokens.topk_ids[i, :t].tolist()
            for name in ("rollout_topk_logp", "trainer_topk_logp"):
                x = getattr(tokens, name)[i, :t]
                rec[name] = [[_encode(float(v)) for v in row] if ok else [0.0] * x.shape[1]
                             for row, ok in zip(x.tolist(), valid)]
        records.append(rec)
    return records


def write_dump(measured: Measurements | TokenData, path: str | Path) -> Path:
    """Write the per-token dump of ``measured`` as JSONL (schema v1, module docstring); returns the path."""
    tokens = measured.tokens if isinstance(measured, Measurements) else measured
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for rec in dump_records(tokens):
            f.write(json.dumps(rec, allow_nan=False, separators=(",", ":")) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Reading and validation
# ---------------------------------------------------------------------------------------------------------------------


class DumpError(ValueError):
    """A malformed dump: the message names the file, the record and the field."""


def _decode(x: Any) -> float:
    """A JSON value as a float (±inf from "inf"/"-inf"; NaN for NaN/"nan"/null so that the caller can judge it)."""
    if isinstance(x, bool):
        raise TypeError("a boolean is not a number")
    if x is None:
        return math.nan
    if isinstance(x, str):
        if x.strip().lower() in ("inf", "+inf", "infinity", "-inf", "-infinity", "nan"):
            return float(x)
        raise TypeError(f"string {x!r} is not a number")
    if isinstance(x, (int, float)):
        return float(x)
    raise TypeError(f"{type(x).__name__} is not a number")


class _Record:
    """One record under validation; ``fail`` raises the one-line :class:`DumpError`."""

    def __init__(self, source: str, index: int, rec: Any) -> None:
        self.where = f"{source}: record {index}"
        if not isinstance(rec, dict):
            self.fail(None, f"is a JSON {type(rec).__name__}, not an object")
        self.rec = rec

    def fail(self, field: str | None, message: str):
        raise DumpError(f"{self.where}" + (f", field {field!r}" if field else "") + f": {message}")

    def ints(self, field: str, length: int | None = None) -> list[int]:
        v = self.rec.get(field)
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            self.fail(field, "must be a list of integers")
        if length is not None and len(v) != length:
            self.fail(field, f"has {len(v)} values but completion_ids has {length}")
        return v

    def floats(self, field: str, length: int, valid: list[bool], *, allow_neg_inf: bool, allow_pos_inf: bool) -> list[float]:
        v = self.rec.get(field)
        if not isinstance(v, list):
            self.fail(field, "must be a list of numbers")
        if len(v) != length:
            self.fail(field, f"has {len(v)} values but completion_ids has {length}")
        out = []
        for t, (x, ok) in enumerate(zip(v, valid)):
            try:
                f = _decode(x)
            except TypeError as err:
                self.fail(field, f"position {t}: {err}")
            if ok and (math.isnan(f) or (f == -math.inf and not allow_neg_inf) or (f == math.inf and not allow_pos_inf)):
                self.fail(field, f"position {t} is a valid (mask 1) position and holds {x!r}, not a finite number")
            out.append(f if ok else 0.0)
        return out


def parse_record(rec: Any, source: str, index: int) -> dict[str, Any]:
    """Validate one schema-v1 record and return it with decoded floats (module docstring). ``index`` is how errors
    name the record: its 1-based line number in the file."""
    r = _Record(source, index, rec)
    version = rec.get("schema_version")
    if version is None:
        r.fail("schema_version", "missing (every record carries schema_version = 1)")
    if version != SCHEMA_VERSION:
        r.fail("schema_version", f"is {version!r}; this offpolicy reads version {SCHEMA_VERSION}")
    for name in REQUIRED:
        if name not in rec:
            r.fail(name, "missing")
    ids = r.ints("completion_ids")
    t = len(ids)
    if t == 0:
        r.fail("completion_ids", "is empty: a record needs at least one token")
    mask = [True] * t
    if "mask" in rec:
        raw = rec["mask"]
        if not isinstance(raw, list) or any(x not in (0, 1) or isinstance(x, float) and x not in (0.0, 1.0) for x in raw):
            r.fail("mask", "must be a list of 0/1")
        if len(raw) != t:
            r.fail("mask", f"has {len(raw)} values but completion_ids has {t}")
        mask = [bool(x) for x in raw]
    out: dict[str, Any] = {"_record": index, "completion_ids": ids, "mask": mask}
    for name in ("rollout_logp", "trainer_logp"):
        out[name] = r.floats(name, t, mask, allow_neg_inf=True, allow_pos_inf=False)
    for name in PER_TOKEN_FLOATS:
        if name in rec:
            out[name] = r.floats(name, t, mask, allow_neg_inf=False, allow_pos_inf=name.startswith("kl"))
    if "kl" in rec:
        kind = rec.get("kl_kind", "exact")
        if kind not in ("exact", "topk"):
            r.fail("kl_kind", f"must be 'exact' or 'topk', got {kind!r}")
        out["kl_kind"] = kind
    if "prompt_ids" in rec:
        out["prompt_ids"] = r.ints("prompt_ids")
    if "advantage" in rec:
        try:
            a = _decode(rec["advantage"])
        except TypeError as err:
            r.fail("advantage", str(err))
        if not math.isfinite(a):
            r.fail("advantage", f"must be a finite number, got {rec['advantage']!r}")
        out["advantage"] = a
    present = [name for name in TOPK_FIELDS if name in rec]
    if present and len(present) != len(TOPK_FIELDS):
        missing = next(name for name in TOPK_FIELDS if name not in rec)
        r.fail(missing, f"missing: {', '.join(TOPK_FIELDS)} come together")
    if present:
        rows = rec["topk_ids"]
        if not isinstance(rows, list) or len(rows) != t:
            r.fail("topk_ids", f"must be a list of {t} lists (one per token)")
        k = len(rows[0]) if rows and isinstance(rows[0], list) else 0
        for name in TOPK_FIELDS:
            rows = rec[name]
            if not isinstance(rows, list) or len(rows) != t or any(not isinstance(x, list) or len(x) != k for x in rows):
                r.fail(name, f"must be {t} lists of {k} values")
        out["topk_ids"] = [[int(x) for x in row] for row in rec["topk_ids"]]
        for name in ("rollout_topk_logp", "trainer_topk_logp"):
            rows = []
            for pos, (row, ok) in enumerate(zip(rec[name], mask)):
                try:
                    vals = [_decode(x) for x in row]
                except TypeError as err:
                    r.fail(name, f"position {pos}: {err}")
                if ok and any(math.isnan(v) or v == math.inf for v in vals):
                    r.fail(name, f"position {pos} is a valid (mask 1) position and holds NaN or +inf")
                rows.append(vals if ok else [0.0] * k)
            out[name] = rows
    return out


def read_jsonl(path: str | Path) -> list[Any]:
    """The JSON objects of a JSONL file (blank lines skipped); one-line errors for an empty file or a bad line."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DumpError(f"{path}: record {lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not records:
        raise DumpError(f"{path}: empty file: no records")
    return records


def tokens_from_records(records: list[dict[str, Any]], source: str) -> TokenData:
    """Pad parsed records into a :class:`TokenData` (fields present in every record or in none)."""
    b = len(records)
    if b == 0:
        raise DumpError(f"{source}: no records")
    t = max(len(r["completion_ids"]) for r in records)

    def grid(name: str, dtype=torch.float32, fill=0.0) -> torch.Tensor:
        x = torch.full((b, t), fill, dtype=dtype)
        for i, r in enumerate(records):
            x[i, : len(r[name])] = torch.tensor(r[name], dtype=dtype)
        return x

    def consistent(name: str) -> bool:
        have = [name in r for r in records]
        if any(have) and not all(have):
            i = records[have.index(not have[0])]["_record"]
            raise DumpError(f"{source}: record {i}, field {name!r}: "
                            f"{'missing' if have[0] else 'present'} here but {'present' if have[0] else 'missing'} "
                            f"in the first record (a field is in every record or in none)")
        return bool(have and have[0])

    kw: dict[str, Any] = {
        "completion_ids": grid("completion_ids", torch.long, 0), "mask": grid("mask", torch.bool, False),
        "rollout_logp": grid("rollout_logp"), "trainer_logp": grid("trainer_logp"),
    }
    for name in PER_TOKEN_FLOATS:
        if consistent(name):
            kw[name] = grid(name)
    if "kl" in kw:
        kinds = {r["kl_kind"] for r in records}
        if len(kinds) > 1:
            raise DumpError(f"{source}: field 'kl_kind' differs between records ({sorted(kinds)})")
        kw["kl_kind"] = kinds.pop()
    if consistent("topk_ids"):
        k = len(records[0]["topk_ids"][0])
        for r in records:
            if len(r["topk_ids"][0]) != k:
                raise DumpError(f"{source}: record {r['_record']}, field 'topk_ids': {len(r['topk_ids'][0])} per "
                                f"token, the first record has {k}")
        for name, dtype in (("topk_ids", torch.long), ("rollout_topk_logp", torch.float32),
                            ("trainer_topk_logp", torch.float32)):
            x = torch.zeros((b, t, k), dtype=dtype)
            for i, r in enumerate(records):
                x[i, : len(r[name])] = torch.tensor(r[name], dtype=dtype)
            kw[name] = x
    if consistent("advantage"):
        kw["advantages"] = torch.tensor([r["advantage"] for r in records], dtype=torch.float32)
    if consistent("prompt_ids"):
        kw["prompt_ids"] = [r["prompt_ids"] for r in records]
    return TokenData(**kw)


def read_dump(path: str | Path) -> TokenData:
    """A schema-v1 JSONL dump as :class:`TokenData` (validated; :class:`DumpError` names file, record and field)."""
    source = str(path)
    parsed = [parse_record(rec, source, lineno) for lineno, rec in read_jsonl(path)]
    return tokens_from_records(parsed, source)
