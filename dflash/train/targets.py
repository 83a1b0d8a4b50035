"""A run's frozen targets, one replica per target device, in the precision the run asks for: bf16
on a GPU and float32 on the CPU (:func:`dflash.devices.compute_dtype`), or with ``--target-dtype fp8``
their linear layers as FP8 matmuls (:mod:`dflash.target_model.fp8`); with ``--compile`` (and
``--compile-target``) their per-token work runs as compiled regions (:mod:`dflash.target_model.compiled`).
Everything the run asks of a target, the regenerated replies and held-out acceptance included, is
asked of these.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash.config import TrainConfig
from dflash.devices import Slot
from dflash.target_model.model import Target, load_target

logger = logging.getLogger(__name__)


def load_targets(config: TrainConfig, target_dir: Path, slots: tuple[Slot, ...], *, compiled: bool) -> list[Target]:
    """One target per slot of ``slots`` (the first picks the tapped layers, the rest take its).

    Args:
        config (TrainConfig): ``target_layer_ids``, ``num_target_layers``, ``random_target_weights``,
            ``target_dtype``, ``compile_target``.
        compiled (bool): the run compiles (``--compile``, resolved for the device).

    Raises:
        TargetLoadError: a target that cannot be loaded (names the path and the fix).
    """
    first, *others = slots
    targets = [
        load_target(
            target_dir,
            layer_ids=config.target_layer_ids,
            num_capture_layers=config.num_target_layers,
            device=first.device,
            random_missing=config.random_target_weights,
        )
    ]
    targets += [
        load_target(
            target_dir, layer_ids=targets[0].layer_ids, device=s.device, random_missing=config.random_target_weights
        )
        for s in others
    ]
    if config.target_dtype == "fp8":
        _to_fp8(targets)
    if compiled and config.compile_target:
        for index, target in enumerate(targets):
            target.compile_regions(index)
    elif config.target_dtype == "fp8":
        logger.warning(
            "--target-dtype fp8 with the target eager (%s): each activation is quantized in separate kernels, "
            "and the FP8 forward runs at about 0.9x bf16's; compile the target for 1.3-1.7x",
            "--no-compile-target" if compiled else f"--compile {config.compile}",
        )
    return targets


def _to_fp8(targets: list[Target]) -> None:
    """Every target replica's linear layers to FP8 (:mod:`dflash.target_model.fp8`), logged; a warning when
    FP8 covers under half of the decoder's weights (an MoE target's experts are no ``nn.Linear``)."""
    from dflash.target_model.fp8 import quantize_target

    for target in targets:
        report = quantize_target(target.model)
    logger.info(
        "target: %d linear layers per replica run FP8 matmuls (e4m3, row-wise dynamic scales, torchao), %.0f%% of "
        "the decoder's weights; %d linear layers (the LM head, any with a dimension not a multiple of 16 or an "
        "all-zero weight row) and every weight outside nn.Linear stay bf16; the tapped states are bf16. With the "
        "target compiled (--compile, --compile-target) each activation's quantization fuses into the op before it: "
        "the forward ran 1.31x the compiled bf16 one in training at a 16-layer cut of Qwen3.6-27B on an H100; eager, "
        "0.9x (docs/results.md)",
        report.layers,
        100 * report.weight_share,
        report.bf16_layers,
    )
    if report.weight_share < 0.5:
        logger.warning(
            "--target-dtype fp8 covers only %.0f%% of the target's decoder weights: the rest (an MoE target's "
            "experts, stored outside nn.Linear) run bf16, so it saves little memory",
            100 * report.weight_share,
        )
