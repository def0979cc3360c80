"""A GPU user's first run, checked: the fused kernels against plain math at Qwen's vocabulary, the parameter layer's
device digest, the reference trainer on a bf16 policy and an inspection, each on CUDA, each with one pass / fail line,
all in one JSON (``scripts/gpu_check.sh`` runs it; docs/gpu.md quotes it).

    PYTHONPATH=src:. python scripts/gpu_check.py --out gpu_check.json          # on a CUDA machine
    PYTHONPATH=src:. python scripts/gpu_check.py --cpu-dry-run --out x.json    # the same checks on CPU, small sizes

Nothing is installed and nothing downloaded: a check whose imports are missing (transformers for the model checks)
reports ``skipped: <module> missing`` instead of failing. The exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
QWEN_VOCAB = 151_936
# the kernels compute float32 logits of the inputs as given (bf16 inputs up-cast): their log-probs agree with the
# float32 reference to float32 round-off over the vocabulary; their gradients come back in the input's dtype
KERNEL_TOLERANCE = {"fp32": {"logp": 2e-3, "entropy": 2e-3, "grad": 1e-3},
                    "bf16": {"logp": 2e-3, "entropy": 2e-3, "grad": 2e-2}}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules (None) has no spec
        return False


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if not _importable(m)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_kernels(device: torch.device, n: int, hidden: int, vocab: int) -> dict[str, Any]:
    """``fused_token_stats`` (log-prob, entropy) against float32 log_softmax on the up-cast inputs, forward and the
    backward of Σ c·logp + Σ d·entropy into the hidden states and the head, in bf16 and fp32."""
    from offpolicy.kernels import fused_token_stats

    out: dict[str, Any] = {"shape": {"n": n, "hidden": hidden, "vocab": vocab}}
    failed = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        g = torch.Generator().manual_seed(0)
        h0 = torch.randn(n, hidden, generator=g)
        w0 = torch.randn(vocab, hidden, generator=g) * (2 / math.sqrt(hidden))
        y = torch.randint(0, vocab, (n,), generator=g).to(device)
        c, d = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
        h = h0.to(device=device, dtype=dtype).requires_grad_()
        w = w0.to(device=device, dtype=dtype).requires_grad_()
        _sync(device)
        start = time.perf_counter()
        s = fused_token_stats(h, w, y, want=("logp", "entropy"))
        assert s.logp is not None and s.entropy is not None
        ((s.logp.float() * c).sum() + (s.entropy.float() * d).sum()).backward()
        _sync(device)
        seconds = time.perf_counter() - start
        hr = h.detach().float().requires_grad_()
        wr = w.detach().float().requires_grad_()
        lp = torch.log_softmax(hr @ wr.T, -1)
        ref_logp = lp.gather(1, y[:, None])[:, 0]
        ref_entropy = -(lp.exp() * lp).sum(-1)
        ((ref_logp * c).sum() + (ref_entropy * d).sum()).backward()
        assert h.grad is not None and w.grad is not None and hr.grad is not None and wr.grad is not None
        row = {"logp_max_abs_diff": float((s.logp.detach().float() - ref_logp.detach()).abs().max()),
               "entropy_max_abs_diff": float((s.entropy.detach().float() - ref_entropy.detach()).abs().max()),
               "grad_hidden_rel_err": _rel(h.grad, hr.grad), "grad_head_rel_err": _rel(w.grad, wr.grad),
               "seconds": seconds}
        tol = KERNEL_TOLERANCE[name]
        ok = (row["logp_max_abs_diff"] <= tol["logp"] and row["entropy_max_abs_diff"] <= tol["entropy"]
              and max(row["grad_hidden_rel_err"], row["grad_head_rel_err"]) <= tol["grad"])
        row["tolerance"] = tol
        out[name] = row
        if not ok:
            failed.append(name)
        del lp, hr, wr, h, w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["status"] = "fail" if failed else "pass"
    out["detail"] = (f"fused log-prob + entropy, forward and backward, N={n} H={hidden} V={vocab}: "
                     + ("within tolerance in bf16 and fp32" if not failed else f"outside tolerance in {failed}"))
    return out


def check_param_digest(device: torch.device, numel: int) -> dict[str, Any]:
    """The parameter layer's device digest: the same 16 bytes on the device as on the CPU (exact integer arithmetic),
    nothing copied to the host by a snapshot of device tensors, a tensor left behind named; its time per GB here."""
    from offpolicy.rollout.param_check import ParameterCheck, device_digest

    g = torch.Generator().manual_seed(0)
    source = torch.randn(numel, generator=g)
    on_device = source.to(device)
    part = min(numel, (1 << 20) + 123)  # the CPU's digest is slow: compared on a prefix, a partial block included
    same = device_digest(on_device[:part], torch.bfloat16) == device_digest(source[:part].bfloat16())
    engine = {"w": on_device.bfloat16(), "b": on_device[:4096].bfloat16().clone()}
    trainer = {"w": on_device, "b": on_device[:4096].clone()}
    host_types = () if device.type == "cpu" else ("cpu",)  # the dry run takes the digest path on the CPU's tensors
    check = ParameterCheck(host_types=host_types)
    _sync(device)
    start = time.perf_counter()
    check.calibrate(engine.items(), trainer)
    _sync(device)
    seconds = time.perf_counter() - start
    trainer["b"] = trainer["b"] + 1.0  # the source moved, the engine's copy did not
    left = check.after_sync(engine.items(), trainer)
    ok = same and left == ["b"] and check.bytes_copied == 0 and check.bytes_hashed == 0
    return {"status": "pass" if ok else "fail", "device_equals_cpu": same, "left_named": left,
            "bytes_copied": check.bytes_copied, "bytes_digested": check.bytes_digested, "seconds": seconds,
            "gb_per_s": check.bytes_digested / seconds / 1e9,
            "detail": (f"digest of {numel:,} values: device {'=' if same else '≠'} CPU, left behind {left}, "
                       f"{check.bytes_copied} bytes copied to the host, "
                       f"{check.bytes_digested / seconds / 1e9:.3g} GB/s digested")}


def check_train(device: torch.device, steps: int, out_dir: Path) -> dict[str, Any]:
    """``offpolicy train`` (the CLI, in a subprocess) on the embedded tiny model in bfloat16, the transformers engine
    in bfloat16, on ``device``; every step's loss finite."""
    missing = _missing("transformers", "pydantic", "yaml", "typer")
    if missing:
        return {"status": "skipped", "detail": f"skipped: {', '.join(missing)} missing"}
    run_dir = out_dir / "train"
    overrides = ["model.path=tiny", "model.dtype=bfloat16", "rollout.engine=hf", "rollout.dtype=bfloat16",
                 f"run.device={device.type}", f"run.steps={steps}", f"run.out_dir={run_dir}", "run.tensorboard=false",
                 "run.progress=false", "task.prompts_per_step=4", "rollout.sampling.max_new_tokens=8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "offpolicy.cli", "train", *overrides, "--overwrite"], env=env,
                          capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    losses = [r.get("loss/loss") for r in rows]
    grad_norms = [r.get("loss/grad_norm") for r in rows]
    ok = proc.returncode == 0 and len(rows) == steps and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                             for x in losses + grad_norms)
    result: dict[str, Any] = {"status": "pass" if ok else "fail", "command": "offpolicy train " + " ".join(overrides),
                              "returncode": proc.returncode, "steps_logged": len(rows), "losses": losses,
                              "grad_norms": grad_norms,
                              "seconds": seconds,
                              "detail": f"{len(rows)} of {steps} steps logged, losses {losses}, exit {proc.returncode}"}
    if not ok:
        result["stderr_tail"] = proc.stderr[-2000:]
    return result


