"""A run's config settled once, before anything heavy is imported: what ``dflash train`` does with its
flags before it takes the run's lock, and what :class:`dflash.train.trainer.Trainer` takes.

Settling fills the drafter's shape by its rule (:func:`dflash.run.drafter_shape.resolve_drafter_shape`:
the target's ``config.json``, or the ``--init-from`` drafter's) and checks every argument and input file
(:func:`dflash.run.preflight.validate_inputs`, which on ``--resume`` also compares the flags with the
run's ``train_config.json``). Everything it imports is free of torch and transformers, except the last
checks, which ask torch which devices this host has.
"""

from __future__ import annotations

from dflash.config import TrainConfig
from dflash.run.drafter_shape import resolve_drafter_shape
from dflash.run.preflight import validate_inputs


def settle(config: TrainConfig) -> TrainConfig:
    """``config`` with the drafter's shape resolved, every input checked: the config the run trains with.

    Raises:
        ValueError (incl. DatasetError, TargetLoadError, CheckpointError, DeviceSpecError): the first
            problem found, naming the flag or file and the fix.
    """
    config = resolve_drafter_shape(config)  # the rule's block size, layers, taps: before any check reads them
    validate_inputs(config)
    return config
