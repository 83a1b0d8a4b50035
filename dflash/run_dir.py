"""A run directory (``dflash train --out``): the names of what a run writes there.

A run writes ``train_config.json`` (:data:`dflash.config.SAVED_CONFIG_NAME`), ``checkpoints/``,
``tensorboard/``, ``metrics.jsonl``, its lock (:mod:`dflash.run_lock`), the regenerated replies with
their key and journals, and the token cache.
"""

from __future__ import annotations

CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
#: One JSON object per logged step (rank 0), beside the tensorboard logs.
METRICS_NAME = "metrics.jsonl"
#: The target-regenerated corpus; its key (``.key.json``) and journals (``.partial``) start with this name.
REGENERATED_NAME = "regenerated_train.jsonl"
#: The token cache (:mod:`dflash.token_cache`).
TOKENS_DIR = "tokenized"
