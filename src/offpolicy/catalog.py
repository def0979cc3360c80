"""Every method, one row each — what the method tables of README.md and docs/methods/index.md are generated from
(``python docs/_ext/generated.py``), and what keeps the citations consistent.

A row names the method, its page under ``docs/methods/``, a short equation, the *one* paper it comes from (an arXiv id
from :data:`PAPERS`, or a framework when there is no paper) and every name it is registered under: corrections and
objectives (:mod:`offpolicy.registry`), trainer presets (:data:`offpolicy.train.presets.PRESETS`). The tests
(tests/test_catalog.py) fail when a registered correction, objective or preset is in no row, and when any file of the
repository cites an arXiv id that :data:`PAPERS` does not list — so a new method, or a mistyped id, cannot slip in
unlisted.

>>> by_name("DVP").arxiv, by_name("DVP").presets
('2512.23087', ('dvp', 'dvp_mis'))
>>> sorted({m.page for m in METHODS})[:3]
['alp', 'diagnostics', 'importance-sampling']
"""

from __future__ import annotations

from dataclasses import dataclass

# Every arXiv id cited anywhere in the repository, with what it is. One id per paper, one paper per method.
PAPERS: dict[str, str] = {
    "1707.06347": "Proximal Policy Optimization (PPO)",
    "1909.05858": "CTRL (the repetition penalty)",
    "1912.09729": "dual-clip PPO",
    "2110.00641": "decoupled PPO (batch size invariance)",
    "2402.03300": "DeepSeekMath (GRPO)",
    "2402.14740": "RLOO (Back to Basics)",
    "2503.14476": "DAPO (clip-higher, token-level loss)",
    "2503.20783": "Dr. GRPO",
    "2506.13585": "MiniMax-M1 (CISPO)",
    "2507.18071": "GSPO",
    "2510.01161": "M2PO (second-moment trust region)",
    "2510.11370": "rollout routing replay (R3)",
    "2510.13786": "ScaleRL (the art of scaling RL compute: an fp32 LM head)",
    "2510.18855": "Ring-1T (IcePop)",
    "2511.20347": "SAPO",
    "2512.02556": "DeepSeek-V3.2 (OPSM, keep sampling mask)",
    "2512.23075": "Trust Region Masking (TRM)",
    "2512.23087": "Dynamic Vocabulary Pruning (DVP)",
    "2602.02276": "Kimi K2.5 (squared log-ratio penalty)",
    "2602.04879": "DPPO (trust region on probability differences)",
    "2603.19470": "Adaptive Layerwise Perturbation (ALP)",
    "2603.20521": "Delightful Distributed Policy Gradient (the delight gate)",
    "2609.20807": "score centering",
    "2609.22870": "calibrated clipping for low-precision rollouts",
    "2609.32444": "calibrated importance sampling",
}


@dataclass(frozen=True)
class Method:
    """One method: ``name`` as the docs say it, ``page`` (``docs/methods/<page>.md``), a short ``equation``, its one
    ``arxiv`` id (None when it comes from a framework) and ``source`` text, and the names it is registered under."""

    name: str
    page: str
    equation: str
    arxiv: str | None
    source: str
    corrections: tuple[str, ...] = ()
    objectives: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    setting: str = ""  # how to switch it on when it is not a registered name (a config key, a class)

    @property
    def cite(self) -> str:
        """``arXiv <id>`` plus any section, or the framework source."""
        return f"arXiv {self.arxiv}{' ' + self.source if self.source else ''}" if self.arxiv else self.source

    @property
    def names(self) -> str:
        """What a user writes: registered names, then presets not already among them, then the setting."""
        registered = [*self.corrections, *self.objectives]
        presets = [p for p in self.presets if p not in registered]
        parts = [f"`{n}`" for n in registered] + [f"preset `{p}`" for p in presets]
        return ", ".join(parts + ([self.setting] if self.setting else []))


