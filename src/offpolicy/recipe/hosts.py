"""How each host reads a :class:`~offpolicy.recipe.Recipe`: what it supplies, which transforms it computes, and the
one table of the old spellings (:data:`OLD_SPELLINGS`) — each host's own setting, the recipe path it is, its default
and how a recipe's value is written in it.

The hosts map a recipe onto their existing settings through this table and nothing else: the reference trainer's
config (:func:`trainer_tree`, for ``algorithm.recipe``), ``OffPolicyGRPOTrainer``'s keywords (:func:`trl_keywords`,
for ``recipe=``) and verl's ``OFFPOLICY_VERL`` block (:func:`verl_block`, for ``recipe:`` or a block that is itself a
recipe). An old setting given with a recipe that says otherwise is refused in one line naming both.

>>> from offpolicy.recipe import Recipe
>>> r = Recipe.load({"corrections": ["tis"], "transforms": {"dvp": {"rho": 1e-4}}, "sync_check": "warn"})
>>> trl_keywords(r, {})["dvp_rho"], verl_block({"recipe": r.to_dict()})["sampling"]
(0.0001, {'min_p': 0.0001})
>>> trl_keywords(r, {"dvp_rho": 0.01})
Traceback (most recent call last):
...
ValueError: OffPolicyGRPOTrainer: recipe=... sets transforms.dvp.rho to 0.0001 but dvp_rho=0.01 says otherwise; give it once
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from offpolicy.recipe.schema import RECIPE_KEYS, Recipe, needs
from offpolicy.registry import NEEDS
from offpolicy.transforms import fetch_plan

__all__ = ["HOSTS", "OLD_SPELLINGS", "Host", "OldSpelling", "check_host", "trainer_tree", "trl_keywords",
           "verl_block"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # the recipe leaves this setting to the host
CLIP_KEYS = ("clip_low", "clip_high", "dual_clip")


@dataclass(frozen=True)
class Host:
    """A host: its name in messages, what it can supply (keys of :data:`offpolicy.registry.NEEDS`) and the
    built-in transforms it computes; ``plugins``: whether it runs a plug-in transform's ``apply`` on the batch."""

    label: str
    supplies: frozenset[str]
    transforms: frozenset[str]
    plugins: bool = False


HOSTS: dict[str, Host] = {
    "trainer": Host("the reference trainer", frozenset(NEEDS),
                    frozenset({"dvp", "sampling_replay", "score_centering", "proximal", "alp", "exact_kl"}), plugins=True),
    # μ only from vLLM or a rollout_func, the top-K only from vLLM (the trainer adds them when it has them)
    "trl": Host("OffPolicyGRPOTrainer", frozenset({"old_logp", "sampling_recipe", "hidden_states"}),
                frozenset({"dvp", "sampling_replay", "score_centering", "proximal", "alp", "topk_bounds"}),
                plugins=True),
    "verl": Host("OFFPOLICY_VERL", frozenset({"rollout_logp", "old_logp", "engine_topk", "sampling_recipe",
                                              "hidden_states"}),
                 frozenset({"dvp", "sampling_replay", "score_centering", "proximal", "alp", "topk_bounds"}),
                 plugins=True),
}


def check_host(recipe: Recipe, host: str, supplies: frozenset[str] | set[str] | None = None) -> None:
    """Refuse, in one line, a recipe whose transform ``host`` does not compute or whose need it cannot supply
    (``supplies``: what it has in this run, default its declared set)."""
    h = HOSTS[host]
    have = h.supplies if supplies is None else frozenset(supplies)
    for t in recipe.bound_transforms():
        if t.entry.apply is not None and not h.plugins:
            raise ValueError(f"{h.label}: recipe transform {t.name!r} is a plug-in's; this host runs no plug-in "
                             "transforms")
        if t.entry.apply is None and t.name not in h.transforms:
            raise ValueError(f"{h.label}: recipe transform {t.name!r} is not computed by this host (it computes "
                             f"{', '.join(sorted(h.transforms))})")
    for need, who in needs(recipe).items():
        if need not in have:
            raise ValueError(f"{h.label}: {need} ({NEEDS[need]}), which {', '.join(who)} needs, cannot be supplied "
                             "by this host in this run")


# -- the recipe's values, as the hosts' settings spell them ---------------------------------------------------------


def _given(r: Recipe, section: str) -> bool:
    return section in r.model_fields_set


