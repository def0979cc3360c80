"""What the sync check's parameter layer costs per sync at real model sizes: the real ``ParameterCheck.snapshot`` on a
stand-in engine holding random bf16 tensors in vLLM's layout (``qkv_proj`` and ``gate_up_proj`` fused, the tied head
not listed) of a Qwen2.5 0.5B / 1.5B / 3B parameter list, against a bf16 trainer state in transformers' layout (two
copies of the model in memory: 12.4 GB at 3B).

    PYTHONPATH=src:. python benchmarks/param_check_cost.py --sizes 0.5B 1.5B 3B --repeat 3 \\
        --json docs/data/benchmarks/param_check_cost.json

Per size: ``mode="hash"`` (BLAKE2b of both sides on the host: what runs on a CPU, and on a GPU after copying every
tensor to the host) timed ``--repeat`` times, the minimum kept (the machine is shared: the minimum is the least
disturbed run), with the bytes hashed; at the first size also the device digest run on this CPU
(``host_types=()``), to show why the host keeps BLAKE2b. Then the fit seconds = a + bytes / throughput over the
sizes (least squares on the minima) and its projection to 7B and 32B. A snapshot is one sync's cost: after_sync
takes one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 151_936
# hidden, intermediate, layers, attention heads, kv heads, head dim, tied head (the models' config.json)
QWEN25 = {
    "0.5B": (896, 4864, 24, 14, 2, 64, True),
    "1.5B": (1536, 8960, 28, 12, 2, 128, True),
    "3B": (2048, 11008, 36, 16, 2, 128, True),
    "7B": (3584, 18944, 28, 28, 4, 128, False),
    "32B": (5120, 27648, 64, 40, 8, 128, False),
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def trainer_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """The transformers parameter list of a Qwen2.5 model: name → shape (the tied head shares the embedding)."""
    hidden, inter, layers, heads, kv, dim, tied = QWEN25[size]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (heads * dim, hidden), p + "self_attn.q_proj.bias": (heads * dim,),
                   p + "self_attn.k_proj.weight": (kv * dim, hidden), p + "self_attn.k_proj.bias": (kv * dim,),
                   p + "self_attn.v_proj.weight": (kv * dim, hidden), p + "self_attn.v_proj.bias": (kv * dim,),
                   p + "self_attn.o_proj.weight": (hidden, heads * dim),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter),
                   p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, hidden)
    return shapes


def parameters(size: str) -> int:
    return sum(torch.Size(s).numel() for s in trainer_shapes(size).values())


def build(size: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(engine tensors, trainer state)``: the engine's fused tensors are copies of the trainer's sources."""
    trainer = {}
    for i, (name, shape) in enumerate(trainer_shapes(size).items()):
        trainer[name] = torch.empty(shape, dtype=torch.bfloat16).fill_(1.0 + i / 4096)  # touched: no lazy pages
    if QWEN25[size][-1]:
        trainer["lm_head.weight"] = trainer["model.embed_tokens.weight"]
    engine = []
    for name, tensor in trainer.items():
        if name == "lm_head.weight" and QWEN25[size][-1]:
            continue  # vLLM lists a tied head once, as the embedding
        fused = next((f for f, srcs in PACKED.items() if f".{srcs[0]}." in name), None)
        if fused is not None:
            engine.append((name.replace(PACKED[fused][0], fused),
                           torch.cat([trainer[name.replace(PACKED[fused][0], s)] for s in PACKED[fused]])))
        elif not any(f".{s}." in name for srcs in PACKED.values() for s in srcs[1:]):
            engine.append((name, tensor.clone()))
    return engine, trainer


