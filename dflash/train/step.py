"""One micro-batch of DFlash drafter training (arXiv 2602.06036, Sec. 3): the frozen target's
hidden states in, the drafter's forward + loss + backward out.

Two stages, so a step engine can run them on different devices and threads:

- :func:`produce_target_states`: :class:`~dflash.data.batches.Batch` -> :class:`TargetBatch` (target
  forward, no grad);
- :func:`drafter_step`: :class:`TargetBatch` + anchors -> gradients accumulated into the drafter's
  ``.grad`` and the micro-batch's statistics as one device vector (:class:`StatsLayout`), so a
  step's statistics reach the host in one transfer.

:func:`drafter_forward_loss` is what ``torch.compile`` wraps on GPU: tensors in, tensors out, the
BlockMask built outside. The loss is a weighted *sum*; the step engine divides gradients by the
weight sum of the whole optimizer step (all micro-batches, threads and processes), so grad
accumulation equals one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.data.batches import Batch
from dflash.masks import build_labels, draft_input_ids, previous_positions
from dflash.profiling import DRAFTER_RANGE, TARGET_RANGE, marked
from dflash.target_model.model import Target, TargetStates
from dflash.train.loss import dflash_loss
from dflash.train.loss_settings import LossSettings


class StatsLayout:
    """The step statistics as one float32 device vector of ``6 + 2 * Bs`` entries:
    ``[loss_sum, weight_sum, valid_blocks, attention_pairs, stop, selector_loss_sum, correct[Bs],
    total[Bs]]`` (``loss_sum`` the drafter's own loss; ``selector_loss_sum`` DFlash2's selector
    cross-entropy, 0 for DFlash: the objective is their sum with the selector's weight).

    Sums over micro-batches, threads and processes are elementwise, so the vector travels with
    the gradients in one collective (:class:`dflash.distributed.FlatGradients` ``extra`` slots).
    ``stop`` is set by a process that received SIGTERM/SIGINT, so every process sees the request
    in the same step. Counts are exact in float32 up to 2**24 per step.
    """

    LOSS, WEIGHT, BLOCKS, PAIRS, STOP, SELECTOR = range(6)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.size = 6 + 2 * block_size
        self.correct = slice(6, 6 + block_size)
        self.total = slice(6 + block_size, 6 + 2 * block_size)

    def supervised(self, values: list[float]) -> float:
        """Supervised draft positions in ``values`` (the vector on the host, ``Tensor.tolist()``): the
        labelled slots of every block, slot 0 (the given anchor, never a label) among them at 0."""
        return sum(values[self.total])


@dataclass
class TargetBatch:
    """Everything the drafter needs for one micro-batch, on the drafter's device.

    Args:
        input_ids (Tensor): int64 ``[B, S]``.
        loss_mask (Tensor): bool ``[B, S]``.
        position_ids (Tensor): int64 ``[B, S]``, positions within each document (packed rows).
        document_ids (Tensor): int64 ``[B, S]``, document of each token, -1 on padding.
        states (TargetStates): context ``[B, S, K*H]`` and, for soft labels, last hidden
            ``[B, S, H]`` (no grad).
        num_tokens (int): real (non-padding) tokens, counted on the host.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    states: TargetStates
    num_tokens: int

    def to(self, device: torch.device) -> TargetBatch:
        """A copy on ``device`` (asynchronous from pinned or peer memory; no host sync)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        states = TargetStates(move(self.states.context), move(self.states.last_hidden))
        ids, mask, positions, documents = map(
            move, (self.input_ids, self.loss_mask, self.position_ids, self.document_ids)
        )
        return TargetBatch(ids, mask, positions, documents, states, self.num_tokens)


def produce_target_states(target: Target, batch: Batch, *, last_hidden: bool) -> TargetBatch:
    """Run the frozen target on a host batch and keep what the drafter needs (stage 1).

    Each conversation's states are those of the conversation run alone (:meth:`Target.capture`
    with the batch's documents, taken from the host copy: no sync). Without ``last_hidden``
    (:attr:`LossSettings.needs_last_hidden`) the target stops at its deepest tapped layer.
    """
    num_tokens, host_documents = batch.num_tokens, batch.document_ids
    batch = batch.to(target.device)
    with marked(TARGET_RANGE):
        states = target.capture(batch.input_ids, batch.position_ids, host_documents, last_hidden=last_hidden)
    return TargetBatch(batch.input_ids, batch.loss_mask, batch.position_ids, batch.document_ids, states, num_tokens)


def drafter_forward_loss(
    drafter,
    embed_weight,
    lm_head_weight,
    position_weight,
    input_ids,
    loss_mask,
    position_ids,
    document_ids,
    context,
    last_hidden,
    anchors,
    valid,
    attention_mask,
    settings: LossSettings,
    *,
    chunk_fn=None,
    selector_fn=None,
):
    """Draft blocks -> drafter -> chunked LM head + weighted loss (:func:`dflash.train.loss.dflash_loss`).

    Tensors and the run's :class:`LossSettings` in, a :class:`dflash.train.loss.LossOutput` out; the
    attention mask (BlockMask or dense) is built by the caller, outside any compiled region.
    ``chunk_fn`` and ``selector_fn``: the loss chunk and DFlash2's selector loss
    (:func:`dflash.train.loss.chunk_loss`, :func:`dflash.train.selector_loss.selector_loss` when
    None; compiled regions, :mod:`dflash.train.regions`).
    """
    block_size = drafter.config.block_size
    ids = draft_input_ids(input_ids, anchors, valid, block_size, settings.mask_token_id)
    embeds = F.embedding(ids, embed_weight)  # the target's frozen embedding, [B, N*Bs, H]
    hidden = drafter(embeds, context, anchors, valid, attention_mask, position_ids=position_ids)
    labels, label_mask = build_labels(input_ids, loss_mask, anchors, valid, block_size, document_ids)
    selector = getattr(drafter, "candidate_selector", None)
    return dflash_loss(
        hidden,
        lm_head_weight,
        labels,
        label_mask,
        position_weight,
        settings,
        teacher_hidden=last_hidden if settings.needs_last_hidden else None,
        anchors=anchors,
        selector=selector,
        predecessors=previous_tokens(input_ids, anchors, block_size) if selector is not None else None,
        logit_transform=drafter.config.logit_transform,
        chunk_fn=chunk_fn,
        selector_fn=selector_fn,
    )


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[B, N, Bs]``: the true token before each draft slot, ``x[a + k - 1]`` for slot k of the
    block anchored at a (slot 0's is unused: it is not predicted)."""
    positions = previous_positions(anchors, block_size, input_ids.shape[1])
    return torch.gather(input_ids, 1, positions.flatten(1)).view_as(positions)


def drafter_step(
    step_fn,
    drafter,
    heads,
    batch: TargetBatch,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    *,
    settings: LossSettings,
    position_weight: torch.Tensor,
    rows: int | None = None,
) -> torch.Tensor:
    """Forward + backward of the drafter on one micro-batch (stage 2), ``rows`` rows at a time.

    Gradients accumulate into the drafter's ``.grad`` from the unnormalised loss *sum*; the engine
    divides by the step's total weight. Runs under bf16 autocast on CUDA. Rows meet nowhere in the
    drafter (attention, the DFlash mask, documents and anchors are per row) and the loss, its
    normaliser and every statistic are sums over rows, so groups of rows give the micro-batch's
    gradients and statistics up to float summation order, with a group's activations only
    (``--drafter-rows``, :mod:`dflash.train.drafter_rows`).

    Args:
        step_fn: :func:`drafter_forward_loss` or a compiled copy of it.
        drafter (AnchoredDrafter): the replica being trained.
        heads: the target's frozen ``embed_tokens`` and ``lm_head`` on the drafter's device.
        batch (TargetBatch): on the drafter's device.
        anchors (Tensor): int64 ``[B, N]``; valid (Tensor): bool ``[B, N]`` (drafter's device).
        rows (int, optional): rows per forward/backward (the last group may be shorter); None: all B.

    Returns:
        Tensor: float32 ``[StatsLayout(Bs).size]`` on the drafter's device (``stop`` = 0); no host sync.
    """
    size = batch.input_ids.shape[0]
    rows = rows or size
    stats = None
    with marked(DRAFTER_RANGE):
        for start in range(0, size, rows):
            group = slice(start, start + rows)
            inputs = _row_group(batch, group)
            part = _drafter_step(
                step_fn, drafter, heads, inputs, anchors[group], valid[group], settings, position_weight
            )
            stats = part if stats is None else stats + part
    return stats


def _row_group(batch: TargetBatch, group: slice) -> tuple:
    """Views of the rows ``group`` of ``batch``: input ids, loss mask, positions, documents, context and
    last hidden states (or None)."""
    last_hidden = batch.states.last_hidden
    tensors = (batch.input_ids, batch.loss_mask, batch.position_ids, batch.document_ids, batch.states.context)
    return *(t[group] for t in tensors), None if last_hidden is None else last_hidden[group]


def _drafter_step(step_fn, drafter, heads, inputs, anchors, valid, settings, position_weight) -> torch.Tensor:
    """One group of rows: ``inputs`` are its input ids, loss mask, positions, documents, context and last hidden
    states (or None)."""
    input_ids, loss_mask, position_ids, document_ids, context, last_hidden = inputs
    attention_mask = drafter.build_attention_mask(anchors, valid, input_ids.shape[1], document_ids)
    device_type = input_ids.device.type
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
        out = step_fn(
            drafter,
            heads.embed_tokens.weight,
            heads.lm_head.weight,
            position_weight,
            input_ids,
            loss_mask,
            position_ids,
            document_ids,
            context,
            last_hidden,
            anchors,
            valid,
            attention_mask,
            settings,
        )
    out.loss_sum.backward()
    pairs = drafter.attention_pairs(anchors, valid, document_ids)
    drafter_sum = out.loss_sum.detach() if out.drafter_sum is None else out.drafter_sum
    scalars = [drafter_sum, out.weight_sum, valid.sum(), pairs, torch.zeros_like(pairs), out.selector_sum]
    return torch.cat([torch.stack([s.float() for s in scalars]), out.correct.float(), out.total.float()])