def _param(r: Recipe, transform: str, key: str, absent: Any) -> Any:
    """A transform's parameter (defaults filled in); ``absent`` when the recipe's transforms leave it out, MISSING
    when it gives no transforms."""
    t = r.transform(transform)
    if t is not None:
        return t.params[key]
    return absent if _given(r, "transforms") else MISSING


def _objective(r: Recipe, strip: bool) -> Any:
    if not _given(r, "objective"):
        return MISSING
    if not strip or not isinstance(r.objective, Mapping):
        return r.objective
    spec = {k: v for k, v in r.objective.items() if k not in CLIP_KEYS}
    return spec["name"] if len(spec) == 1 else spec


def _objective_param(r: Recipe, key: str) -> Any:
    if not _given(r, "objective"):
        return MISSING
    return r.objective.get(key) if isinstance(r.objective, Mapping) else None


def _section(r: Recipe, name: str, off: Any = MISSING) -> Any:
    if not _given(r, name):
        return MISSING
    value = getattr(r, name)
    return off if name == "sync_check" and value == "off" and off is not MISSING else value


def _topk(r: Recipe) -> Any:
    """The K log-probs per token the engine reports: what the transforms' needs ask for (engine_topk)."""
    if not _given(r, "transforms"):
        return MISSING
    try:
        return fetch_plan(r.bound_transforms()).topk
    except ValueError as err:
        raise ValueError(f"recipe: {err}") from None


def _present(r: Recipe, transform: str, yes: Any = True, no: Any = False) -> Any:
    if transform in r.transforms:
        return yes
    return no if _given(r, "transforms") else MISSING


def _alp_params(r: Recipe, keys: tuple[str, ...]) -> Any:
    if "alp" not in r.transforms:
        return None if _given(r, "transforms") else MISSING
    return {k: v for k, v in r.transforms["alp"].items() if k in keys}


def _alp_true(value: Any) -> Any:
    return {} if value is True else value  # alp=True is ALP with its defaults


def _sampling(r: Recipe) -> Any:
    """verl's ``sampling`` block: DVP's ρ as ``min_p``, or sampling replay's truncation."""
    if not _given(r, "transforms"):
        return MISSING
    out: dict[str, Any] = {}
    dvp = r.transform("dvp")
    replay = r.transform("sampling_replay")
    if dvp is not None:
        out["min_p"] = dvp.params["rho"]
    if replay is not None:
        out.update({k: v for k, v in replay.params.items() if v is not None})
    return out


def _replay_value(r: Recipe, key: str) -> Any:
    value = _param(r, "sampling_replay", key, MISSING)
    return MISSING if value is None else value


def _plugins(r: Recipe) -> Any:
    specs = [{"name": t.name, **t.params} for t in r.bound_transforms() if t.entry.apply is not None]
    return specs or MISSING


def _describes_method(r: Recipe) -> bool:
    return bool({"corrections", "objective", "transforms"} & r.model_fields_set)


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[Recipe], Any]:
    """``recipe -> fn(recipe, *args)``: one row's getter."""
    return lambda r: fn(r, *args)


def _alp_clip(r: Recipe, key: str) -> Any:
    return _objective_param(r, key) if "alp" in r.transforms else MISSING


@dataclass(frozen=True)
class OldSpelling:
    """One host's setting: ``key`` (dotted for a nested one), the recipe's ``path`` for it, the host's ``default``,
    ``get(recipe)`` its value for a recipe (MISSING: the recipe leaves it to the host) and ``norm`` what a user's
    value means (``alp=True`` is ``{}``)."""

    host: str
    key: str
    path: str
    default: Any
    get: Callable[[Recipe], Any]
    norm: Callable[[Any], Any] = lambda v: v


