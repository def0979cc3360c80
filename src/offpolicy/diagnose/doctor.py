"""``offpolicy doctor``: check a recipe before a run — a vLLM server against the user's TRL or verl config — and
rewrite nothing (each check says what to change).

What each check reads:

* the server: ``GET /v1/models`` (the served model's id and ``root``, its local path), ``GET /version`` and, in vLLM's
  dev mode (``VLLM_SERVER_DEV_MODE=1``, which TRL's server mode needs anyway), ``GET /server_info?config_format=json``:
  the resolved ``VllmConfig`` (``model_config.logprobs_mode`` / ``dtype`` / ``hf_config`` / ``override_generation_config``,
  ``cache_config.enable_prefix_caching``, ``scheduler_config.async_scheduling``), the same answer TRL's
  ``VLLMClient.get_server_info`` reads. A setting the server does not report is read from the server's command line
  given as ``vllm_args`` (vLLM 0.32's defaults for a flag it does not name), or the check fails with "cannot tell";
* the trainer: a TRL ``GRPOConfig`` as a mapping of its fields (plus ``model_name_or_path`` and an ``offpolicy`` block
  with ``OffPolicyGRPOTrainer``'s keywords ``sync_check`` / ``sampling_replay`` / ``dvp_rho``), or verl's config
  (nested or dotted keys; the plug-in's settings are ``OFFPOLICY_VERL`` in ``ray_kwargs.ray_init.runtime_env.env_vars``).

Each check is a function returning a :class:`Check` ``(name, ok, detail, fix)``; :func:`run_checks` runs them all.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from offpolicy.integrations.versions import VERSIONS, installed_version
from offpolicy.resume_settings import flatten
from offpolicy.rollout.http import ServerError, post_json

FRAMEWORKS = ("trl", "verl")
# vLLM 0.32's defaults for what a command line may leave out (vllm/config/model.py, cache.py)
VLLM_DEFAULTS = {"logprobs-mode": "raw_logprobs", "dtype": "auto", "enable-prefix-caching": True}
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32"}
# what TRL / verl send with every request: a server default for any other sampling key changes μ unseen
_SENT = {"trl": {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"},
         "verl": {"temperature", "top_p", "top_k"}}
_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty")


class Check(NamedTuple):
    """One check's verdict: ``fix`` is empty when ``ok``."""

    name: str
    ok: bool
    detail: str
    fix: str


@dataclass
class ServerFacts:
    """What the server reported: ``info`` is ``/server_info``'s ``vllm_config`` (None outside dev mode), ``args`` the
    command line given for it (flag → value, ``--no-x`` → ``x: False``)."""

    url: str
    models: dict | None = None
    info: dict | None = None
    version: str | None = None
    args: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)

    def setting(self, path: str, flag: str) -> tuple[Any, str | None]:
        """``(value, where it was read)``; ``(None, None)`` when neither the server nor the command line says."""
        node: Any = self.info
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node, "the server"
        if self.args is not None:
            return self.args.get(flag, VLLM_DEFAULTS.get(flag)), "--vllm-args"
        return None, None


def parse_vllm_args(text: str) -> dict[str, Any]:
    """A vLLM command line as flag → value: ``--x v`` / ``--x=v`` → ``v``, a bare ``--x`` → True, ``--no-x`` → False;
    underscores read as dashes.

    >>> parse_vllm_args("vllm serve m --logprobs_mode=processed_logprobs --no-enable-prefix-caching --dtype bf16")
    {'logprobs-mode': 'processed_logprobs', 'enable-prefix-caching': False, 'dtype': 'bf16'}
    """
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise ValueError(f"vllm_args: cannot split {text!r}: {err}") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("_", "-")
        if eq:
            out[name] = value
        elif name.startswith("no-"):
            out[name[3:]] = False
        elif i < len(words) and not words[i].startswith("--"):
            out[name], i = words[i], i + 1
        else:
            out[name] = True
    return out


