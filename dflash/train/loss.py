"""DFlash training loss and metrics: chunked LM head, position weights, soft labels, D-PACE, tau_hat.

The drafter's hidden states go through the target's frozen ``lm_head``. With N*Bs draft tokens and
a 152k vocabulary the full logits (8,192 x 151,936 floats, ~5 GB in fp32) do not fit next to the
rest of a training step, so :func:`dflash_loss` runs the head + loss over chunks of whole blocks,
one chunk's logits at a time. Each chunk computes its loss *and* its gradient with respect to the
drafter's hidden states in one pass (a fused linear cross-entropy, as Liger-Kernel and "Cut Your
Losses" (arXiv 2411.09009) do for LM heads): backward only scales the saved gradient, so nothing
is recomputed and no logits outlive their chunk. Against checkpointing each chunk (logits
recomputed in backward) that saves one of three V x H matmuls per draft token.

Loss (arXiv 2602.06036, Sec. 3.3): weighted cross-entropy over draft slots k >= 1 with
``w_k = exp(-(k - 1) / gamma)`` (slot 0, the given anchor token, has weight 0). The function returns
the weighted *sum* and its normaliser (the weight sum; the supervised-slot count for D-PACE); the
trainer divides the sum by the normaliser gathered over the whole optimizer step (all
micro-batches, all ranks), not per micro-batch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.masks import previous_positions
from dflash.train.loss_settings import LossSettings
from dflash.train.selector_loss import selector_loss


@dataclass
class LossOutput:
    """Sums over one micro-batch; reduce across micro-batches/ranks first, divide last.

    Attributes:
        loss_sum (Tensor): scalar, sum over supervised slots of ``weight * token_loss``
            (differentiable w.r.t. the drafter hidden states).
        weight_sum (Tensor): scalar float32, what the loss sum is divided by (no grad): the sum of
            the position weights for "decay", the number of supervised slots for "dpace".
        correct (Tensor): int64 ``[Bs]``, per slot, supervised slots whose argmax equals the label.
        total (Tensor): int64 ``[Bs]``, per slot, supervised slots.
        selector_sum (Tensor): float32 scalar, no grad: DFlash2's selector cross-entropy sum before
            its weight (``loss_sum`` includes it times the weight); 0 without a selector.
        drafter_sum (Tensor | None): float32 scalar, no grad: ``loss_sum`` without the selector's
            part, summed on its own (subtracting a large weight times the selector's would cancel);
            None without a selector, where it is ``loss_sum``: returning both from an inductor
            graph gives one tensor for the two, and AOTAutograd marking the copy
            non-differentiable takes the loss's gradient (torch 2.11-2.15; pytorch/pytorch PR
            #195357, "Don't let a non-differentiable output mark its aliases").
    """

    loss_sum: Tensor
    weight_sum: Tensor
    correct: Tensor
    total: Tensor
    selector_sum: Tensor
    drafter_sum: Tensor | None


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    weights: Tensor,
    settings: LossSettings,
    *,
    teacher_hidden: Tensor | None = None,
    anchors: Tensor | None = None,
    selector=None,
    predecessors: Tensor | None = None,
    logit_transform=None,
    chunk_fn=None,
    selector_fn=None,
) -> LossOutput:
    """Chunked LM head + weighted loss over draft blocks.

    Per supervised slot (``label_mask``) the token loss is
    ``(1 - a) * CE(drafter, label) + a * KL(target || drafter)`` with ``a = settings.soft_label_weight``;
    it is multiplied by the slot's weight and summed. Logits are computed in the dtype of
    ``hidden`` and upcast to float32 for softmax/CE; the drafter's are the LM head's after its
    config's ``logit_transform`` (what it serves), and so are the selector's candidates' logits
    (the teacher's are the target's own).

    Position weighting (``settings.position_weighting``):

    - ``"decay"``: ``weights[k]`` (:func:`dflash.train.loss_settings.position_weights`).
    - ``"dpace"``: D-PACE (arXiv 2605.18810), as SpecForge (``OnlineDFlashModel._dpace_weight``)
      and speculators (``losses.dpace_loss_decay``) define it alike. With ``q_i`` the drafter's
      probability of the label at slot i (detached) and ``alpha = settings.dpace_alpha``, each
      supervised slot's confidence is smoothed, ``c_i = (1 - alpha) * q_i + alpha``, and an
      unsupervised slot passes through (``c_i = 1``); slot k of a block gets
      ``w_k = sum_{j >= k, j supervised} prod_{i <= j} c_i`` (0 where unsupervised): the
      expected accepted length's sensitivity to slot k, so training focuses on the slots that
      currently limit acceptance. ``weights`` is ignored except for its length. The returned
      weight sum is the number of supervised slots (speculators divides by it; SpecForge by the
      batch size), so the loss is a mean over supervised slots.

    Memory and work: each chunk of ``settings.chunk_blocks`` blocks computes its logits, loss and
    the gradient of the loss with respect to its hidden states at once (:class:`_FusedChunkLoss`);
    only that gradient (``[C, Bs, H]``) is kept for backward, never logits (peak
    ``chunk_blocks * Bs * V`` floats, x3-4 for softmax and gradient). The LM head is frozen, so no
    weight gradient is formed. The gradient flows to ``hidden`` only.

    Args:
        hidden (Tensor): ``[B, N*Bs, H]`` drafter output (after its final norm).
        lm_head_weight (Tensor): ``[V, H]`` frozen target LM head weight.
        labels (Tensor): int64 ``[B, N, Bs]`` (:func:`dflash.masks.build_labels`).
        label_mask (Tensor): bool ``[B, N, Bs]``.
        weights (Tensor): float ``[Bs]`` per-slot weights (:meth:`LossSettings.position_weight`).
        settings (LossSettings): chunk size, position weighting, soft-label and selector weights,
            the missing-gold rule and the selector's target; ``soft_label_weight > 0`` and the soft
            selector target (:attr:`LossSettings.soft_selector`) need ``teacher_hidden`` and ``anchors``.
        teacher_hidden (Tensor, optional): ``[B, S, H]`` the verifier's last hidden state (the
            input of its ``lm_head``, after the final norm). Slot k of the block anchored at a is
            matched to the target's next-token distribution at position ``a + k - 1``, the
            distribution the target verifies ``x[a + k]`` with.
        anchors (Tensor, optional): int64 ``[B, N]``, needed with ``teacher_hidden``.
        selector (CandidateSelector, optional): a DFlash2 drafter's; adds ``settings.selector_weight`` times
            its loss (:func:`dflash.train.selector_loss.selector_loss`, with each slot's weight) to
            the loss sum, the normaliser unchanged (SpecForge's normalisation).
        predecessors (Tensor, optional): int64 ``[B, N, Bs]``, the true token before each slot
            (slot k of anchor a: ``x[a + k - 1]``); needed with ``selector``.
        logit_transform (LogitTransform, optional): the drafter config's
            (:attr:`dflash.drafter.modeling_dflash.DFlashDraftConfig.logit_transform`); None: the identity.
        chunk_fn (callable, optional): :func:`chunk_loss` or a compiled copy of it (the regional
            compile compiles one chunk and reuses it for all, :mod:`dflash.train.regions`).
        selector_fn (callable, optional): :func:`dflash.train.selector_loss.selector_loss` or a
            compiled copy of it.

    Returns:
        LossOutput

    Raises:
        ValueError: on inconsistent shapes.
    """
    batch, q_len, hidden_size = hidden.shape
    block_size = weights.shape[0]
    num_blocks = q_len // block_size
    if labels.shape != (batch, num_blocks, block_size) or label_mask.shape != labels.shape:
        raise ValueError(
            f"labels/label_mask must be [B, N, Bs] = {(batch, num_blocks, block_size)}, got "
            f"{tuple(labels.shape)} and {tuple(label_mask.shape)}"
        )
    if q_len != num_blocks * block_size:
        raise ValueError(f"hidden has {q_len} rows, not a multiple of block size {block_size}")
    selecting = selector is not None and settings.selector_weight > 0
    if selecting and (predecessors is None or predecessors.shape != labels.shape):
        raise ValueError(f"a selector needs predecessors [B, N, Bs] = {tuple(labels.shape)}")
    # The target's distribution is read by soft labels and by the selector's soft target.
    soft = settings.soft_label_weight > 0.0 or (selecting and settings.soft_selector)
    if soft and (teacher_hidden is None or anchors is None or anchors.shape != (batch, num_blocks)):
        raise ValueError(
            "soft labels and the soft selector target need teacher_hidden [B, S, H] and anchors [B, N] = "
            f"{(batch, num_blocks)}, got {None if anchors is None else tuple(anchors.shape)}"
        )

    rows = hidden.reshape(batch * num_blocks, block_size, hidden_size)
    labels = labels.reshape(batch * num_blocks, block_size)
    label_mask = label_mask.reshape(batch * num_blocks, block_size)
    weights = weights.to(device=hidden.device, dtype=torch.float32)
    teacher_rows = _teacher_rows(teacher_hidden, anchors, block_size) if soft else None
    chunk_fn = chunk_fn or chunk_loss

    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    weight_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(block_size, dtype=torch.long, device=hidden.device)
    # Per chunk: candidates, their logits, slot weights, the target's logits of the candidates.
    slates: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    soft_selector = selecting and settings.soft_selector
    # split, not a slice per chunk: autograd then gathers the chunks' gradients in one cat, where
    # each slice's backward would build a zero tensor of rows' full size and add it to the rest.
    chunk_blocks = settings.chunk_blocks
    chunks = zip(
        rows.split(chunk_blocks),
        labels.split(chunk_blocks),
        label_mask.split(chunk_blocks),
        teacher_rows.split(chunk_blocks) if soft else itertools.repeat(None),
    )
    for chunk_rows, chunk_labels, chunk_mask, chunk_teacher in chunks:
        objective, chunk_weight, chunk_correct, candidates, candidate_logits, slot_weights = chunk_fn(
            chunk_rows,
            lm_head_weight,
            chunk_labels,
            chunk_mask,
            weights,
            chunk_teacher,
            settings,
            top_k=selector.top_k if selecting else 0,
            logit_transform=logit_transform,
        )
        loss_sum = loss_sum + objective
        weight_sum = weight_sum + chunk_weight
        correct = correct + chunk_correct
        # Outside the (compiled) chunk: there, the head rows this gathers are the rows the
        # candidates' backward gathers again, and the chunk would keep them for it ([C, Bs, K, H]).
        target_logits = _target_logits(chunk_teacher, lm_head_weight, candidates) if soft_selector else None
        slates.append((candidates, candidate_logits, slot_weights, target_logits))
    total = label_mask.sum(0)
    if not selecting:
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        return LossOutput(loss_sum, weight_sum, correct, total, zero, None)
    # The selector's loss over all blocks at once, outside the chunks: its codebooks' gradients
    # are then formed once per micro-batch, not as a dense [V, r] tensor per chunk.
    candidates, candidate_logits, slot_weights = (torch.cat(parts) for parts in list(zip(*slates))[:3])
    target_logits = torch.cat([slate[3] for slate in slates]) if soft_selector else None
    selected = (selector_fn or selector_loss)(
        selector,
        rows,
        candidates,
        candidate_logits,
        slot_weights,
        labels,
        predecessors.reshape(batch * num_blocks, block_size),
        target_logits,
    )
    drafter_sum = loss_sum.detach()
    objective = loss_sum + settings.selector_weight * selected
    return LossOutput(objective, weight_sum, correct, total, selected.detach(), drafter_sum)


def chunk_loss(
    rows: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    label_mask: Tensor,
    weights: Tensor,
    teacher: Tensor | None,
    settings: LossSettings,
    *,
    top_k: int,
    logit_transform=None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One chunk of :func:`dflash_loss` (its arguments, cut to the chunk's C blocks): ``rows``
    ``[C, Bs, H]``, ``labels``/``label_mask`` ``[C, Bs]``, ``teacher`` ``[C, Bs, H]`` or None.
    ``top_k`` > 0 (a DFlash2 selector's K) also picks each slot's candidates for
    :func:`dflash.train.selector_loss.selector_loss`; ``settings.missing_gold`` ``insert`` puts a
    slot's true token in place of its last candidate where it is missing. ``logit_transform``: the
    drafter's (None: the identity).

    Returns:
        (loss sum, normaliser, correct ``[Bs]``, candidates int64 ``[C, Bs, K]``, their float32
        logits ``[C, Bs, K]``, slot weights float32 ``[C, Bs]``): the loss sum and the candidates'
        logits carry gradients to ``rows``; without ``top_k`` the candidates and logits are empty.
    """
    soft_labels = teacher if settings.soft_label_weight > 0 else None
    objective, normaliser, correct, candidates, logits, slot_weights = _FusedChunkLoss.apply(
        rows,
        lm_head_weight,
        labels,
        label_mask,
        weights,
        soft_labels,
        settings.soft_label_weight,
        settings.position_weighting,
        settings.dpace_alpha,
        top_k,
        settings.missing_gold == "insert",
        logit_transform,
    )
    return objective, normaliser, correct, candidates, logits, slot_weights


def _target_logits(teacher: Tensor, lm_head_weight: Tensor, candidates: Tensor) -> Tensor:
    """float32 ``[C, Bs, K]``: the target's logits of each slot's candidates (int64 ``[C, Bs, K]``)
    from its last hidden states ``teacher`` ``[C, Bs, H]`` through its frozen head; no gradient.
    Only the candidates' head rows are read (``[C, Bs, K, H]``, as the backward of their logits
    reads them), never the vocabulary."""
    rows = lm_head_weight[candidates]
    return torch.einsum("cbh,cbkh->cbk", teacher.detach().to(rows.dtype), rows).float()


def _teacher_rows(teacher_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Teacher states per draft slot: slot k of anchor a <- position ``a + k - 1`` -> ``[B*N, Bs, H]``."""
    batch, seq_len, hidden_size = teacher_hidden.shape
    positions = previous_positions(anchors, block_size, seq_len)
    index = positions.reshape(batch, -1, 1).expand(-1, -1, hidden_size)
    return torch.gather(teacher_hidden.detach(), 1, index).reshape(-1, block_size, hidden_size)


class _FusedChunkLoss(torch.autograd.Function):
    """One chunk of blocks: ``hidden`` [C, Bs, H] -> (loss sum, its normaliser, correct [Bs], and for
    a selector each slot's candidates [C, Bs, K] with their float32 logits, the slot weights
    [C, Bs]), the loss's gradient with respect to
    ``hidden`` computed in forward and saved; backward scales it and adds the candidate logits'.

    With ``p`` the drafter's softmax, ``t`` the teacher's, ``a`` the soft-label weight and ``w`` the
    (detached) slot weight, the loss of a slot is ``w * ((1 - a) * CE + a * KL(t || p))``, whose
    gradient with respect to the logits is ``w * (p - (1 - a) * onehot(label) - a * t)``; with a
    ``transform`` f of the head's logits z (the drafter's logits are f(z)), times ``f'(z)``; through
    the frozen head, ``dL/dhidden = (dL/dz) @ W``. The candidates are the ``top_k`` highest of the
    head's logits in ``hidden``'s dtype (their float32 copies order alike, and so do their
    transforms, which are increasing: vLLM and SGLang pick them so too); a candidate logit's
    gradient reaches ``hidden`` through ``f'`` and its head row, gathered again in backward
    (``[C, Bs, K, H]``, never kept).
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        lm_head_weight,
        labels,
        label_mask,
        weights,
        teacher,
        soft_label_weight,
        weighting,
        alpha,
        top_k,
        insert_gold,
        transform,
    ):
        head_logits = hidden @ lm_head_weight.t()  # [C, Bs, V], hidden's dtype
        logits = head_logits.float() if transform is None else transform(head_logits.float())
        candidates, candidate_logits = _candidates(head_logits, logits, labels, top_k, insert_gold)
        del head_logits
        log_probs = F.log_softmax(logits, dim=-1)
        label_log_prob = log_probs.gather(-1, labels[..., None]).squeeze(-1)  # [C, Bs]
        token_loss = -label_log_prob
        grad_logits = log_probs.exp()  # p; becomes dL/dlogits below
        label_share = 1.0
        if teacher is not None:
            teacher_log_probs = F.log_softmax((teacher @ lm_head_weight.t()).float(), dim=-1)
            teacher_probs = teacher_log_probs.exp()
            kl = (teacher_probs * (teacher_log_probs - log_probs)).sum(-1)
            token_loss = (1.0 - soft_label_weight) * token_loss + soft_label_weight * kl
            grad_logits.sub_(soft_label_weight * teacher_probs)
            label_share = 1.0 - soft_label_weight
        if weighting == "dpace":
            slot_weights = _dpace_weights(label_log_prob, label_mask, alpha)
            normaliser = label_mask.sum().float()
        else:
            slot_weights = torch.where(label_mask, weights.expand_as(token_loss), 0.0)
            normaliser = slot_weights.sum()
        correct = ((logits.argmax(-1) == labels) & label_mask).sum(0)
        del log_probs
        grad_logits.scatter_add_(-1, labels[..., None], torch.full_like(label_log_prob, -label_share)[..., None])
        grad_logits.mul_(slot_weights[..., None])
        if transform is not None:
            grad_logits.mul_(transform.derivative(logits))
        del logits
        ctx.save_for_backward((grad_logits.to(lm_head_weight.dtype) @ lm_head_weight).to(hidden.dtype), candidates)
        ctx.weight, ctx.top_k = lm_head_weight, top_k
        # f' at the candidates ([C, Bs, K], or the multiplier alone without a cap).
        ctx.candidate_derivative = None if transform is None or not top_k else transform.derivative(candidate_logits)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(normaliser, correct, candidates, slot_weights)
        loss = (slot_weights * token_loss).sum()
        return loss, normaliser, correct, candidates, candidate_logits, slot_weights

    @staticmethod
    def backward(ctx, grad_loss, _normaliser, _correct, _candidates, grad_candidate_logits, *_):
        grad_hidden, candidates = ctx.saved_tensors
        grad = None if grad_loss is None else grad_loss * grad_hidden
        if ctx.top_k and grad_candidate_logits is not None:
            if ctx.candidate_derivative is not None:
                grad_candidate_logits = grad_candidate_logits * ctx.candidate_derivative
            rows = ctx.weight[candidates]  # [C, Bs, K, H]
            from_candidates = torch.einsum("cbk,cbkh->cbh", grad_candidate_logits.to(rows.dtype), rows)
            grad = from_candidates.to(grad_hidden.dtype) if grad is None else grad + from_candidates
        return grad, None, None, None, None, None, None, None, None, None, None, None


def _candidates(head_logits: Tensor, logits: Tensor, labels: Tensor, top_k: int, insert_gold: bool):
    """Each slot's ``top_k`` candidates (int64 ``[C, Bs, K]``) by ``head_logits`` with their
    float32 ``logits``, the true token put in place of the last candidate where it is missing if
    ``insert_gold``; empty tensors for ``top_k`` 0."""
    if not top_k:
        return labels.new_zeros(0), logits.new_zeros(0)
    candidates = top_k_indices(head_logits, top_k)
    if insert_gold:
        found = (candidates == labels[..., None]).any(-1)
        candidates = torch.cat([candidates[..., :-1], torch.where(found, candidates[..., -1], labels)[..., None]], -1)
    return candidates, logits.gather(-1, candidates)


#: The widest vocabulary block :func:`top_k_indices` ranks first, and the narrowest worth it.
TOP_K_BLOCK, TOP_K_MIN_BLOCK = 512, 64


def top_k_indices(x: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` largest entries of ``x`` ``[..., V]`` along its last axis, largest
    first, as ``x.topk(k).indices`` (ties aside).

    Over a vocabulary (V = 248,320) ``torch.topk``'s radix select reads each row several times: 37 ms
    a step for the DFlash2 selector's candidates at the user's shape on an H100 (5 ms this way). The
    k largest entries lie in the k blocks of the row with the largest maxima (a block holding one of
    them has a maximum at least as large, and at most k blocks can), so one pass takes each block's
    maximum, and ``topk`` then runs over those k blocks instead of the vocabulary. The block is the
    largest power of two up to :data:`TOP_K_BLOCK` that divides V (vocabularies are padded to
    multiples of 64 or more); a V with none of at least :data:`TOP_K_MIN_BLOCK`, or with at most k
    blocks, takes ``topk`` over the whole row.

    Args:
        x (Tensor): ``[..., V]``, any float dtype.
        k (int): 1 <= k <= V.

    Returns:
        Tensor: int64 ``[..., k]``.
    """
    vocab = x.shape[-1]
    block = math.gcd(vocab, TOP_K_BLOCK)
    if block < TOP_K_MIN_BLOCK or vocab // block <= k:
        return x.topk(k, dim=-1).indices
    tiles = x.unflatten(-1, (vocab // block, block))
    best = tiles.amax(-1).topk(k, dim=-1).indices  # [..., k] blocks
    inside = tiles.gather(-2, best[..., None].expand(*best.shape, block)).flatten(-2).topk(k, dim=-1).indices
    return best.gather(-1, inside // block) * block + inside % block


def _dpace_weights(label_log_prob: Tensor, label_mask: Tensor, alpha: float) -> Tensor:
    """D-PACE weights ``[C, Bs]`` of blocks (see :func:`dflash_loss`); 0 on unsupervised slots."""
    smoothed = torch.where(label_mask, (1.0 - alpha) * label_log_prob.exp() + alpha, 1.0)
    reach = torch.cumprod(smoothed, dim=-1) * label_mask
    return reach.flip(-1).cumsum(-1).flip(-1) * label_mask