OLD_SPELLINGS: tuple[OldSpelling, ...] = (
    # OffPolicyGRPOTrainer's keywords
    OldSpelling("trl", "correction", "corrections", None,
                lambda r: (list(r.corrections) or None) if _given(r, "corrections") else MISSING),
    OldSpelling("trl", "objective", "objective", None,  # under ALP its unified-ratio loss replaces the objective
                lambda r: MISSING if "alp" in r.transforms else _objective(r, strip=True)),
    *(OldSpelling("trl", k, f"objective.{k}", None, _bind(_objective_param, k)) for k in CLIP_KEYS),
    OldSpelling("trl", "aggregation", "aggregation", None, lambda r: _section(r, "aggregation")),
    OldSpelling("trl", "metric_naming", "naming", "trl", lambda r: _section(r, "naming")),
    OldSpelling("trl", "sampling_replay", "transforms.sampling_replay", False,
                lambda r: _present(r, "sampling_replay")),
    OldSpelling("trl", "dvp_rho", "transforms.dvp.rho", None, lambda r: _param(r, "dvp", "rho", None)),
    OldSpelling("trl", "alp", "transforms.alp", None,
                lambda r: _alp_params(r, ("init_std", "lr", "layers", "layers_path", "seed", "level")),
                norm=_alp_true),
    OldSpelling("trl", "topk_logprobs", "transforms.topk_bounds.k (or score_centering.k)", 0, _topk),
    OldSpelling("trl", "topk_bound", "transforms.topk_bounds.bound", "upper",
                lambda r: _param(r, "topk_bounds", "bound", "upper")),
    OldSpelling("trl", "score_centering", "transforms.score_centering", False,
                lambda r: _present(r, "score_centering")),
    OldSpelling("trl", "sync_check", "sync_check", "error", lambda r: _section(r, "sync_check", off=None),
                norm=lambda v: None if v == "off" else v),
    # verl's OFFPOLICY_VERL block
    OldSpelling("verl", "correction", "corrections", None,
                lambda r: (list(r.corrections) or None) if _given(r, "corrections") else MISSING),
    OldSpelling("verl", "sampling", "transforms.dvp.rho (min_p) / transforms.sampling_replay", {}, _sampling),
    OldSpelling("verl", "alp", "transforms.alp", None,
                lambda r: _alp_params(r, ("init_std", "lr", "layers", "seed")), norm=_alp_true),
    OldSpelling("verl", "topk_logprobs", "transforms.topk_bounds.k (or score_centering.k)", 0, _topk),
    OldSpelling("verl", "topk_bound", "transforms.topk_bounds.bound", "upper",
                lambda r: _param(r, "topk_bounds", "bound", "upper")),
    OldSpelling("verl", "score_centering", "transforms.score_centering", False,
                lambda r: _present(r, "score_centering")),
    OldSpelling("verl", "plugin_transforms", "transforms (a plug-in's, with apply)", (), lambda r: _plugins(r),
                norm=lambda v: [dict(s) for s in v or ()]),
    OldSpelling("verl", "naming", "naming", "verl", lambda r: _section(r, "naming")),
    OldSpelling("verl", "sync_check", "sync_check", "error", lambda r: _section(r, "sync_check"),
                norm=lambda v: "off" if v is False else v),
    # the reference trainer's config (algorithm.preset is chosen by the transforms: trainer_preset)
    OldSpelling("trainer", "algorithm.preset", "transforms (the preset that computes them)", "naive",
                lambda r: trainer_preset(r) if _describes_method(r) else MISSING),
    OldSpelling("trainer", "algorithm.corrections", "corrections", None,
                lambda r: list(r.corrections) if _describes_method(r) else MISSING),
    OldSpelling("trainer", "algorithm.objective", "objective", None,
                lambda r: MISSING if "alp" in r.transforms else _objective(r, strip=False)),
    *(OldSpelling("trainer", f"algorithm.{k}", f"objective.{k} (with transforms.alp)", None,
                  _bind(_alp_clip, k)) for k in CLIP_KEYS),
    OldSpelling("trainer", "algorithm.aggregation", "aggregation", "token_mean", lambda r: _section(r, "aggregation")),
    OldSpelling("trainer", "algorithm.dvp_rho", "transforms.dvp.rho", math.exp(-13),
                lambda r: _param(r, "dvp", "rho", MISSING)),
    OldSpelling("trainer", "algorithm.dvp_coverage", "transforms.dvp.coverage", None,
                lambda r: _param(r, "dvp", "coverage", MISSING)),
    OldSpelling("trainer", "algorithm.proximal", "transforms.proximal.method", None,
                lambda r: _param(r, "proximal", "method", MISSING)),
    OldSpelling("trainer", "alp.enabled", "transforms.alp", False, lambda r: _present(r, "alp")),
    *(OldSpelling("trainer", f"alp.{k}", f"transforms.alp.{k}", default,
                  _bind(_param, "alp", k, MISSING))
      for k, default in (("init_std", 1e-4), ("lr", 5e-4), ("layers", "all"), ("level", "token"))),
    OldSpelling("trainer", "model.layers_path", "transforms.alp.layers_path", None,
                lambda r: _param(r, "alp", "layers_path", MISSING)),
    *(OldSpelling("trainer", f"rollout.sampling.{k}", f"transforms.sampling_replay.{k}", default,
                  _bind(_replay_value, k)) for k, default in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))),
    OldSpelling("trainer", "algorithm.transforms", "transforms (a plug-in's, with apply)", None, lambda r: _plugins(r)),
    OldSpelling("trainer", "rollout.sync_check", "sync_check", "auto", lambda r: _section(r, "sync_check")),
    OldSpelling("trainer", "run.metric_naming", "naming", "swift", lambda r: _section(r, "naming")),
)