def read_server(url: str, *, vllm_args: str | None = None, timeout: float = 10.0) -> ServerFacts:
    """The server's answers (``/v1/models`` must answer; ``/version`` and ``/server_info`` may be missing)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server: give the base URL like 'http://127.0.0.1:8000', got {url!r}")
    url = url.rstrip("/")
    facts = ServerFacts(url, args=parse_vllm_args(vllm_args) if vllm_args is not None else None)
    facts.models = post_json(url + "/v1/models", None, timeout=timeout, what="GET /v1/models")
    for path, key in (("/version", "version"), ("/server_info?config_format=json", "vllm_config")):
        try:
            answer = post_json(url + path, None, timeout=timeout, what=f"GET {path}")
        except ServerError as err:
            facts.errors.append(str(err))
            continue
        if key == "version":
            facts.version = answer.get("version") if isinstance(answer, dict) else None
        elif isinstance(answer, dict) and isinstance(answer.get("vllm_config"), dict):
            facts.info = answer["vllm_config"]
    return facts


def load_config(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping, flattened to dotted keys (``a: {b: 1}`` and ``a.b: 1`` read the same; a mapping's
    leaves stay reachable one by one, ``generation_kwargs.top_k``, and :func:`subtree` gives it back whole)."""
    import yaml

    from offpolicy.yaml_numbers import load_yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ValueError(f"config: cannot read {str(p)!r}: {err.strerror or err}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else load_yaml(text)  # 1e-4 a float, as OmegaConf reads it
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"config: {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                         f"{str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config: {str(p)!r} must hold a mapping, got {type(data).__name__}")
    return flatten(data)


def subtree(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The mapping under ``key`` of a flattened config (one level of its keys)."""
    head = key + "."
    return {k[len(head):]: v for k, v in cfg.items() if k.startswith(head)}


# ---- facts about the trainer ------------------------------------------------------------------------------------


def _dtype(value: Any) -> str | None:
    """``torch.bfloat16`` / ``bf16`` / ``bfloat16`` → ``"bfloat16"``; None for ``auto`` or nothing."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.").lower()
    return _DTYPES.get(name)


def _model_config(path: Any) -> dict | None:
    """A local model folder's config.json (None when it is not a readable local folder)."""
    if not path:
        return None
    try:
        return json.loads((Path(str(path)).expanduser() / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _hf_config(facts: ServerFacts) -> tuple[dict | None, str]:
    """The served model's HF config: ``/server_info``'s ``hf_config`` (a dict, or its ``repr``: ``"XConfig {json}"``),
    else the config.json at ``/v1/models``' ``root`` when that is a folder on this machine."""
    node = (facts.info or {}).get("model_config", {}).get("hf_config")
    if isinstance(node, dict):
        return node, "the server's hf_config"
    if isinstance(node, str) and "{" in node:
        try:
            return json.loads(node[node.index("{"):]), "the server's hf_config"
        except json.JSONDecodeError:
            pass
    data = (facts.models or {}).get("data") or [{}]
    root = data[0].get("root") if isinstance(data[0], dict) else None
    cfg = _model_config(root)
    return (cfg, f"{root}/config.json") if cfg is not None else (None, "")


def _served_dtype(facts: ServerFacts) -> tuple[str | None, str | None]:
    value, where = facts.setting("model_config.dtype", "dtype")
    dtype = _dtype(value)
    if dtype is None and value is not None:  # "auto": the checkpoint's own dtype
        hf, _ = _hf_config(facts)
        dtype = _dtype((hf or {}).get("dtype") or (hf or {}).get("torch_dtype"))
    return dtype, where


def _trainer_model(cfg: Mapping[str, Any], framework: str) -> Any:
    return cfg.get("actor_rollout_ref.model.path") if framework == "verl" else cfg.get("model_name_or_path")


def _trainer_dtype(cfg: Mapping[str, Any], framework: str) -> str | None:
    """The dtype the trainer computes its log-probs in."""
    if framework == "verl":  # FSDP's compute dtype (model_dtype is the fp32 master copy)
        return _dtype(cfg.get("actor_rollout_ref.actor.fsdp_config.dtype", "bfloat16"))
    init = _dtype(cfg.get("model_init_kwargs.dtype", cfg.get("model_init_kwargs.torch_dtype")))
    if init is not None:
        return init
    if cfg.get("bf16"):
        return "bfloat16"
    if cfg.get("fp16"):
        return "float16"
    own = _model_config(_trainer_model(cfg, framework)) or {}
    return _dtype(own.get("dtype") or own.get("torch_dtype"))


def _plugin_settings(cfg: Mapping[str, Any]) -> Any:
    """verl: the plug-in's settings block (``OFFPOLICY_VERL``); ValueError naming a bad key."""
    from offpolicy.integrations.verl.settings import settings_from_text

    return settings_from_text(cfg.get("ray_kwargs.ray_init.runtime_env.env_vars.OFFPOLICY_VERL"))


def _fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, False, detail, fix)


def _unknown(name: str, what: str, flag: str) -> Check:
    return _fail(name, f"cannot tell {what} from the server (no /server_info: not in dev mode?)",
                 f"pass --vllm-args '... {flag} ...' (the server's command line) or start it with "
                 "VLLM_SERVER_DEV_MODE=1")


# ---- the checks ---------------------------------------------------------------------------------------------------


def check_logprobs_mode(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """μ must be the distribution sampled from: vLLM's processed log-probs (after temperature and truncation)."""
    name = "log-probs mode"
    mode, where = facts.setting("model_config.logprobs_mode", "logprobs-mode")
    if where is None:
        return _unknown(name, "the log-probs mode", "--logprobs-mode processed_logprobs")
    if mode != "processed_logprobs":
        return _fail(name, f"{mode} ({where}): μ would be the softmax before temperature and truncation",
                     "restart vLLM with --logprobs-mode processed_logprobs")
    return Check(name, True, f"processed_logprobs ({where})", "")


def _trl_recipe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's recipe: the named fields, overridden by ``generation_kwargs`` (as TRL sends them)."""
    defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0}
    recipe = {k: cfg.get(k, v) for k, v in defaults.items()}
    recipe.update(subtree(cfg, "generation_kwargs"))
    return recipe


def _truncating(recipe: Mapping[str, Any]) -> list[str]:
    """The recipe's keys that change the distribution beyond temperature."""
    off = {"top_k": (None, 0, -1), "top_p": (None, 1, 1.0), "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1),
           "frequency_penalty": (None, 0), "presence_penalty": (None, 0)}
    return [k for k, values in off.items() if recipe.get(k) not in values]


def check_sampling(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """The engine samples with the recipe the trainer scores with: temperature on both sides, and truncation /
    penalties only where the trainer replays them (TRL: ``sampling_replay`` / ``dvp_rho``; verl: the plug-in's
    ``sampling`` block); no server-side default for a key the framework does not send."""
    name = "sampling parameters"
    if framework == "trl":
        recipe = _trl_recipe(cfg)
        from offpolicy.integrations.trl.replay import UNREPLAYED_KEYS

        extra = sorted(k for k in subtree(cfg, "generation_kwargs") if k.split(".")[0] in UNREPLAYED_KEYS)
        if extra:
            return _fail(name, f"generation_kwargs.{extra[0]} changes the sampling distribution and no trainer "
                         "scores with it", f"remove generation_kwargs.{extra[0]}")
        replay = bool(cfg.get("offpolicy.sampling_replay")) or cfg.get("offpolicy.dvp_rho") is not None
        own_t = cfg.get("temperature", 1.0)
        if not replay and recipe["temperature"] is not None and float(recipe["temperature"]) != float(own_t):
            # TRL's trainer divides its logits by args.temperature; generation_kwargs reach only the engine
            return _fail(name, f"generation_kwargs.temperature={recipe['temperature']} reaches the engine, the "
                         f"trainer scores with temperature={own_t}", "set temperature in the GRPOConfig field only")
        cut = _truncating(recipe)
        if cut and not replay:
            return _fail(name, f"the engine samples with {', '.join(f'{k}={recipe[k]}' for k in cut)}; the trainer "
                         "scores with temperature only", "set offpolicy.sampling_replay: true (OffPolicyGRPOTrainer's "
                         f"sampling_replay=True) or turn {', '.join(cut)} off")
    else:
        recipe = {k: cfg.get(f"actor_rollout_ref.rollout.{k}") for k in ("temperature", "top_k", "top_p")}
        try:
            plugin = _plugin_settings(cfg).sampling
        except ValueError as err:
            return _fail(name, str(err), "fix the OFFPOLICY_VERL settings block")
        for key, engine_value in (("top_k", recipe["top_k"]), ("top_p", recipe["top_p"])):
            engine = float(engine_value) if key in _truncating({key: engine_value}) else None  # None: off
            replayed = getattr(plugin, key)
            if engine != (None if replayed is None else float(replayed)):
                return _fail(name, f"actor_rollout_ref.rollout.{key}={engine_value} but the plug-in's sampling."
                             f"{key} is {replayed}: the trainer scores on another support than the engine samples",
                             f"set sampling: {{{key}: {engine_value}}} in OFFPOLICY_VERL, or rollout.{key} off")
    served = (facts.info or {}).get("model_config", {}).get("override_generation_config") or {}
    if facts.info is None and facts.args is not None and facts.args.get("override-generation-config"):
        try:
            served = json.loads(str(facts.args["override-generation-config"]))
        except json.JSONDecodeError:
            served = {}
    unsent = sorted(k for k in served if k in _SAMPLING_KEYS and k not in _SENT[framework]
                    and not (framework == "trl" and k in subtree(cfg, "generation_kwargs")))
    if unsent:
        return _fail(name, f"the server's --override-generation-config sets {unsent[0]}={served[unsent[0]]}, which "
                     f"{framework} does not send: the engine samples with it, the trainer does not know it",
                     f"drop {unsent[0]} from --override-generation-config")
    shown = ", ".join(f"{k}={v}" for k, v in recipe.items() if v is not None)
    return Check(name, True, f"{shown}: the trainer scores with the engine's recipe", "")


def check_dtype(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """The served dtype is the trainer's compute dtype (else μ and π differ by the rounding of two formats)."""
    name = "dtype"
    served, where = _served_dtype(facts)
    if where is None:
        return _unknown(name, "the served dtype", "--dtype bfloat16")
    trainer = _trainer_dtype(cfg, framework)
    key = "actor_rollout_ref.actor.fsdp_config.dtype" if framework == "verl" else "model_init_kwargs.dtype / bf16"
    if served is None or trainer is None:
        return _fail(name, f"served {served or 'unknown'} ({where}), trainer {trainer or 'unknown'}",
                     f"state both: vLLM --dtype and the trainer's {key}")
    if framework == "verl":
        rollout = _dtype(cfg.get("actor_rollout_ref.rollout.dtype", "bfloat16"))
        if rollout != served:
            return _fail(name, f"served {served} ({where}) but actor_rollout_ref.rollout.dtype is {rollout}",
                         f"serve with --dtype {rollout}")
    if served != trainer:
        return _fail(name, f"served {served} ({where}), trainer computes in {trainer}",
                     f"serve with --dtype {trainer}, or set the trainer's {key} to {served}")
    return Check(name, True, f"{served} on both sides ({where})", "")


def check_head_dtype(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """The LM head's dtype: vLLM computes it in the served dtype; TRL's ``cast_lm_head_to_fp32`` makes the trainer's
    float32 (ScaleRL, arXiv 2510.13786), which the engine then does not match. A head in each side's model dtype
    is the dtype check's business, not repeated here."""
    name = "head dtype"
    served, where = _served_dtype(facts)
    if where is None:
        return _unknown(name, "the served dtype", "--dtype bfloat16")
    if not (framework == "trl" and cfg.get("cast_lm_head_to_fp32")):
        return Check(name, True, "the head runs in each side's model dtype (see dtype)", "")
    if served != "float32":
        return _fail(name, f"the engine's head runs in {served or 'an unknown dtype'} ({where}), the trainer's in "
                     "float32 (cast_lm_head_to_fp32)", "set cast_lm_head_to_fp32: false, or serve in float32")
    return Check(name, True, "float32 on both sides", "")


def check_tied_head(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """The served model ties its head to the embedding exactly when the trainer's does: an engine that untied it
    keeps its own head while the trainer updates (and syncs) only the shared matrix, or the reverse."""
    name = "tied head"
    served_cfg, source = _hf_config(facts)
    overrides = (facts.info or {}).get("model_config", {}).get("hf_overrides") or {}
    if facts.args is not None and facts.args.get("hf-overrides"):
        try:
            overrides = {**json.loads(str(facts.args["hf-overrides"])), **overrides}
        except json.JSONDecodeError:
            pass
    if isinstance(overrides, dict) and "tie_word_embeddings" in overrides:
        served, source = bool(overrides["tie_word_embeddings"]), "the server's --hf-overrides"
    elif served_cfg is not None:
        served = bool(served_cfg.get("tie_word_embeddings", True))  # transformers' default
    else:
        return _fail(name, "cannot tell whether the served model ties its head (no hf_config from the server and "
                     "/v1/models' root is not a folder here)", "start vLLM with VLLM_SERVER_DEV_MODE=1 or run "
                     "doctor where the served model folder is readable")
    own = _model_config(_trainer_model(cfg, framework))
    override = cfg.get("actor_rollout_ref.model.override_config.tie_word_embeddings") if framework == "verl" else None
    model_key = "actor_rollout_ref.model.path" if framework == "verl" else "model_name_or_path"
    if override is not None:
        trainer = bool(override)
    elif own is not None:
        trainer = bool(own.get("tie_word_embeddings", True))
    else:
        return _fail(name, f"cannot tell whether the trainer's model ties its head ({model_key} is not a local "
                     "model folder)", f"set {model_key} to the trainer's model folder")
    if served != trainer:
        return _fail(name, f"served tie_word_embeddings={served} ({source}), trainer's {trainer}: after a weight "
                     "sync the engine's head is not the trainer's", "serve the trainer's own checkpoint (same "
                     "tie_word_embeddings), or --hf-overrides '{\"tie_word_embeddings\": " + str(trainer).lower() + "}'")
    if trainer and framework == "trl" and cfg.get("cast_lm_head_to_fp32"):
        return _fail(name, "cast_lm_head_to_fp32 with a tied head (TRL supports it on untied heads only)",
                     "set cast_lm_head_to_fp32: false")
    return Check(name, True, f"tie_word_embeddings={served} on both sides ({source})", "")


def check_prefix_caching(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """Prefix caching changes μ when a prompt's cached KV outlives a weight sync (tokens sampled with old-weight keys
    and values): fine when the framework resets the cache at every sync (TRL: ``VLLMGeneration.sync_weights``;
    verl: its rollout server's weight update; this project's reload), stated per framework."""
    name = "prefix caching"
    on, where = facts.setting("cache_config.enable_prefix_caching", "enable-prefix-caching")
    if where is None:
        return _unknown(name, "prefix caching", "--enable-prefix-caching / --no-enable-prefix-caching")
    if not on:
        return Check(name, True, f"off ({where})", "")
    if framework == "verl" and cfg.get("actor_rollout_ref.rollout.enable_prefix_caching") is False:
        return _fail(name, f"on ({where}) but actor_rollout_ref.rollout.enable_prefix_caching is false",
                     "start vLLM with --no-enable-prefix-caching, as the config asks")
    return Check(name, True, f"on ({where}); {framework} resets the cache after every weight sync", "")


def check_async_scheduling(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """Async scheduling prepares the next step while the current one samples; with the weights fixed between syncs
    it samples the same distribution. Reported, and refused where the config asks for it off."""
    name = "async scheduling"
    on, where = facts.setting("scheduler_config.async_scheduling", "async-scheduling")
    if where is None:
        return _unknown(name, "async scheduling", "--async-scheduling / --no-async-scheduling")
    state = "on" if on else "off" if on is False else "vLLM's choice (not given)"
    if framework == "verl" and on and cfg.get("actor_rollout_ref.rollout.engine_kwargs.vllm.async_scheduling") is False:
        return _fail(name, f"{state} ({where}) but the config's rollout.engine_kwargs.vllm.async_scheduling is false",
                     "start vLLM with --no-async-scheduling, as the config asks")
    return Check(name, True, f"{state} ({where})", "")


def check_sync_check(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> Check:
    """The weight-sync check is on: TRL ``sync_check`` not None (default ``"error"``); verl the plug-in's
    ``sync_check`` not ``off``."""
    name = "sync check"
    if framework == "trl":
        if "offpolicy.sync_check" in cfg and cfg["offpolicy.sync_check"] in (None, "off"):
            return _fail(name, "offpolicy.sync_check is off: a sync that leaves the engine on other weights goes "
                         "unseen", "set offpolicy.sync_check: error (OffPolicyGRPOTrainer's default)")
        return Check(name, True, f"sync_check={cfg.get('offpolicy.sync_check', 'error')}", "")
    try:
        mode = _plugin_settings(cfg).sync_check
    except ValueError as err:
        return _fail(name, str(err), "fix the OFFPOLICY_VERL settings block")
    if mode == "off":
        return _fail(name, "OFFPOLICY_VERL has sync_check: off", "set sync_check: error in OFFPOLICY_VERL")
    return Check(name, True, f"sync_check={mode}", "")


def check_versions(facts: ServerFacts, cfg: Mapping[str, Any], framework: str,
                   installed: Mapping[str, str | None] | None = None) -> Check:
    """The framework installed here and the server's vLLM inside the tested ranges (:mod:`..integrations.versions`)."""
    name = "versions"
    have = dict(installed) if installed is not None else {framework: installed_version(framework)}
    version = have.get(framework)
    row = VERSIONS[framework]
    if version is None:
        return _fail(name, f"{framework} is not installed here", f"pip install 'offpolicy[{framework}]'")
    if not row.supports(version):
        return _fail(name, f"{framework} {version} is outside the tested range {row.range}",
                     f"pip install '{framework}{row.range}'")
    vllm_row = VERSIONS["vllm"]
    if facts.version is not None and not vllm_row.supports(facts.version):
        return _fail(name, f"the server runs vLLM {facts.version}, outside the tested range {vllm_row.range}",
                     f"serve with vllm{vllm_row.range}")
    served = f", server vLLM {facts.version}" if facts.version else ", server's vLLM version unknown (no /version)"
    return Check(name, True, f"{framework} {version}{served}", "")


CHECKS: tuple[Callable[[ServerFacts, Mapping[str, Any], str], Check], ...] = (
    check_logprobs_mode, check_sampling, check_dtype, check_head_dtype, check_tied_head, check_prefix_caching,
    check_async_scheduling, check_sync_check, check_versions,
)


def run_checks(facts: ServerFacts, cfg: Mapping[str, Any], framework: str) -> list[Check]:
    """Every check, in order (none stops the others)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    return [check(facts, cfg, framework) for check in CHECKS]

