"""``offpolicy inspect``: measure a model's training–inference mismatch down to the layer.

Components (one family per file): :mod:`~offpolicy.inspect.specs` (engine specs), :mod:`~offpolicy.inspect.compare`
(full-distribution comparison), :mod:`~offpolicy.inspect.layers` (per-layer localisation),
:mod:`~offpolicy.inspect.recommend` (thresholds re-applied with the corrections), :mod:`~offpolicy.inspect.report`
(report.json / PNGs / HTML), :mod:`~offpolicy.inspect.dump` (the per-token dump schema),
:mod:`~offpolicy.inspect.gate` (the CI gate); the recipe is :mod:`~offpolicy.inspect.run`.

>>> from offpolicy.inspect import parse_spec
>>> parse_spec("kv4", "rollout").describe()
'bfloat16 + KV cache + int4 KV cache'
"""

from offpolicy.inspect.compare import DVP_RHO_GRID, compare_engines
from offpolicy.inspect.dump import SCHEMA_VERSION, DumpError, read_dump, write_dump
from offpolicy.inspect.gate import check_bounds, parse_bounds
from offpolicy.inspect.layers import LAYER_THRESHOLD, first_divergent, hook_points, layer_errors, layer_shares
from offpolicy.inspect.measurements import DvpGrid, LayerError, Measurements, TokenData, VocabStats
from offpolicy.inspect.recommend import preset_effects, recommend
from offpolicy.inspect.report import markdown_table, write_report
from offpolicy.inspect.run import inspect_engines, load_model, task_prompts
from offpolicy.inspect.specs import ROLLOUT_SPECS, TRAINER_SPECS, build_inspect_engine, parse_spec
from offpolicy.inspect.summary import summarize
from offpolicy.inspect.vocabulary import vocabulary_stats
from offpolicy.rollout.spec import EngineSpec

__all__ = [
    "DVP_RHO_GRID",
    "LAYER_THRESHOLD",
    "ROLLOUT_SPECS",
    "SCHEMA_VERSION",
    "TRAINER_SPECS",
    "DumpError",
    "DvpGrid",
    "EngineSpec",
    "LayerError",
    "Measurements",
    "TokenData",
    "VocabStats",
    "build_inspect_engine",
    "check_bounds",
    "compare_engines",
    "first_divergent",
    "hook_points",
    "inspect_engines",
    "layer_errors",
    "layer_shares",
    "load_model",
    "markdown_table",
    "parse_bounds",
    "parse_spec",
    "preset_effects",
    "read_dump",
    "recommend",
    "summarize",
    "task_prompts",
    "vocabulary_stats",
    "write_dump",
    "write_report",
]
