"""How the tokens of a generation are chosen: greedily (T = 0) or sampled at the temperature,
top-p and top-k users serve with, and, for speculative decoding, how the drafter proposes a block
and the target verifies it so that the output is distributed exactly as the target's own.

Sampled verification is speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv 2211.17192, Sec. 2.3; Chen et al. 2023, arXiv
2302.01318, Alg. 2): a drafted token x with target probability p(x) and proposal probability q(x)
is accepted with probability min(1, p(x) / q(x)); at the first rejection the next token is drawn
from the residual norm(max(0, p - q)) and the step ends; when every draft is accepted a bonus
token is drawn from p at the slot after the block. p is the target's distribution after the
:class:`Sampling` processing (temperature, then top-k, then top-p). Any proposal q keeps the
output exact as long as the drafts are drawn from the q used in the ratio; how close q is to p
decides only how many drafts are accepted.

The proposal of each architecture, as z-lab/dflash's reference decoding loop (``dflash/model.py``
at 07ebd93: ``dflash_generate``, ``CandidateSelector.select``, ``_rejection_sample``) makes it:

- DFlash drafts the block's slots in parallel: slot k's draft is drawn from the processed softmax
  of its draft logits (the LM head and the config's logit transform, ``compute_logits``; the
  temperature, top-k and top-p of p), independently of the other slots' drafts.
- DFlash2 walks its candidate selector (:class:`dflash.drafter.modeling_dflash.CandidateSelector`)
  from the anchor: at slot k the proposal is ``softmax(scores / T)`` of the selector's scores of
  the slot's top-K candidates after the token drawn at slot k - 1, zero outside the candidates:
  the temperature alone, no top-k or top-p, as z-lab's ``select``, vLLM 0.34
  (``v1/worker/gpu/spec_decode/dflash2/speculator.py``: a Gumbel-max draw over ``scores / T``
  whose realised scores become the draft logits its rejection sampler reads) and SGLang 0.5.19
  (the DFlash worker's ``_propose_selector_block``: ``sample_path`` returns the path and its K-way
  ``q_rows``, scattered into a dense q for the verify kernel) all do.

Where we differ from the engines: draws come from one seeded ``torch.Generator`` per generation,
not from their position-keyed Gumbel noise, so outputs match theirs in distribution, not token for
token; and for DFlash, vLLM samples its draft at the temperature alone (``draft_sample_method``
``probabilistic``; "for draft sampling, we only consider the temperature and ignore ... top_k and
top_p") or verifies the greedy draft as a one-hot q, as SGLang does. Every choice of q is exact;
they differ in acceptance only.

Greedy decoding (:data:`GREEDY`) keeps the exact rule: drafts are accepted while they equal the
target's argmax, and the output equals target-only greedy decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dflash.evaluation.sampling_settings import GREEDY, Sampling


class Draft(NamedTuple):
    """A drafted block: ``tokens`` int64 ``[1, Bs-1]``; ``proposal`` float32 ``[Bs-1, V]``, the
    distribution each slot's token was drawn from (None for greedy drafts)."""

    tokens: Tensor
    proposal: Tensor | None