def check_inspect(device: torch.device, prompts: int, new_tokens: int) -> dict[str, Any]:
    """The inspection recipe behind ``offpolicy inspect`` (:func:`offpolicy.inspect.run.inspect_engines`) with the
    model on ``device`` (the command line has no device option): bf16 rollout against the fp32 trainer; a finite,
    positive mean KL and every layer measured."""
    missing = _missing("transformers")
    if missing:
        return {"status": "skipped", "detail": f"skipped: {', '.join(missing)} missing"}
    from offpolicy.inspect.run import inspect_engines, load_model
    from offpolicy.inspect.specs import parse_spec
    from offpolicy.inspect.summary import summarize
    from offpolicy.rollout.sampling import SamplingConfig

    model, tok = load_model("tiny")
    model = model.to(device)
    ids = [tok(f"{i}+{2 * i + 1}=")["input_ids"] for i in range(prompts)]
    start = time.perf_counter()
    measured = inspect_engines(model, ids, parse_spec("bf16", "rollout"), parse_spec("fp32", "trainer"),
                               SamplingConfig(max_new_tokens=new_tokens), tokenizer=tok, seed=0)
    summary = summarize(measured)
    seconds = time.perf_counter() - start
    kl = summary.get("kl_mean")
    layers = (summary.get("layers") or {}) if isinstance(summary.get("layers"), dict) else summary.get("layers")
    ok = isinstance(kl, float) and math.isfinite(kl) and kl > 0 and bool(layers)
    return {"status": "pass" if ok else "fail", "kl_mean": kl, "kl_max": summary.get("kl_max"),
            "first_divergent_layer": summary.get("first_divergent_layer"), "positions": summary.get("positions"),
            "seconds": seconds,
            "detail": f"bf16 vs fp32 on the tiny model: mean KL {kl}, first divergent layer "
                      f"{summary.get('first_divergent_layer')}"}


