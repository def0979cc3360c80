"""Each method's overhead projected to Qwen2.5-1.5B, -7B and -32B: what is counted (FLOPs of each extra
vocabulary-wide pass against the model's own forward + backward) and what is measured (the passes' CPU time against
a framework's own log-prob path at V = 151,936, from ``benchmarks/vocab_memory.py --json``; by default its committed
``docs/data/benchmarks/vocab_memory.json``).

    python benchmarks/projection.py [--measured FILE | --measured ""] [--seq 8192] [--checkpointing]

The step (training part only: generation is left out, which makes every ratio an upper bound — a vLLM rollout is
typically half of an RL step or more) per completion token, as TRL's ``GRPOTrainer`` runs it off-policy:

    F_body = 2·P_body + 4·L·H·c        forward FLOPs of the decoder per token (c = mean attended context = seq / 2)
    head   = 2·V·H                     one pass of the lm_head matmul per token
    step   = 3·F_body (+ F_body with activation checkpointing) + F_body (π_old scoring forward)
             + 5·head                  TRL's head: 1 pass scoring π_old, 1 forward + 1 recompute + 2 gradient
                                       matmuls in the update

Extra head passes per token and step (counted from each method's code path):

* loss-level corrections (TIS, IcePop, OPSM, M2PO, IPO, TRL's own IS): 0 — O(T) arithmetic on [B, T] tensors
* DVP (the fused kernel in place of TRL's head): +2 — its min-p set needs the row maximum first, so the tiled
  forward takes a second pass, in the scoring and in the update forward
* sampling replay (row chunks in place of TRL's head): +0 matmul passes; the support's sort (top-p) per row
* top-K TRM bound: +1 — no-grad logits in the update forward
* score centering: +4 — the centre's forward, its recompute and two gradient matmuls in the update
* ALP: 0 — σ·ε per decoder layer input (L·H random numbers per token)

"counted" = 1 + extra passes × head / step. "measured" replaces the pass count by the measured extra CPU seconds of
each method's update path over TRL's head (fwd + bwd, ``op_*`` − ``trl_head``) on the same shape, in units of one head
pass of the *faster* of the two frameworks' own paths — TRL's tiled head (4 passes: forward, recompute, 2 gradient
matmuls; off CUDA its torch tile fallback) or verl's plain [N, V] path (``verl_update``: 3 passes, forward and 2
gradient matmuls) — so a slow baseline does not shrink the overhead; plus the same share of the scoring pass for the
methods that replace TRL's head in both forwards. It carries the element-wise work (softmax, sort) a FLOP count
leaves out, at a CPU's balance of arithmetic to memory traffic, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

VOCAB = 151936
MEASURED = Path(__file__).resolve().parents[1] / "docs" / "data" / "benchmarks" / "vocab_memory.json"
BASE_PASSES = {"trl_head": 4, "verl_update": 3}  # head passes of each framework's own path, forward + backward


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def body_params(self) -> int:
        """Decoder parameters that multiply every token (attention q, k, v, o and the SwiGLU MLP)."""
        kv = self.hidden // self.heads * self.kv_heads
        return self.layers * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate)


MODELS = (  # the Qwen2.5 configs (config.json of each release)
    Model("Qwen2.5-1.5B", 1536, 28, 8960, 12, 2),
    Model("Qwen2.5-7B", 3584, 28, 18944, 28, 4),
    Model("Qwen2.5-32B", 5120, 64, 27648, 40, 8),
)
# extra head passes per token and step; "replaces": the method takes TRL's head's place in both forwards
METHODS: dict[str, tuple[float, str | None, bool]] = {  # name: (passes, vocab_memory arm, replaces)
    "TIS / IcePop / OPSM / M2PO / IPO": (0.0, None, False),
    "DVP": (2.0, "op_dvp", True),
    "sampling replay": (0.0, "op_replay", True),
    "top-K TRM bound": (1.0, "op_topk_bound", False),
    "score centering": (4.0, "op_center", False),
    "ALP": (0.0, None, False),
}


def step_flops(m: Model, seq: int, checkpointing: bool) -> tuple[float, float]:
    """(step FLOPs per token, one head pass's FLOPs per token)."""
    f_body = 2 * m.body_params + 4 * m.layers * m.hidden * (seq / 2)
    head = 2 * VOCAB * m.hidden
    return (4 + checkpointing) * f_body + 5 * head, head


def _ok(r: dict | None) -> bool:
    return bool(r) and "error" not in r  # type: ignore[operator]


def pass_seconds(results: dict) -> float | None:
    """CPU seconds of one head pass by the faster framework path measured (TRL's tiled head, verl's plain path)."""
    per = [results[a]["cpu_s"] / n for a, n in BASE_PASSES.items() if _ok(results.get(a))]
    return min(per) if per else None


def measured_passes(results: dict, arm: str, replaces: bool) -> float | None:
    """Extra head passes per token and step implied by the measured CPU time of ``arm`` over TRL's head, in passes
    of the faster framework path (:func:`pass_seconds`); the update's 4 passes, + 1 scoring pass if ``replaces``.

    >>> r = {"trl_head": {"cpu_s": 8.0}, "verl_update": {"cpu_s": 3.0}, "op_x": {"cpu_s": 10.0}}
    >>> measured_passes(r, "op_x", False), measured_passes(r, "op_x", True)   # 2 s over 1 s a pass; + a quarter
    (2.0, 2.5)
    """
    base, r, per = results.get("trl_head"), results.get(arm), pass_seconds(results)
    if not _ok(base) or not _ok(r) or per is None:
        return None
    extra = (r["cpu_s"] - base["cpu_s"]) / per  # in the update (TRL's 4 passes)
    return extra * (1.25 if replaces else 1.0)  # the scoring forward is a quarter of the update's passes


def table(seq: int, checkpointing: bool, results: dict | None) -> list[dict]:
    rows = []
    for m in MODELS:
        step, head = step_flops(m, seq, checkpointing)
        for method, (passes, arm, replaces) in METHODS.items():
            measured = measured_passes(results, arm, replaces) if results and arm else (0.0 if arm is None else None)
            rows.append({"model": m.name, "head_share": 5 * head / step, "method": method,
                         "counted": 1 + passes * head / step,
                         "measured": None if measured is None else 1 + measured * head / step})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", default=str(MEASURED),
                    help="a benchmarks/vocab_memory.py --json file (default: the committed one; '' for none)")
    ap.add_argument("--seq", type=int, default=8192, help="prompt + completion tokens per sequence")
    ap.add_argument("--checkpointing", action="store_true", help="count the update's recompute forward")
    a = ap.parse_args(argv)
    results = None
    if a.measured:
        with open(a.measured) as f:
            measured = json.load(f)
        results = measured["results"]
        print(f"measured: {a.measured} ({measured.get('shape')}); one head pass = the faster of TRL's head / 4 and "
              "verl's plain path / 3 in CPU seconds")
    rows = table(a.seq, a.checkpointing, results)
    print(f"sequence {a.seq}, {'with' if a.checkpointing else 'without'} activation checkpointing; training part "
          "of the step only (generation left out: upper bounds)")
    print(f"{'model':14s} {'head share':>10s}  {'method':34s} {'counted':>8s} {'measured':>9s}")
    for r in rows:
        measured = "—" if r["measured"] is None else f"{r['measured']:.3f}×"
        print(f"{r['model']:14s} {r['head_share']:10.1%}  {r['method']:34s} {r['counted']:7.3f}× {measured:>9s}")
    return rows


if __name__ == "__main__":
    main()
