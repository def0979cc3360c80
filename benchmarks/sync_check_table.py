"""The weight-sync check against live in-process vLLM: false alarms over healthy syncs, and how many syncs each kind of
broken sync survives before the check names it — at the learning rates users train with.

One process per (model, engine dtype), since an in-process ``vllm.LLM`` binds the process's threads; JSON to --out::

    python -m benchmarks.sync_check_table --model lab --dtype bfloat16 --out docs/data/sync_check/lab-bfloat16.json
    python -m benchmarks.sync_check_table --model lab --dtype bfloat16 --trainer-dtype bfloat16 \
        --out docs/data/sync_check/lab-bfloat16-trainer-bfloat16.json

``--trainer-dtype bfloat16``: the policy's own parameters bf16 (AdamW on them, as a user who loads a bf16 checkpoint
trains), scored in bf16 by the check; the default is an fp32 trainer.

An existing --out of the same model and dtype keeps its rows for the learning rates not measured in this run; a row
for a learning rate measured again is replaced (so one learning rate can be re-run, or an interrupted run resumed).

Per learning rate: the engine and the trainer restored to the starting weights, the check calibrated on tokens the
engine sampled (16 rows), then ``--healthy`` syncs, each after one AdamW step (the learning rate given) on a
policy-gradient surrogate −A · log π(y) over the same 32 sampled completions with fresh ±1 advantages — updates of the
size a GRPO step makes under Adam — counting alarms (``on_failure="warn"``); then each broken sync in turn, from a
fresh calibration, up to ``--max-delay`` syncs, recording the first sync that alarmed and which test caught it:

* ``noop``: nothing pushed (a sync that does nothing; what a server that ignores a new file beside a sharded
  checkpoint's index does);
* ``head``: every tensor but ``lm_head.weight`` (a tied head left behind);
* ``layer``: every tensor but the last decoder layer's;
* ``dtype``: the weights' bf16 bits read as fp16 (weights loaded in the wrong dtype).

Two layers, each timed to its own first alarm: the behavioural one (``syncs``, ``caught_by``: the gap, the engine's
motion or the staleness) and, where the engine's tensors are readable (in-process vLLM), the parameter layer
(``params_syncs``; its own false alarms over the healthy syncs: ``params_false_alarms``).

``--model lab-wide`` is the lab model with its vocabulary widened to Qwen2.5's 151,936 ids and its head shape (tied,
256 wide): the 147,837 new rows are drawn N(0, s²/4), s the standard deviation of the trained rows, so their logits
sit near zero while the trained tokens' spread as before — a large tail of unused tokens, as Qwen2.5's tokenizer
leaves ~270 ids unused and a trained model puts little mass on most of its vocabulary. It stands in for the head's
shape and the log-softmax over 151,936 entries, not for a trained 0.5 B model's numerics.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

QWEN_VOCAB = 151_936
MODES = ("noop", "head", "layer", "dtype")


def widen_vocabulary(model: torch.nn.Module, vocab: int, seed: int = 0) -> torch.nn.Module:
    """``model`` (a tied Qwen2 causal LM) with ``vocab`` rows in its embedding / head, the new ones N(0, s²/4)."""
    old = model.get_input_embeddings().weight.data
    g = torch.Generator().manual_seed(seed)
    extra = torch.randn(vocab - old.shape[0], old.shape[1], generator=g) * (old.std() / 2)
    model.resize_token_embeddings(vocab)
    with torch.no_grad():
        model.get_input_embeddings().weight[old.shape[0]:] = extra.to(old.dtype)
    model.tie_weights()
    return model


def broken(model: torch.nn.Module, mode: str):
    """The (name, tensor) stream a broken sync of kind ``mode`` pushes (None: nothing)."""
    state = model.state_dict()
    if mode == "noop":
        return None
    if mode == "head":
        return [(k, v) for k, v in state.items() if k != "lm_head.weight"]
    if mode == "layer":
        last = max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
        return [(k, v) for k, v in state.items() if not k.startswith(f"model.layers.{last}.")]
    if mode == "dtype":
        return [(k, v.to(torch.bfloat16).view(torch.float16).float() if v.is_floating_point() else v)
                for k, v in state.items()]
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def caught_by(message: str) -> str:
    if "nats per token from" in message:
        return "gap"
    if "moved" in message:
        return "motion"
    if "of the way back" in message:
        return "staleness"
    if "did not change while" in message:
        return "params"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("lab", "lab-wide"), default="lab")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--trainer-dtype", choices=("bfloat16", "float32"), default="float32")
    ap.add_argument("--lrs", default="1e-6,1e-5,3e-4")
    ap.add_argument("--healthy", type=int, default=200)
    ap.add_argument("--max-delay", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from offpolicy.models import load_model
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import sequence_logprobs
    from offpolicy.rollout.sync_check import SyncCheck, SyncProbe
    from offpolicy.rollout.vllm import VLLMRolloutEngine, push_weights

    torch.manual_seed(0)
    model, tok = load_model("lab")
    if args.model == "lab-wide":
        model = widen_vocabulary(model, QWEN_VOCAB)
    model = model.to(getattr(torch, args.trainer_dtype)).eval()
    start_state = copy.deepcopy(model.state_dict())
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine.from_model(model, tok, dtype=args.dtype, seed=0, max_model_len=256)
    startup = time.perf_counter() - t0
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50), (61, 2), (9, 90),
                                                         (44, 11), (8, 19)] * 4]
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=24), seed=0)
    probe = SyncProbe.from_rollout(out.prompt_ids, out.completion_ids, rows=16)
    result: dict = {"model": args.model, "vocab": int(model.config.vocab_size), "dtype": args.dtype,
                    "trainer_dtype": args.trainer_dtype,
                    "probe_rows": len(probe.prompt_ids), "probe_tokens": probe.n_tokens, "startup_s": startup,
                    "threads": torch.get_num_threads(), "settings": []}
    lrs = [float(x) for x in args.lrs.split(",")]
    kept = _kept_rows(Path(args.out), args.model, args.dtype, args.trainer_dtype, lrs)

    def restore():
        model.load_state_dict(start_state)
        push_weights(engine.llm, model.state_dict().items())

    def calibrated() -> SyncCheck:
        check = SyncCheck(on_failure="warn")
        check.calibrate(engine, model, probe)
        return check

    def step(opt, gen):
        adv = (torch.randint(0, 2, (len(out.completion_ids),), generator=gen) * 2 - 1).float()
        logp, mask = sequence_logprobs(model, out.prompt_ids, out.completion_ids)
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for lr in lrs:
        restore()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        check = calibrated()
        row: dict = {"lr": lr, "max_delay": args.max_delay, "baseline": check.baseline, "standard_error": check.standard_error,
                     "threshold": check.threshold, "noise_rms": check.noise_rms, "repeat_rms": check.repeat_rms}
        alarms, ratios, motions, push_s, check_s, params_left = [], [], [], [], [], []
        for i in range(args.healthy):
            step(opt, gen)
            a = time.perf_counter()
            push_weights(engine.llm, model.state_dict().items())
            push_s.append(time.perf_counter() - a)
            m = check.after_sync(engine, model, what=f"healthy sync {i + 1}")
            check_s.append(m["sync/seconds"])
            ratios.append(m["sync/ratio"])
            if math.isfinite(m["sync/engine_motion"]):
                motions.append(m["sync/engine_motion"])
            if m["sync/ok"] != 1.0:
                alarms.append(i + 1)
            if "sync/params_left" in m:
                params_left.append(m["sync/params_left"])
        if check.parameters is not None:  # the parameter layer (an in-process engine): its own false alarms
            row.update(params_checked=check.parameters.checked, params_total=check.parameters.total,
                       params_false_alarms=sum(1 for n in params_left if n > 0))
        row.update(healthy=args.healthy, false_alarms=len(alarms), false_alarm_syncs=alarms[:10],
                   ratio_max=max(ratios), ratio_min=min(ratios), gap_last=ratios[-1] * (check.baseline or 0),
                   motion_min=min(motions) if motions else None,
                   push_s_median=sorted(push_s)[len(push_s) // 2], check_s_median=sorted(check_s)[len(check_s) // 2])
        row["detection"] = {}
        for mode in MODES:
            restore()
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            check = calibrated()
            # each layer timed on its own: the parameter layer runs beside the check, not in it (a sync it failed
            # would not be verified, which changes when the behavioural layer resolves)
            params, check.parameters = check.parameters, None
            delay, by, params_delay = None, None, None  # the behavioural layer's first alarm; the parameter layer's
            for i in range(args.max_delay):
                step(opt, gen)
                named = broken(model, mode)
                if named is not None:
                    push_weights(engine.llm, named)
                records: list[str] = []
                handler = logging.Handler()
                handler.emit = lambda r, records=records: records.append(r.getMessage())  # type: ignore[method-assign]
                logger = logging.getLogger("offpolicy.rollout.sync_check")
                logger.addHandler(handler)
                try:
                    m = check.after_sync(engine, model, what=f"{mode} sync {i + 1}")
                finally:
                    logger.removeHandler(handler)
                if params is not None and params_delay is None and params.after_sync(engine.engine_parameters()[0],
                                                                                     model.state_dict()):
                    params_delay = i + 1
                if delay is None and m["sync/ok"] != 1.0:
                    delay, by = i + 1, caught_by(records[-1] if records else "")
                # once the behavioural layer fired, the parameter layer gets two more syncs (a wrong dtype changes
                # every tensor: that layer never fires on it)
                if delay is not None and (params_delay is not None or params is None or i + 1 >= delay + 2):
                    break
            row["detection"][mode] = {"syncs": delay, "caught_by": by, "params_syncs": params_delay,
                                      "syncs_run": i + 1,
                                      "last_ratio": m["sync/ratio"],
                                      "last_stale_fraction": m["sync/stale_fraction"],
                                      "last_step_rms": m["sync/step_rms"],
                                      "last_engine_motion": m["sync/engine_motion"]}
        result["settings"].append(row)
        print(json.dumps(row), flush=True)
        _write(Path(args.out), {**result, "settings": kept + result["settings"]})  # after every learning rate: an interrupted run keeps what it measured


def _kept_rows(path: Path, model: str, dtype: str, trainer_dtype: str, lrs: list[float]) -> list[dict]:
    """The rows of an earlier run into ``path`` (same model and dtypes) for learning rates not in ``lrs``."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    held = (old.get("model"), old.get("dtype"), old.get("trainer_dtype", "float32"))
    if held != (model, dtype, trainer_dtype):
        raise SystemExit(f"--out {path}: holds model={held[0]} dtype={held[1]} trainer_dtype={held[2]}, "
                         f"not model={model} dtype={dtype} trainer_dtype={trainer_dtype}")
    return [row for row in old["settings"] if row["lr"] not in lrs]


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