def _guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        result = fn()
    except Exception as err:  # a check that raises is that check's failure, and the others still run
        result = {"status": "fail", "detail": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                  "traceback": traceback.format_exc()[-3000:]}
    print(f"{result['status'].upper():7s} {name}: {result['detail']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="device cpu, small sizes: the script's own test")
    ap.add_argument("--out", default=None, help="the JSON (default $OUT/gpu_check.json, else ./gpu_check.json)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    if a.cpu_dry_run:
        device = torch.device("cpu")
        sizes = {"n": 32, "hidden": 16, "vocab": 4096, "digest": 1 << 16, "steps": 2, "prompts": 4, "tokens": 8}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
                             "--cpu-dry-run runs the same checks on the CPU")
        device = torch.device("cuda")
        sizes = {"n": 2048, "hidden": 2048, "vocab": QWEN_VOCAB, "digest": 1 << 28, "steps": 3, "prompts": 16,
                 "tokens": 32}
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "mode": "cpu-dry-run" if a.cpu_dry_run else "cuda",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "triton": __import__("triton").__version__ if _importable("triton") else None,
        "transformers": __import__("transformers").__version__ if not _missing("transformers") else None,
        "sizes": sizes, "checks": {},
    }
    print(f"gpu_check ({result['mode']}) on {result['device']}: torch {result['torch']}, "
          f"triton {result['triton']}, transformers {result['transformers']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checks = {
            "kernels": lambda: check_kernels(device, sizes["n"], sizes["hidden"], sizes["vocab"]),
            "param_digest": lambda: check_param_digest(device, sizes["digest"]),
            "train": lambda: check_train(device, sizes["steps"], Path(tmp)),
            "inspect": lambda: check_inspect(device, sizes["prompts"], sizes["tokens"]),
        }
        for name, fn in checks.items():
            result["checks"][name] = _guarded(name, fn)
    result["passed"] = all(c["status"] != "fail" for c in result["checks"].values())
    result["elapsed_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'all checks passed' if result['passed'] else 'FAILED'} ({result['elapsed_s']:.0f} s); wrote {out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
