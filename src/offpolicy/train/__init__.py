"""offpolicy.train: the reference GRPO trainer — config, presets, the loop, checkpoints, logging.

>>> from offpolicy.train import load_config, PRESETS
>>> load_config(None, ["algorithm.preset=icepop"]).algorithm.preset in PRESETS
True
"""

from offpolicy.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from offpolicy.train.config import TrainConfig, config_to_yaml, load_config
from offpolicy.train.presets import PRESETS, Preset, list_presets


def train(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - thin lazy wrapper, see offpolicy.train.loop.train
    """Run the GRPO loop (:func:`offpolicy.train.loop.train`); imported lazily so ``import offpolicy.train`` stays light."""
    from offpolicy.train.loop import train as _train

    return _train(*args, **kwargs)


__all__ = [
    "PRESETS",
    "Preset",
    "TrainConfig",
    "config_to_yaml",
    "latest_checkpoint",
    "list_presets",
    "load_checkpoint",
    "load_config",
    "save_checkpoint",
    "train",
]