def rows(host: str) -> tuple[OldSpelling, ...]:
    return tuple(row for row in OLD_SPELLINGS if row.host == host)


def _merge(host: str, recipe: Recipe, given: Mapping[str, Any], where: str, *, keywords: bool = False) -> dict[str, Any]:
    """``given`` (the host's settings as the user wrote them) with the recipe's values; a setting given that the
    recipe says otherwise is refused (``keywords``: ``given`` holds every keyword, and one at its default counts as
    not given)."""
    out = dict(given)
    for row in rows(host):
        value = row.get(recipe)
        if value is MISSING:
            continue
        if row.key in given:
            old = given[row.key]
            if not (keywords and old == row.default) and row.norm(old) != row.norm(value):
                raise ValueError(f"{where} sets {row.path} to {value!r} but {row.key}={old!r} says otherwise; "
                                 "give it once")
        out[row.key] = value
    return out


# -- the three hosts --------------------------------------------------------------------------------------------------


def trl_keywords(recipe: Recipe | Mapping[str, Any] | str, given: Mapping[str, Any]) -> dict[str, Any]:
    """``OffPolicyGRPOTrainer``'s keywords for ``recipe``: ``given`` (the keywords passed) with the recipe's values
    (:data:`OLD_SPELLINGS`); what TRL does not compute is refused in one line."""
    where = "OffPolicyGRPOTrainer: recipe=..."
    recipe = Recipe.load(recipe, where="OffPolicyGRPOTrainer: recipe")
    check_host(recipe, "trl", HOSTS["trl"].supplies | {"rollout_logp", "engine_topk"})  # μ, top-K: checked later
    _refuse_params(recipe, "OffPolicyGRPOTrainer", {
        "score_centering": {"source": ("topk",), "weighting": (None,)},
        "sampling_replay": {"top_k": (None,), "top_p": (None,), "min_p": (None,)},
    }, hint={"sampling_replay": "TRL replays its GRPOConfig's top_k / top_p / min_p: set them there",
             "score_centering": "TRL centres on vLLM's top-K without a weighting"})
    _alp_objective(recipe, "OffPolicyGRPOTrainer: recipe")
    return _merge("trl", recipe, given, where, keywords=True)


def _alp_objective(recipe: Recipe, where: str) -> None:
    """With ALP the loss is its unified ratio π_{θ,σ}/μ (the bypass objective); only its clip range may be set."""
    if "alp" in recipe.transforms and _objective(recipe, strip=True) not in (MISSING, None, "bypass"):
        raise ValueError(f"{where}: transforms.alp is ALP's unified ratio π_{{θ,σ}}/μ, the bypass objective; the "
                         f"recipe's objective is {recipe.objective!r}")


def verl_block(block: Mapping[str, Any]) -> dict[str, Any]:
    """The ``OFFPOLICY_VERL`` block with its recipe mapped in: a ``recipe:`` key (a path or inline), or a block
    that is itself a recipe (its keys among the recipe's, plus ``allow_changed``). A block without either is
    returned unchanged."""
    block = dict(block)
    where = "OFFPOLICY_VERL: recipe"
    own_only = {"corrections", "objective", "aggregation", "transforms"}
    if "recipe" in block:
        source = block.pop("recipe")
    elif own_only & set(block):
        recipe_keys = [k for k in block if k in RECIPE_KEYS]
        others = [k for k in block if k not in RECIPE_KEYS and k != "allow_changed"]
        if others:
            raise ValueError(f"OFFPOLICY_VERL: the block is a recipe ({', '.join(recipe_keys)}) but also has "
                             f"{others[0]!r}; write the method once, as a recipe "
                             "or as the block's own keys")
        source = {k: block.pop(k) for k in recipe_keys}
        where = "OFFPOLICY_VERL"
    else:
        return block
    recipe = Recipe.load(source, where=where)
    check_host(recipe, "verl")
    if _given(recipe, "objective") or _given(recipe, "aggregation"):
        raise ValueError(f"{where}: objective / aggregation are verl's own (actor_rollout_ref.actor.policy_loss, "
                         "loss_agg_mode); the plug-in reads the corrections and transforms")
    _refuse_params(recipe, "OFFPOLICY_VERL", {
        "score_centering": {"source": ("topk",), "weighting": (None,)},
        "alp": {"level": ("token",), "layers_path": (None,)},
        "proximal": {"method": ("recompute",)},
    }, hint={"score_centering": "the plug-in centres on the engine's top-K without a weighting",
             "alp": "the plug-in's ALP is token-level on verl's auto-detected decoder layers",
             "proximal": "π_old is verl's own recomputed forward"})
    return _merge("verl", recipe, block, where)


