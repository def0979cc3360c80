"""One config source for the trainer, the YAML files and the CLI (pydantic v2, unknown keys are errors).

Sections: ``model``, ``task``, ``rollout`` (with ``sampling``), ``algorithm``, ``optim``, ``alp``, ``control``, ``run``
(all but ``algorithm`` in :mod:`offpolicy.train.config_sections`; overrides are parsed by :mod:`offpolicy.train.overrides`).
Load with :func:`load_config` (YAML file + ``key.sub=value`` overrides); every check that can fail does so here,
before a model is loaded or a token generated.

>>> cfg = load_config(None, ["algorithm.preset=mis", "run.steps=3"])
>>> cfg.algorithm.preset, cfg.run.steps
('mis', 3)
>>> load_config(None, ["algorithm.bogus=1"])
Traceback (most recent call last):
...
ValueError: unknown config key 'algorithm.bogus' (valid keys in 'algorithm': ...)
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# the sections live in their own module; their names stay importable from here
from offpolicy.train.config_sections import (
    ALPConfig,
    ConfigSection,
    ControlConfig,
    LlamaCppSection,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    SamplingSection,
    ServerSection,
    TaskConfig,
    VLLMSection,
)
from offpolicy.train.overrides import explain, set_override
from offpolicy.train.presets import PRESET_PARAMETERS, PRESETS
from offpolicy.train.proximal import check_loglinear
from offpolicy.yaml_numbers import load_yaml, yaml_problem

EMBEDDED_MODELS = ("tiny", "lab", "lab-moe", "tiny-random")  # model.path values that need no directory (the recipes
# of offpolicy.models.RECIPES and a random init; tests/models/test_moe.py checks they agree)

__all__ = [
    "EMBEDDED_MODELS",
    "OBJECTIVE_DEFAULTS",
    "OBJECTIVE_KEYS",
    "ALPConfig",
    "AlgorithmConfig",
    "ConfigSection",
    "ControlConfig",
    "LlamaCppSection",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingSection",
    "ServerSection",
    "TaskConfig",
    "TrainConfig",
    "VLLMSection",
    "config_to_yaml",
    "import_plugin",
    "load_config",
    "objective_call",
]


class AlgorithmConfig(ConfigSection):
    """A preset names a correction chain + objective; the fields below tune it (None = the preset's default).

    ``corrections`` (registered names, each ``name`` or ``{name: ..., **params}``) replaces the preset's corrections;
    ``objective`` (a registered name or ``{name: ..., **params}``) its objective. ``clip_low`` / ``clip_high`` /
    ``dual_clip`` / ``level`` set the objective's parameters of these names (ε_low 0.2 and ε_high 0.28 by default).
    """

    preset: str = "naive"
    corrections: list[str | dict[str, Any]] | None = None
    objective: str | dict[str, Any] | None = None
    level: Literal["token", "sequence", "geometric"] | None = None  # ratio level of the objective (GSPO-style)
    clip_low: float | None = Field(None, ge=0, le=1)  # 1: no lower bound (r ≥ 0), e.g. CISPO as MiniMax ran it
    clip_high: float | None = Field(None, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    # decoupled PPO's π_prox: recompute (the trainer's forward) or loglinear (AReaL's interpolation between μ and π_θ by
    # per-token policy versions, no forward: offpolicy.train.proximal); None: the objective's own (recompute)
    proximal: Literal["recompute", "loglinear"] | None = None
    aggregation: str = "token_mean"  # a registered aggregation (token_mean, seq_mean_token_mean, … token_sum)
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    group_size: int = Field(4, ge=1)
    # correction parameters (used by the presets that need them)
    is_level: Literal["token", "sequence", "geometric"] = "token"  # level of the tis / mis importance ratio
    is_lower: float | None = Field(None, ge=0)
    is_upper: float | None = Field(None, gt=0)
    opsm_delta: float = Field(1e-4, ge=0)
    # trm's two tests (the paper's thresholds); null turns that test off (at least one must stay on)
    trm_max_kl: float | None = Field(0.05, gt=0)
    trm_avg_kl: float | None = Field(0.001, gt=0)
    dvp_rho: float = Field(math.exp(-13), gt=0, lt=1)
    # DVP's safe set adapted to each position's entropy: only the most likely tokens that hold 1 − ε of the mass are
    # kept (min-p(ρ) ∩ top-p(1 − ε)), on the engine's side and the trainer's; null = the paper's fixed ρ
    dvp_coverage: float | None = Field(None, gt=0, lt=1)
    veto_threshold: float | None = Field(None, gt=0, lt=1)
    # a Recipe (offpolicy.recipe: a file path, inline YAML / mapping, or a named recipe), mapped onto the keys above,
    # alp.*, rollout.* and run.metric_naming when the config is read (offpolicy.recipe.hosts.trainer_tree); the
    # config then holds the mapped keys and no recipe
    recipe: str | dict[str, Any] | None = None
    # plug-in log-prob transforms (registered with offpolicy.register_transform, with an apply), run on each
    # minibatch before the loss, in this order
    transforms: list[str | dict[str, Any]] | None = None

    @field_validator("transforms")
    @classmethod
    def _plugin_transforms(cls, v: list[Any] | None) -> list[Any] | None:
        from offpolicy.registry import build_transform

        for i, spec in enumerate(v or []):
            try:
                bound = build_transform(spec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"entry {i}: {err}") from None
            if bound.entry.apply is None:
                raise ValueError(f"entry {i}: {bound.name!r} is a built-in transform, set by the preset and its keys "
                                 "(or algorithm.recipe)")
        return v

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"algorithm.preset {v!r} is unknown; choose one of {sorted(PRESETS)}")
        return v

    @field_validator("corrections")
    @classmethod
    def _buildable_corrections(cls, v: list[Any] | None) -> list[Any] | None:
        """Every spec names a registered correction and parameters it takes (built here, so errors come first)."""
        from offpolicy.registry import build_correction

        if v is None:
            return v
        names: list[str] = []
        for i, spec in enumerate(v):
            try:
                correction = build_correction(spec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"entry {i}: {err}") from None
            if correction is not None and correction.name in names:
                raise ValueError(f"entry {i}: a second {correction.name!r} would overwrite the "
                                 "first one's metrics (importance(name=...) gives an importance correction its own)")
            names.append(correction.name if correction is not None else "")
        return v

    @field_validator("objective")
    @classmethod
    def _registered_objective(cls, v: Any) -> Any:
        from offpolicy.losses import resolve_objective

        if v is not None:
            resolve_objective(v)
        return v

    @field_validator("aggregation")
    @classmethod
    def _registered_aggregation(cls, v: str) -> str:
        from offpolicy.registry import AGGREGATIONS

        if v not in AGGREGATIONS:
            raise ValueError(f"{v!r} is unknown; registered: {', '.join(AGGREGATIONS.names())}")
        return v



class TrainConfig(ConfigSection):
    # modules imported before the rest is read, so that the corrections / objectives they register can be named
    plugins: list[str] = Field(default_factory=list)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    alp: ALPConfig = Field(default_factory=ALPConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        if isinstance(data, dict):
            plugins = data.get("plugins") or []
            if not isinstance(plugins, list):
                raise ValueError(f"plugins must be a list of modules, got {plugins!r}")
            for module in plugins:
                import_plugin(module)
            from offpolicy.recipe.hosts import trainer_tree

            data = trainer_tree(data)  # after the plug-ins: a recipe may name what they register
        return data

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        a = self.algorithm
        alp_preset = PRESETS[a.preset].alp if a.preset in PRESETS else False
        if alp_preset and not self.alp.enabled:
            raise ValueError(f"algorithm.preset={a.preset!r} needs alp.enabled=true (or use another preset)")
        if self.alp.enabled and not alp_preset:
            raise ValueError(f"alp.enabled=true only works with an ALP preset (alp, alp_score_centering, "
                             f"alp_score_centering_topk), not algorithm.preset={a.preset!r}")
        if a.advantage == "rloo" and a.group_size < 2:
            raise ValueError("algorithm.group_size must be >= 2 for algorithm.advantage='rloo' (leave-one-out)")
        if a.advantage in ("grpo", "dr_grpo") and a.group_size < 2:
            raise ValueError(f"algorithm.group_size must be >= 2 for algorithm.advantage={a.advantage!r} (group baseline)")
        batch = self.task.prompts_per_step * a.group_size
        if self.optim.minibatches > batch:
            raise ValueError(f"optim.minibatches={self.optim.minibatches} exceeds the batch of {batch} sequences")
        if alp_preset and a.objective not in (None, "bypass"):
            raise ValueError(f"algorithm.objective={a.objective!r} contradicts preset {a.preset!r} (its unified ratio "
                             "π_{θ,σ}/μ is the bypass objective)")
        if alp_preset and a.level is not None:
            raise ValueError(f"algorithm.level does not apply to preset {a.preset!r}: set alp.level (token | geometric | "
                             "sequence)")
        check_loglinear(self, objective_call(self)[1])  # the objective takes the keys that are set; loglinear fits
        if a.corrections is not None:
            fields = AlgorithmConfig.model_fields
            tuned = sorted(k for k in PRESET_PARAMETERS if getattr(a, k) != fields[k].default)
            if tuned:
                raise ValueError(f"algorithm.{tuned[0]} tunes the preset's own corrections; with algorithm.corrections "
                                 "set, give the parameter in that correction's entry")
        if a.is_lower is not None and a.is_upper is not None and a.is_lower >= a.is_upper:
            raise ValueError("algorithm.is_lower must be < algorithm.is_upper")
        if self.optim.schedule == "step" and self.optim.min_lr_scale == 0:
            raise ValueError("optim.min_lr_scale must be > 0 with optim.schedule=step: repeated cuts would reach a rate "
                             "of 0 (e.g. optim.min_lr_scale=0.05)")
        r = self.rollout.sampling
        if a.dvp_coverage is not None and not (a.preset in PRESETS and PRESETS[a.preset].minp):
            raise ValueError(f"algorithm.dvp_coverage adapts DVP's safe set; preset {a.preset!r} has none (use dvp or "
                             "dvp_mis)")
        if a.preset in PRESETS and PRESETS[a.preset].minp and (r.top_k or r.top_p < 1.0 or r.min_p > a.dvp_rho):
            # the trainer scores DVP's min-p safe set only: any other truncation would make μ a different
            # distribution from the one scored, and every ratio would carry the truncated mass as fake mismatch
            raise ValueError(f"rollout.sampling.top_k / top_p / min_p > algorithm.dvp_rho do not combine with "
                             f"preset {a.preset!r}: its policy is the min-p (ρ = dvp_rho) safe set alone")
        if a.preset == "trm" and a.corrections is None and a.trm_max_kl is None and a.trm_avg_kl is None:
            raise ValueError("algorithm.trm_max_kl and algorithm.trm_avg_kl are both null: preset 'trm' needs at "
                             "least one of its two tests")
        path = self.model.path
        if path not in EMBEDDED_MODELS and not Path(path).expanduser().is_dir():
            raise ValueError(f"model.path {path!r} is not a local directory (and not one of {list(EMBEDDED_MODELS)}); "
                             "offpolicy never downloads weights")
        return self


# The trainer's defaults for the PPO family's clip range (DAPO's clip-higher), used when the objective takes them.
OBJECTIVE_DEFAULTS: dict[str, float] = {"clip_low": 0.2, "clip_high": 0.28}
OBJECTIVE_KEYS = ("clip_low", "clip_high", "dual_clip", "level", "proximal")


def objective_call(cfg: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The objective the trainer runs and its parameters: ``algorithm.objective`` (or the preset's), its own
    parameters, the trainer's defaults and the preset's dual clip where the objective takes them, then the
    ``algorithm.clip_low`` / ``clip_high`` / ``dual_clip`` / ``level`` that are set. One of these keys set for an
    objective that does not take it is a ``ValueError`` naming the key.

    >>> objective_call(load_config(None, ["algorithm.objective={name: sapo, tau_neg: 2.0}"]))
    ('sapo', {'tau_neg': 2.0})
    >>> objective_call(load_config(None, ["algorithm.objective=cispo"]))
    ('cispo', {'clip_low': 0.2, 'clip_high': 0.28})
    """
    from offpolicy.registry import OBJECTIVES, split_spec

    a = cfg.algorithm
    preset = PRESETS[a.preset]
    name, own = split_spec(a.objective if a.objective is not None else preset.objective, "objective")
    takes = OBJECTIVES[name].parameters()
    params = {k: v for k, v in {**OBJECTIVE_DEFAULTS, "dual_clip": preset.dual_clip}.items()
              if k in takes and v is not None}
    params.update(own)
    for key in OBJECTIVE_KEYS:
        value = getattr(a, key)
        if value is None or (key == "level" and value == "token" and key not in takes):
            continue  # every objective works at token level
        if key not in takes:
            raise ValueError(f"algorithm.{key} does not apply to objective {name!r} (it takes: "
                             f"{', '.join(takes) or 'no parameters'})")
        if name == "gspo" and key == "level" and value != "geometric":
            raise ValueError(f"algorithm.level={value!r} contradicts algorithm.objective='gspo' (GSPO is geometric)")
        params[key] = value
    return name, params


def import_plugin(module: str) -> None:
    """Import a plug-in: a module name (found on ``sys.path`` or in the current directory) or a ``.py`` file path.
    Its ``register_correction`` / ``register_objective`` calls make its names usable in the config."""
    if not isinstance(module, str) or not module:
        raise ValueError(f"plugins: each entry is a module name or a .py file, got {module!r}")
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser()
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None or not path.is_file():
                raise FileNotFoundError(f"no such file {str(path)!r}")
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = loaded
            spec.loader.exec_module(loaded)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a console script's path lacks the cwd
                sys.path.append(str(Path.cwd()))
            importlib.import_module(module)
    except Exception as err:  # an import runs arbitrary code: any failure is reported as the plug-in's
        raise ValueError(f"plugins: cannot import {module!r}: {type(err).__name__}: {err}") from None



# -- loading ---------------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults), apply ``key.sub=value`` overrides, validate everything.

    The file and an override's value are YAML with numbers as YAML 1.2 writes them (``3``, ``1e-4``, ``2e0``, ``.5``:
    :mod:`offpolicy.yaml_numbers`), ``true``, ``[0, 1]``, ``null``; except for string fields
    (``run.out_dir``, ``task.name``, ``model.path`` …), which take the text as written (``run.out_dir=exp #1``).

    Raises ``ValueError`` naming the offending key for unknown keys, bad values and impossible combinations.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"config file {str(p)!r} is a directory; give a YAML file")
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        try:
            loaded = load_yaml(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:  # not a ValueError: without this the CLI showed a parser traceback
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {yaml_problem(err)}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {str(p)!r} cannot be read: {err}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r} must contain a mapping, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key, text = item.split("=", 1)
        set_override(tree, key.strip(), text, TrainConfig)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ValueError(explain(err)) from None


def config_to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML (what a run writes to ``out_dir/config.yaml``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
