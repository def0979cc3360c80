"""``OffPolicyGRPOTrainer``: TRL's ``GRPOTrainer`` with :class:`~offpolicy.integrations.trl.mixin.OffPolicyGRPOMixin`
in front of it. This module imports TRL; ``offpolicy.integrations.trl.OffPolicyGRPOTrainer`` imports it on first
access, so importing the package never imports TRL.
"""

from __future__ import annotations

try:
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("OffPolicyGRPOTrainer needs TRL: pip install 'offpolicy[trl]'") from err

from offpolicy.integrations.trl.mixin import OffPolicyGRPOMixin

__all__ = ["OffPolicyGRPOTrainer"]


# TRL 1.16 leaves _entropy_window_stats unannotated (mypy reads None); the mixin's is the tensor TRL stores there
class OffPolicyGRPOTrainer(OffPolicyGRPOMixin, GRPOTrainer):  # type: ignore[misc]
    __doc__ = OffPolicyGRPOMixin.__doc__