def trainer_preset(recipe: Recipe) -> str:
    """The reference trainer's preset that computes the recipe's transforms (its corrections and objective go into
    ``algorithm.corrections`` / ``algorithm.objective``): one of DVP, ALP, score centering and the exact KL, or ALP
    with the plain score centering (the centre from the same noisy forward)."""
    t = recipe.transforms
    chosen = [name for name in ("dvp", "alp", "score_centering", "exact_kl") if name in t]
    centring = recipe.transform("score_centering")
    if chosen == ["alp", "score_centering"]:
        assert centring is not None
        if centring.params["weighting"] is not None:
            raise ValueError(f"algorithm.recipe: transforms.score_centering.weighting="
                             f"{centring.params['weighting']!r} with alp: the reference trainer combines ALP with the "
                             "plain centring only (weighting: null)")
        return f"alp_{_centring_preset(centring)}"
    if len(chosen) > 1:
        raise ValueError(f"algorithm.recipe: the reference trainer combines at most one of dvp, alp, "
                         f"score_centering and exact_kl, or alp with score_centering; the recipe has "
                         f"{', '.join(chosen)} (each is a preset of its own and a run has one preset)")
    if not chosen:
        return "naive"
    name = chosen[0]
    if name in ("dvp", "alp"):
        return name
    if name == "exact_kl":
        return "trm"
    assert centring is not None
    return _centring_preset(centring)


def _centring_preset(c: Any) -> str:
    """The score-centering preset of the bound transform ``c``."""
    if c.params["source"] == "exact":
        return "score_centering"
    if c.params["k"] != 20:
        raise ValueError(f"algorithm.recipe: transforms.score_centering.k={c.params['k']}: the reference trainer's "
                         "sampler head is its top-20")
    return {None: "score_centering_topk"}.get(c.params["weighting"], f"score_centering_{c.params['weighting']}")


def trainer_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer config's raw tree with ``algorithm.recipe`` mapped into the sections (and removed): a key the
    config also sets to another value is refused, naming both."""
    algorithm = tree.get("algorithm")
    if not isinstance(algorithm, Mapping) or algorithm.get("recipe") is None:
        return dict(tree)
    where = "algorithm.recipe"
    source = algorithm["recipe"]
    if isinstance(source, str) and "\n" not in source and not source.lstrip().startswith("{"):
        from pathlib import Path

        from offpolicy.recipe.named import NAMED_RECIPES, named_recipe

        if source in NAMED_RECIPES and not Path(source).exists():
            source = named_recipe(source)
    recipe = Recipe.load(source, where=where)
    check_host(recipe, "trainer")
    _refuse_params(recipe, "algorithm.recipe", {"alp": {"seed": (None,)}},
                   hint={"alp": "the reference trainer draws ALP's noise from run.seed"})
    _alp_objective(recipe, where)
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in tree.items()}
    out["algorithm"] = {k: v for k, v in algorithm.items() if k != "recipe"}
    flat = _flatten(out)
    merged = _merge("trainer", recipe, flat, where)
    for key, value in merged.items():
        _set(out, key, value)
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path.count(".") < 2 and key not in ("objective", "recipe"):
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = tree
    for part in parents:
        child = node.get(part)
        child = dict(child) if isinstance(child, Mapping) else {}  # a copy: the user's tree stays as written
        node[part] = child
        node = child
    node[last] = value


def _refuse_params(recipe: Recipe, where: str, allowed: Mapping[str, Mapping[str, tuple[Any, ...]]],
                   hint: Mapping[str, str]) -> None:
    for name, keys in allowed.items():
        t = recipe.transform(name)
        if t is None:
            continue
        for key, values in keys.items():
            if t.params[key] not in values:
                raise ValueError(f"{where}: transforms.{name}.{key}={t.params[key]!r} is not supported here "
                                 f"({hint[name]})")
