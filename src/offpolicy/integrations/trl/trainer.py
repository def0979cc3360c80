"""``make_offpolicy_grpo_trainer``: the factory ``OffPolicyGRPOTrainer`` was once built by, kept as a deprecated alias.

``OffPolicyGRPOTrainer`` is a module-level class now (:mod:`offpolicy.integrations.trl.grpo`), made of
:class:`~offpolicy.integrations.trl.mixin.OffPolicyGRPOMixin` in front of TRL's ``GRPOTrainer``.
"""

from __future__ import annotations

import warnings

from offpolicy.integrations.trl.mixin import OffPolicyGRPOMixin

__all__ = ["OffPolicyGRPOMixin", "make_offpolicy_grpo_trainer"]


def make_offpolicy_grpo_trainer(base: type | None = None) -> type:
    """Deprecated: ``OffPolicyGRPOTrainer`` (``base`` None) or ``OffPolicyGRPOMixin`` composed in front of ``base``.

    Write ``from offpolicy.integrations.trl import OffPolicyGRPOTrainer``, or for one's own ``GRPOTrainer`` subclass
    ``class Mine(OffPolicyGRPOMixin, MyGRPOTrainer): ...``. ``base`` must provide TRL's
    ``_get_per_token_logps_and_entropies`` and ``_metrics``.
    """
    warnings.warn("make_offpolicy_grpo_trainer is deprecated: import OffPolicyGRPOTrainer from "
                  "offpolicy.integrations.trl, or compose OffPolicyGRPOMixin with your GRPOTrainer subclass",
                  DeprecationWarning, stacklevel=2)
    if base is None:
        from offpolicy.integrations.trl.grpo import OffPolicyGRPOTrainer

        return OffPolicyGRPOTrainer
    return type("OffPolicyGRPOTrainer", (OffPolicyGRPOMixin, base),
                {"__module__": __name__, "__doc__": OffPolicyGRPOMixin.__doc__})
