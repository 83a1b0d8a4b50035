"""DFlash2's candidate-selector objective (the drafter's own loss is :mod:`dflash.train.loss`).

z-lab publishes no DFlash2 training objective; the public trainers agree on its form and differ
in one choice. Teacher-forced, each supervised draft slot's candidates are its ``top_k`` tokens by
the drafter's LM-head logits; the selector scores them after the *true* previous token (slot 1:
the anchor) with the slot's final hidden state (:meth:`CandidateSelector.scores`), and a
cross-entropy over the K scores pulls the true token up, weighted like the slot's drafter loss
(SpecForge ``_selector_chunk_terms`` with ``dflash2_selector_loss_alpha``; speculators
``dflash2/metrics.py`` with ``selector_loss_alpha``; NeMo Automodel ``selector_loss_weight``).
The choice, ``missing_gold``: a slot whose true token is not a candidate is left out (SpecForge,
NeMo: serving can only select among the candidates) or gets it as the K-th candidate in place of
the weakest (speculators). The selector's gradient also reaches the drafter through the logits
and the hidden state, as in both trainers by default.

``soft`` (``--selector-target soft``, not in the public trainers) trains the selector towards what
sampling needs instead: vLLM and SGLang draw DFlash2's path at the request's temperature from the
softmax of the selector's scores over the candidates and verify it with that distribution (the
proposal q of speculative sampling, :mod:`dflash.evaluation.sampling`), and a draft is accepted
with probability min(1, p / q), so a slot accepts ``sum_x min(p(x), q(x))`` in expectation: the
closer q is to the target's p, the more. The soft target is the target's distribution at the slot
(its LM head on its last hidden state, the distribution it verifies the slot with) restricted to
the candidates and renormalised, and the loss the cross-entropy to it (a KL up to the target's own
entropy), teacher-forced and weighted as the hard one; every supervised slot counts. At T = 1 a
perfect fit makes q the target's p renormalised over the candidates (p / p(candidates)), so a slot
accepts with probability p(candidates); scores matching log p up to a constant make
``softmax(scores / T)`` the target's tempered distribution over the candidates at any T.

The candidates and their logits come from the chunks of the drafter's loss, which compute the
logits anyway (:func:`dflash.train.loss.chunk_loss`); the selector's loss then runs
once over every block of the micro-batch, so its codebooks' gradients (``[V, r]`` each, dense: an
embedding's gradient) are formed once per micro-batch rather than once per loss chunk.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def selector_loss(
    selector,
    hidden: Tensor,
    candidates: Tensor,
    candidate_logits: Tensor,
    slot_weights: Tensor,
    labels: Tensor,
    predecessors: Tensor,
    target_logits: Tensor | None,
) -> Tensor:
    """Weighted sum over slots of the selector's cross-entropy (module docstring): to the true token,
    or with ``target_logits`` to the target's distribution over the candidates.

    Hard, a slot whose true token is not among its candidates counts for nothing (``exclude``); for
    ``insert`` the candidates already hold it (:func:`dflash.train.loss.chunk_loss`).

    Args:
        selector (CandidateSelector): the drafter's.
        hidden (Tensor): ``[C, Bs, H]`` final drafter hidden states of C blocks.
        candidates (Tensor): int64 ``[C, Bs, K]``, each slot's candidates (its top-K tokens by the
            drafter's LM-head logits, the true token in place of the last where ``insert`` put it).
        candidate_logits (Tensor): float32 ``[C, Bs, K]``, their logits, differentiable in the drafter.
        slot_weights (Tensor): float32 ``[C, Bs]``, the slots' weights in the drafter's loss (0 where
            unsupervised).
        labels (Tensor): int64 ``[C, Bs]``, the true token of each slot.
        predecessors (Tensor): int64 ``[C, Bs]``, the true token before each slot.
        target_logits (Tensor, optional): float32 ``[C, Bs, K]``, the target's logits of the
            candidates (no gradient): the soft target; None: the hard one.

    Returns:
        Tensor: float32 scalar, differentiable in the selector, ``hidden`` and ``candidate_logits``.
    """
    scores = selector.scores(hidden, candidate_logits, candidates, predecessors).float()
    if target_logits is not None:
        soft_cross_entropy = -(target_logits.softmax(-1) * scores.log_softmax(-1)).sum(-1)
        return (slot_weights * soft_cross_entropy).sum()
    hit = candidates == labels[..., None]
    cross_entropy = F.cross_entropy(scores.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none")
    return (slot_weights * hit.any(-1) * cross_entropy.view_as(labels)).sum()
