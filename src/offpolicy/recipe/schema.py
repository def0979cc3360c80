"""The :class:`Recipe`: one schema for a method's corrections, objective, aggregation, log-prob transforms, sync check
and metric naming, read alike by the reference trainer (``algorithm.recipe``), ``OffPolicyGRPOTrainer(recipe=...)``
and verl's ``OFFPOLICY_VERL`` block.

Sections (every one optional; one left out is the host's own default)::

    corrections: [{name: tis, upper: 2.0}]          # a chain of registered corrections (offpolicy.CORRECTIONS)
    objective: {name: ppo, clip_low: 0.2}           # a registered objective and its parameters (or just its name)
    aggregation: token_mean                         # a registered aggregation
    transforms: {dvp: {rho: 1.0e-4}}                # registered log-prob transforms (offpolicy.TRANSFORMS) → params
    sync_check: error                               # error | warn | off
    naming: trl                                     # the metric naming (offpolicy.NAMINGS)

>>> r = Recipe.load("{corrections: [tis], transforms: {dvp: {rho: 1e-4}}, sync_check: warn}")
>>> r.transforms, r.sync_check
({'dvp': {'rho': 0.0001}}, 'warn')
>>> Recipe.load({"transfroms": {}})
Traceback (most recent call last):
...
ValueError: recipe: unknown key 'transfroms' (did you mean 'transforms'?); valid: corrections, objective, aggregation, transforms, sync_check, naming
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import offpolicy.transforms  # noqa: F401 - registers the built-in transforms
from offpolicy.registry import CORRECTIONS, TRANSFORMS, BoundTransform, build_transform, nearest

__all__ = ["RECIPE_KEYS", "Recipe", "needs"]

RECIPE_KEYS = ("corrections", "objective", "aggregation", "transforms", "sync_check", "naming")


class Recipe(BaseModel):
    """A method as data (see the module docstring). Build with :meth:`load`; write with :meth:`dump`.

    Each transform's entry holds the parameters as given (:meth:`transform` fills in the defaults); which sections
    were given is :attr:`model_fields_set` (a host maps only those, and keeps its own default for the rest).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    corrections: list[str | dict[str, Any]] = Field(default_factory=list)
    objective: str | dict[str, Any] | None = None
    aggregation: str | None = None
    transforms: dict[str, dict[str, Any]] = Field(default_factory=dict)
    sync_check: Literal["error", "warn", "off"] | None = None
    naming: str | None = None

    @field_validator("corrections", mode="before")
    @classmethod
    def _corrections(cls, v: Any) -> Any:
        from offpolicy.registry import build_correction

        if v is None:
            return []
        if isinstance(v, (str, Mapping)):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"must be a list of correction specs, got {v!r}")
        for i, spec in enumerate(v):
            name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, Mapping) else None
            if isinstance(name, str) and name not in CORRECTIONS:
                raise ValueError(f"entry {i}: unknown correction {name!r}{nearest(name, CORRECTIONS.names())}; "
                                 f"registered: {', '.join(CORRECTIONS.names())}")
            try:
                build_correction(spec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"entry {i}: {err}") from None
        return [dict(s) if isinstance(s, Mapping) else s for s in v]

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: Any) -> Any:
        from offpolicy.losses import resolve_objective

        if v is not None:
            resolve_objective(v)
        return v

    @field_validator("aggregation")
    @classmethod
    def _aggregation(cls, v: str | None) -> str | None:
        from offpolicy.registry import AGGREGATIONS

        if v is not None and v not in AGGREGATIONS:
            raise ValueError(f"{v!r} is unknown{nearest(v, AGGREGATIONS.names())}; registered: "
                             f"{', '.join(AGGREGATIONS.names())}")
        return v

    @field_validator("transforms", mode="before")
    @classmethod
    def _transforms(cls, v: Any) -> Any:
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            raise ValueError(f"must be a mapping of transform names to their parameters, got {v!r}")
        out: dict[str, dict[str, Any]] = {}
        for name, params in v.items():
            if name not in TRANSFORMS:
                raise ValueError(f"unknown transform {name!r}{nearest(str(name), TRANSFORMS.names())}; registered: "
                                 f"{', '.join(TRANSFORMS.names())}")
            if params is True or params is None:
                params = {}
            if not isinstance(params, Mapping):
                raise ValueError(f"{name}: must be a mapping of its parameters (or true), got {params!r}")
            build_transform({"name": name, **params})  # every parameter and value checked here
            out[str(name)] = dict(params)
        return out

    @field_validator("sync_check", mode="before")
    @classmethod
    def _sync_check(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML's bare `off` reads as false

    @field_validator("naming")
    @classmethod
    def _naming(cls, v: str | None) -> str | None:
        from offpolicy.metrics import NAMINGS

        valid = (*NAMINGS, "offpolicy")
        if v is not None and v not in valid:
            raise ValueError(f"{v!r} is unknown{nearest(v, valid)}; one of {', '.join(valid)}")
        return v

    # -- loading and writing ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, source: Recipe | Mapping[str, Any] | str | Path, *, where: str = "recipe") -> Recipe:
        """A recipe from a :class:`Recipe` (returned as is), a mapping, YAML / JSON text, or a file path (``.yaml``,
        ``.yml``, ``.json``). Numbers are read as YAML 1.2 writes them (:mod:`offpolicy.yaml_numbers`). Any error
        is one ``ValueError`` line starting with ``where`` (the host and section: ``algorithm.recipe``) and naming
        the key; an unknown key names the nearest valid one."""
        if isinstance(source, Recipe):
            return source
        if isinstance(source, (str, Path)):
            source = _read(source, where)
        if not isinstance(source, Mapping):
            raise ValueError(f"{where}: must be a mapping with keys among {', '.join(RECIPE_KEYS)}, got "
                             f"{type(source).__name__}")
        for key in source:
            if key not in RECIPE_KEYS:
                raise ValueError(f"{where}: unknown key {key!r}{nearest(str(key), RECIPE_KEYS)}; valid: "
                                 f"{', '.join(RECIPE_KEYS)}")
        try:
            return cls.model_validate(dict(source))
        except ValidationError as err:
            first = err.errors()[0]
            path = ".".join(str(p) for p in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {path}: {message}") from None

    def to_dict(self) -> dict[str, Any]:
        """The sections that were given (or differ from the defaults), as plain data; ``Recipe.load`` of it is an
        equal recipe."""
        data = self.model_dump(mode="json")
        return {k: data[k] for k in RECIPE_KEYS if k in self.model_fields_set or data[k] != _DEFAULTS[k]}

    def dump(self, path: str | Path | None = None) -> str:
        """The recipe as YAML text; written to ``path`` too when one is given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    # -- what it builds ---------------------------------------------------------------------------------------
    def transform(self, name: str) -> BoundTransform | None:
        """Transform ``name`` with its defaults filled in (None: the recipe does not use it)."""
        if name not in self.transforms:
            return None
        return build_transform({"name": name, **self.transforms[name]})

    def bound_transforms(self) -> list[BoundTransform]:
        return [build_transform({"name": n, **p}) for n, p in self.transforms.items()]

    def correction_specs(self) -> list[Any]:
        """Every correction the recipe applies, as specs: those its transforms put first (DVP's and sampling
        replay's ``dvp_keep``, once), then :attr:`corrections`."""
        first: list[str] = []
        for t in self.bound_transforms():
            first.extend(c for c in t.entry.corrections if c not in first)
        return [{"name": c} for c in first] + list(self.corrections)

    def build_correction(self) -> Any:
        """The correction chain (:func:`offpolicy.build_correction` of :meth:`correction_specs`; None: nothing)."""
        from offpolicy.registry import build_correction

        return build_correction(self.correction_specs())

    def needs(self) -> dict[str, list[str]]:
        """:func:`needs` of this recipe."""
        return needs(self)


_DEFAULTS = Recipe().model_dump(mode="json")


def _read(source: str | Path, where: str) -> Any:
    from offpolicy.yaml_numbers import load_yaml, yaml_problem

    text = str(source)
    looks_like_file = isinstance(source, Path) or (
        "\n" not in text and not text.lstrip().startswith("{") and (
            text.endswith((".yaml", ".yml", ".json")) or Path(text).expanduser().is_file()))
    label = where
    if looks_like_file:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}: recipe file {text!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{where}: recipe file {str(path)!r} cannot be read: {err}") from None
        label = f"{where} ({path})"
    try:
        data = load_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{label}: not YAML / JSON: {yaml_problem(err)}") from None
    return {} if data is None else data


def needs(recipe: Recipe | Mapping[str, Any] | str | Path) -> dict[str, list[str]]:
    """What a recipe reads besides π_θ, for all three kinds of component: ``{need: [the methods that need it]}``,
    needs from :data:`offpolicy.registry.NEEDS`. Every correction and objective reads π_old; μ is read by the
    corrections and objectives :func:`offpolicy.needs_rollout_logp` names (the rest see μ = π_old where a host has
    no μ); each transform declares its own.

    >>> needs({"corrections": ["m2po"], "transforms": {"topk_bounds": {"k": 8}}})
    {'old_logp': ['m2po', 'objective'], 'rollout_logp': ['m2po'], 'engine_topk': ['topk_bounds']}
    """
    from offpolicy.losses import needs_rollout_logp
    from offpolicy.registry import split_spec

    recipe = Recipe.load(recipe)
    out: dict[str, list[str]] = {}

    def add(need: str, who: str) -> None:
        names = out.setdefault(need, [])
        if who not in names:
            names.append(who)

    correction = recipe.build_correction()
    for spec in recipe.corrections:
        add("old_logp", split_spec(spec, "correction")[0])
    add("old_logp", "objective")
    objective = split_spec(recipe.objective, "objective")[0] if recipe.objective is not None else "ppo"
    for name in needs_rollout_logp(correction, objective):
        add("rollout_logp", name)
    for t in recipe.bound_transforms():
        for need in t.needs:
            add(need, t.name)
    return out