METHODS: tuple[Method, ...] = (
    Method("TIS", "importance-sampling", "w = min(ρ, C), ρ = π_old/μ, at token / sequence / geometric level", None,
           "Yao et al. 2025; ms-swift, verl, TRL", corrections=("tis",), presets=("tis",)),
    Method("MIS", "importance-sampling", "w = ρ · 1[L ≤ ρ ≤ U]", None, "ms-swift, verl, TRL",
           corrections=("mis",), presets=("mis",)),
    Method("geometric mask", "importance-sampling", "keep iff L ≤ ρ_geo ≤ U (length-normalised ratio)", None,
           "ms-swift, verl", corrections=("geo_mask",), presets=("geo_mask",)),
    Method("IcePop", "importance-sampling", "token mask outside the band [0.5, 5]", "2510.18855", "",
           corrections=("icepop",), presets=("icepop",)),
    Method("general IS", "importance-sampling", "level × mode × bounds, the form the four above take", None,
           "this library", corrections=("importance",)),
    Method("gated IS", "importance-sampling", "a gate on ρ, the binary KL or TV of the sampled token; survivors keep ρ_t",
           None, "OpenRLHF is_correction", corrections=("gated_is",)),
    Method("calibrated IS", "importance-sampling", "w = min(ρ, 1 + λ·max(1 − π_old(y), κ)): a tighter cap for "
           "confident tokens", "2609.32444", "(unmeasured here)", corrections=("calibrated_is",)),
    Method("OPSM", "sequence-masks", "drop iff A < 0 and mean_t log(μ/π_θ) > δ", "2512.02556", "§3.1",
           corrections=("opsm",), presets=("opsm",)),
    Method("token veto", "sequence-masks", "drop the sequence if any ρ_t < τ (1e-4)", "2512.23087", "App. A",
           corrections=("veto",), setting="`algorithm.veto_threshold`"),
    Method("TRM", "trust-regions", "keep iff max_t KL_t ≤ δ and mean_t KL_t ≤ δ_avg; LN-TRM, SER", "2512.23075", "",
           corrections=("trm", "ln_trm", "ser"), presets=("trm",)),
    Method("k2 / k3 rejection", "trust-regions", "verl's rollout_rs k2 / k3 modes", None, "verl",
           corrections=("kl_rejection",)),
    Method("DVP", "vocabulary", "all policies on {a : π(a) ≥ p_min · max π}, renormalised", "2512.23087", "",
           corrections=("dvp_keep",), presets=("dvp", "dvp_mis")),
    Method("sampling replay", "vocabulary", "π_θ on the engine's top-k / top-p / min-p support", "2512.02556",
           "(keep sampling mask)", setting="`replay_support_logp`, TRL `sampling_replay=True`"),
    Method("ALP", "alp", "h′ = h + σ_l ε per layer; ratio π_{θ,σ}/μ", "2603.19470", "",
           presets=("alp", "alp_score_centering", "alp_score_centering_topk"),
           setting="`LayerwisePerturbation`"),
    Method("PPO", "objectives", "clipped surrogate on r = π_θ/π_old (dual clip optional)", "1707.06347", "",
           objectives=("ppo",), presets=("naive",)),
    Method("decoupled PPO", "objectives", "PPO · π_old/μ", "2110.00641", "", objectives=("decoupled",)),
    Method("bypass", "objectives", "PPO on π_θ/μ (no π_old forward)", None, "verl bypass mode",
           objectives=("bypass",)),
    Method("GSPO", "objectives", "PPO on the geometric sequence ratio", "2507.18071", "", objectives=("gspo",)),
    Method("calibrated clipping", "objectives", "PPO on π_θ/μ, ε_low / ε_high widened to the batch's π_old/μ "
           "1 % / 99 % quantiles", "2609.22870", "(unmeasured here)", objectives=("calibrated_clip",)),
    Method("REINFORCE", "objectives", "−A · log π_θ (no ratio)", None, "Williams 1992", objectives=("reinforce",)),
    Method("CISPO", "objectives", "−sg[clip(r)] · A · log π_θ", "2506.13585", "§3.1", objectives=("cispo",)),
    Method("SAPO", "objectives", "−(4/τ) σ(τ(r − 1)) · A", "2511.20347", "", objectives=("sapo",)),
    Method("DPPO", "objectives", "−A · sg[min(r, C)] · log π_θ inside a TV / KL region", "2602.04879", "",
           objectives=("dppo_tv", "dppo_kl")),
    Method("M2PO", "stale", "drop the largest (log π_θ/μ)² in PPO's active quadrants until their mean ≤ τ",
           "2510.01161", "Alg. 1", corrections=("m2po",), presets=("m2po",)),
    Method("IPO", "stale", "−A·r·1[|π − μ| ≤ δ] + τ_kl (log r)²", None, "prime-rl loss.py", objectives=("ipo",),
           presets=("ipo",)),
    Method("delight gate", "stale", "w = σ(A · (−log π_old(y)) / η): surprising failures suppressed, no μ",
           "2603.20521", "(unmeasured here)", corrections=("delight",)),
    Method("score centering", "stale", "∇log π(y) − E_q[∇log π]: onehot(y) − q in the logits, exact or top-k; "
           "under TIS / IcePop w(r)∇log π(y) − E_q[w ∇log π]",
           "2609.20807", "", presets=("score_centering", "score_centering_topk", "score_centering_tis",
                                      "score_centering_icepop", "score_centering_replay")),
    Method("routing replay", "source-fixes", "R2 / R3: replay the rollout's MoE experts", "2510.11370", "",
           setting="`rollout.routing_replay`"),
    Method("diagnostics", "diagnostics", "KL, k2, k3, χ², ESS, PPL gap under each framework's names", None,
           "ms-swift, verl, TRL, OpenRLHF", setting="`offpolicy_metrics`"),
)


def by_name(name: str) -> Method:
    """The row of the method called ``name`` (as in the docs)."""
    for method in METHODS:
        if method.name == name:
            return method
    raise ValueError(f"no method {name!r} in the catalog; known: {', '.join(m.name for m in METHODS)}")


def methods_table(link_prefix: str = "") -> str:
    """The method table in Markdown, each method linked to ``link_prefix + page + .md``.

    >>> methods_table().splitlines()[2].startswith("| [TIS](importance-sampling.md) | w = min(ρ, C)")
    True
    """
    rows = ["| method | equation (short) | source | how to use it |", "|---|---|---|---|"]
    for m in METHODS:
        equation = m.equation.replace("|", "\\|")
        rows.append(f"| [{m.name}]({link_prefix}{m.page}.md) | {equation} | {m.cite} | {m.names} |")
    return "\n".join(rows)
