"""verl integration: a policy loss for verl's registry, driver-side corrections, and (with verl installed) the
plug-in — engine subclass (DVP / sampling replay, ALP), agent loop (min-p, top-K) and trainer — that a verl user
switches on by naming :mod:`offpolicy.integrations.verl.plugin` in ``actor_rollout_ref.model.external_lib``.

Importing this package does not import verl; the plug-in module does. See docs/frameworks/verl.md.
"""

from offpolicy.integrations.verl.driver import apply_driver_correction
from offpolicy.integrations.verl.loss import (
    NEWEST_VERL_RULES,
    VERL_AGGREGATIONS,
    VERL_PARAMETERS,
    register_verl_policy_loss,
    rollout_correction,
    rollout_log_probs_in_loss,
    verl_objective,
    verl_policy_loss_fn,
)
from offpolicy.integrations.verl.settings import VerlSettings, parse_settings
from offpolicy.integrations.verl.topk import sequence_topk

__all__ = [
    "NEWEST_VERL_RULES",
    "VERL_AGGREGATIONS",
    "VERL_PARAMETERS",
    "VerlSettings",
    "apply_driver_correction",
    "parse_settings",
    "register_verl_policy_loss",
    "rollout_correction",
    "rollout_log_probs_in_loss",
    "sequence_topk",
    "verl_objective",
    "verl_policy_loss_fn",
]
