"""How the drafter's loss is computed: one frozen :class:`LossSettings`, built once from the training
config (:meth:`LossSettings.from_config`) and passed down to every engine, thread, compiled region
and loss function, none of which has a default of its own: what ``dflash train`` trains is what
:class:`dflash.config.TrainConfig`'s defaults say, whoever calls the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dflash.choices import check_choices
from dflash.config import MissingGold, SelectorTarget, paper_gamma

#: ``decay``: the paper's ``exp(-(k-1)/gamma)`` (arXiv 2602.06036, Sec. 3.3); ``dpace``: D-PACE's
#: confidence weights (arXiv 2605.18810; ``--dpace``).
PositionWeighting = Literal["decay", "dpace"]


def position_weights(block_size: int, gamma: float, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The paper's slot weights (Sec. 3.3): ``w_0 = 0`` (the anchor is given), ``w_k = exp(-(k - 1) / gamma)``.

    Args:
        block_size (int): Bs, >= 2.
        gamma (float): > 0 (:class:`LossSettings` checks both).
        device: where to create the tensor (None: the default device).

    Returns:
        Tensor: float32 ``[Bs]``.
    """
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The drafter loss's settings (:func:`dflash.train.loss.dflash_loss`), checked when built.

    Args:
        mask_token_id (int): the draft mask slot's token id (an existing target embedding row).
        block_size (int): Bs, >= 2.
        gamma (float): decay of the position weights ``w_k = exp(-(k-1)/gamma)``, > 0.
        soft_label_weight (float): weight of the KL to the target's distribution, in [0, 1].
        position_weighting (PositionWeighting): ``decay`` or ``dpace``.
        dpace_alpha (float): D-PACE confidence smoothing, in [0, 1] (read with ``dpace``).
        chunk_blocks (int): draft blocks per chunk of the LM head + loss, >= 1.
        selector_weight (float): DFlash2: weight of the selector's loss (:mod:`dflash.train.selector_loss`), >= 0.
        missing_gold (MissingGold): DFlash2: a slot whose true token is not a candidate: ``exclude`` or ``insert``.
        selector_target (SelectorTarget, optional): DFlash2: ``hard`` (the true token) or ``soft`` (the target's
            distribution over the candidates); None for a drafter without a selector.

    Raises:
        ValueError: a value out of its range or choices (names the field).
    """

    mask_token_id: int
    block_size: int
    gamma: float
    soft_label_weight: float
    position_weighting: PositionWeighting
    dpace_alpha: float
    chunk_blocks: int
    selector_weight: float
    missing_gold: MissingGold
    selector_target: SelectorTarget | None

    def __post_init__(self) -> None:
        check_choices(self)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor and a draft slot), got {self.block_size}")
        if self.chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be >= 1, got {self.chunk_blocks}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        for name in ("soft_label_weight", "dpace_alpha"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.selector_weight < 0:
            raise ValueError(f"selector_weight must be >= 0, got {self.selector_weight}")

    @classmethod
    def from_config(cls, config, *, block_size: int, mask_token_id: int, selector: bool) -> LossSettings:
        """The settings of a run of :class:`dflash.config.TrainConfig` ``config`` whose drafter has
        ``block_size`` and ``mask_token_id`` (its config's: ``--init-from`` and ``--resume`` keep the
        drafter's own) and, if ``selector``, DFlash2's candidate selector; ``--gamma`` empty takes
        :func:`dflash.config.paper_gamma`."""
        return cls(
            mask_token_id=mask_token_id,
            block_size=block_size,
            gamma=paper_gamma(block_size) if config.gamma is None else config.gamma,
            soft_label_weight=config.soft_label_weight,
            position_weighting="dpace" if config.dpace else "decay",
            dpace_alpha=config.dpace_alpha,
            chunk_blocks=config.loss_chunk_blocks,
            selector_weight=config.selector_loss_weight,
            missing_gold=config.selector_missing_gold,
            selector_target=config.selector_target if selector else None,
        )

    @property
    def needs_last_hidden(self) -> bool:
        """Soft labels and the soft selector target read the target's last hidden state; otherwise it is
        never moved."""
        return self.soft_label_weight > 0 or self.soft_selector

    @property
    def soft_selector(self) -> bool:
        """Whether a selector is trained towards the target's distribution (and is trained at all)."""
        return self.selector_target == "soft" and self.selector_weight > 0

    def position_weight(self, device: torch.device | str) -> torch.Tensor:
        """float32 ``[Bs]`` slot weights on ``device`` (:func:`position_weights`)."""
        return position_weights(self.block_size, self.gamma, device=device)