class Decoder:
    """Chooses the tokens of one generation (:mod:`dflash.evaluation.decoding` calls it): the
    next token of target-only decoding, a drafted block and its verification.

    Args:
        sampling (Sampling): how tokens are drawn.
        generator (torch.Generator, optional): the generation's random stream, on the target's
            device; required when sampling, unused when greedy.

    Raises:
        ValueError: sampling without a generator.
    """

    def __init__(self, sampling: Sampling, generator: torch.Generator | None):
        if not sampling.greedy and generator is None:
            raise ValueError(f"sampling at {sampling.describe()} needs a seeded torch.Generator")
        self.sampling, self.generator = sampling, generator

    def next_token(self, logits: Tensor) -> Tensor:
        """int64 ``[1]``: the token after logits ``[1, V]``."""
        if self.sampling.greedy:
            return logits.argmax(-1)
        return torch.multinomial(self.sampling.probabilities(logits), 1, generator=self.generator)[:, 0]

    def draft(self, drafter, target_hidden: Tensor, block_embeds: Tensor, lm_head, anchor: Tensor) -> Draft:
        """The drafter's block after the verified prefix (arguments as
        :meth:`dflash.drafter.model.AnchoredDrafter.draft_block`, batch 1)."""
        if self.sampling.greedy:
            return Draft(drafter.draft_block(target_hidden, block_embeds, lm_head, anchor), None)
        hidden = drafter.block_hidden(target_hidden, block_embeds)[0, 1:]  # [Bs-1, H]
        logits = drafter.compute_logits(hidden, lm_head)  # the config's logit transform included
        if drafter.config.is_dflash2:
            tokens, proposal = self._selector_path(drafter.candidate_selector, hidden, logits, anchor)
        else:
            proposal = self.sampling.probabilities(logits)
            tokens = torch.multinomial(proposal, 1, generator=self.generator)[:, 0]
        return Draft(tokens[None], proposal)

    def verify(self, draft: Draft, logits: Tensor) -> tuple[int, Tensor]:
        """``(accepted drafts, next token int64 [1])`` from the target's logits ``[Bs, V]`` of the
        block ``[anchor, drafts]``: the token after the accepted drafts, the target's correction
        at the first rejection or the bonus token after a wholly accepted block."""
        drafts = draft.tokens[0]
        if self.sampling.greedy:
            greedy = logits.argmax(-1)
            accepted = int((drafts == greedy[:-1]).int().cumprod(0).sum())
            return accepted, greedy[accepted : accepted + 1]
        return speculative_verify(drafts, draft.proposal, self.sampling.probabilities(logits), self.generator)

    @torch.no_grad()
    def _selector_path(self, selector, hidden: Tensor, logits: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """DFlash2's path drawn slot by slot (module docstring): int64 ``[T]`` tokens and the
        float32 ``[T, V]`` proposal of each slot (zero outside its candidates)."""
        unary, candidates = torch.topk(logits, selector.top_k, dim=-1)  # [T, K]
        predecessor, tokens, proposal = anchor, [], torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for slot in range(hidden.shape[0]):
            scores = selector.scores(
                hidden[slot : slot + 1], unary[slot : slot + 1], candidates[slot : slot + 1], predecessor
            )
            q = (scores[0].float() / self.sampling.temperature).softmax(-1)  # [K]: the temperature alone
            pick = torch.multinomial(q, 1, generator=self.generator)
            proposal[slot].scatter_(0, candidates[slot], q)
            predecessor = candidates[slot, pick]
            tokens.append(predecessor)
        return torch.cat(tokens), proposal


def speculative_verify(
    drafts: Tensor, proposal: Tensor, target: Tensor, generator: torch.Generator
) -> tuple[int, Tensor]:
    """The rejection rule of speculative sampling (module docstring) on one block.

    Args:
        drafts (Tensor): int64 ``[n]``, the drafted tokens.
        proposal (Tensor): float32 ``[n, V]``, q: the distribution each draft was drawn from.
        target (Tensor): float32 ``[n + 1, V]``, p: the target's distribution at each draft's slot
            and at the slot after the block.
        generator (torch.Generator): the random stream (on the tensors' device).

    Returns:
        tuple[int, Tensor]: the number of accepted drafts a, and the int64 ``[1]`` token that
        follows them, drawn from :func:`residual` of slot a's p and q, or from p after the block
        when a = n.
    """
    n = drafts.shape[0]
    p = target[:n].gather(-1, drafts[:, None])[:, 0]
    q = proposal.gather(-1, drafts[:, None])[:, 0]
    uniform = torch.rand(n, generator=generator, device=drafts.device)
    # u < p / q happens with probability min(1, p / q); q > 0 for every drafted token.
    accepted = int((uniform * q < p).int().cumprod(0).sum())
    following = target[n] if accepted == n else residual(target[accepted], proposal[accepted])
    return accepted, torch.multinomial(following, 1, generator=generator)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) ``[V]``: what the target must still be able to draw after rejecting a
    draft from q (Leviathan et al. 2023, Sec. 2.3). A rejection has probability
    ``sum(max(0, q - p)) = sum(max(0, p - q))``; where rounding leaves nothing, p itself is the limit."""
    rest = (p - q).clamp_min(0)
    total = rest.sum()
    return rest / total if total > 0 else p


#: The decoder of greedy decoding (it keeps no state: one serves every generation).
GREEDY_DECODER = Decoder(GREEDY, None)