def timed(size: str, mode: str, repeat: int, engine: list, trainer: dict) -> dict[str, Any]:
    from offpolicy.rollout.param_check import ParameterCheck

    check = ParameterCheck(packed=PACKED, mode="hash") if mode == "hash" else ParameterCheck(packed=PACKED,
                                                                                             host_types=())
    seconds, loads = [], []
    for _ in range(repeat):
        loads.append(os.getloadavg()[0])
        start = time.perf_counter()
        check.snapshot(engine, trainer)
        seconds.append(time.perf_counter() - start)
    read = check.bytes_hashed + check.bytes_digested
    row = {"size": size, "mode": mode, "parameters": parameters(size), "checked": check.checked, "total": check.total,
           "bytes": read, "seconds": seconds, "min_s": min(seconds), "gb_per_s": read / min(seconds) / 1e9,
           "loads": loads}
    print(f"{size:5s} {mode:6s} {check.checked}/{check.total} tensors, {read / 1e9:.2f} GB read: "
          f"min {min(seconds):.2f} s of {', '.join(f'{s:.2f}' for s in seconds)} (load {max(loads):.1f})", flush=True)
    return row


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares seconds = a + bytes / throughput over ``rows``, a ≥ 0 (a snapshot of nothing costs nothing
    less than zero: where the free fit's a comes out negative — a larger model's runs slowed more by the machine's
    load — the line goes through 0): ``(a, throughput in bytes / s)``."""
    x = torch.tensor([float(r["bytes"]) for r in rows], dtype=torch.float64)
    y = torch.tensor([r["min_s"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], 1)
    a, slope = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    if a < 0:
        a, slope = 0.0, float((x * y).sum() / (x * x).sum())
    return a, 1.0 / slope


def table_of(runs: list[dict], project: list[str]) -> dict[str, Any]:
    """The fit over the BLAKE2b rows and its projection: BLAKE2b reads both sides, 2 bytes per parameter each."""
    hashed = [r for r in runs if r["mode"] == "hash"]
    a0, throughput = fit(hashed) if len(hashed) > 1 else (0.0, hashed[0]["bytes"] / hashed[0]["min_s"])
    return {"fit": {"a_s": a0, "throughput_gb_s": throughput / 1e9}, "measured": hashed,
            "projected": [{"size": s, "parameters": parameters(s), "bytes": 2 * 2 * parameters(s),
                           "seconds": a0 + 2 * 2 * parameters(s) / throughput} for s in project]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["0.5B", "1.5B", "3B"], choices=list(QWEN25))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--digest-repeat", type=int, default=1, help="runs of the device digest on this CPU, first size")
    ap.add_argument("--project", nargs="*", default=["7B", "32B"], choices=list(QWEN25))
    ap.add_argument("--json", default=None)
    ap.add_argument("--refit", action="store_true", help="no runs: fit again the runs of the --json record")
    a = ap.parse_args(argv)
    if a.refit:
        record = json.loads(Path(a.json).read_text())
        loads, runs = record["loads"], record["runs"]
        a = argparse.Namespace(**{**record["args"], "json": a.json, "refit": True})
    else:
        torch.set_num_threads(1)  # BLAKE2b is one thread; the digest's torch ops get the same one
        loads, runs = [os.getloadavg()[0]], []
        for i, size in enumerate(a.sizes):
            engine, trainer = build(size)
            runs.append(timed(size, "hash", a.repeat, engine, trainer))
            if i == 0 and a.digest_repeat:
                runs.append(timed(size, "digest", a.digest_repeat, engine, trainer))
            del engine, trainer
            loads.append(os.getloadavg()[0])
    table = table_of(runs, a.project)
    print(f"fit: seconds = {table['fit']['a_s']:.3f} + bytes / {table['fit']['throughput_gb_s']:.3f} GB/s")
    for p in table["projected"]:
        print(f"  {p['size']}: {p['parameters'] / 1e9:.2f} B parameters, {p['bytes'] / 1e9:.1f} GB per sync → "
              f"{p['seconds']:.0f} s")
    if a.json:
        from offpolicy_testkit.bench_record import write_record

        write_record(a.json, a, loads, runs, table)
    return table


if __name__ == "__main__":
    main()
