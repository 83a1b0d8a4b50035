"""How the tokens of a generation are drawn: greedily (T = 0), or sampled at a temperature with
top-p and top-k (:class:`Sampling`). Importing it does not import torch, so ``dflash eval`` refuses
bad sampling flags before torch loads; :mod:`dflash.evaluation.sampling` drafts and verifies with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from logits.

    Args:
        temperature (float): 0 takes the argmax (greedy decoding); > 0 divides the logits by it.
        top_p (float): in (0, 1]: keep the smallest set of most likely tokens whose probability
            reaches it (nucleus sampling, Holtzman et al. 2020), 1 keeps every token.
        top_k (int): keep the k most likely tokens; 0 keeps every token.

    Raises:
        ValueError: a temperature below 0 or not finite, a ``top_p`` outside (0, 1], a negative
            ``top_k``, or ``top_p`` / ``top_k`` given with temperature 0 (greedy decoding has one
            token to take; they would be silently ignored).
    """

    temperature: float
    top_p: float
    top_k: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temperature must be 0 (greedy) or a positive number, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 keeps every token), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be 0 (every token) or a positive count, got {self.top_k}")
        filters = [f"--top-p {self.top_p:g}"] * (self.top_p < 1) + [f"--top-k {self.top_k}"] * bool(self.top_k)
        if self.greedy and filters:
            raise ValueError(
                f"{' '.join(filters)} with --temperature 0: greedy decoding takes the argmax and would ignore "
                f"{'them' if len(filters) > 1 else 'it'}; pass --temperature above 0 to sample, or leave "
                f"{' and '.join(f.split()[0] for f in filters)} unset"
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, and exact speculative verification."""
        return self.temperature == 0

    def describe(self) -> str:
        """``greedy`` or ``temperature 0.6, top-p 0.95, top-k 20`` (unset filters left out)."""
        if self.greedy:
            return "greedy"
        filters = [f"top-p {self.top_p:g}"] * (self.top_p < 1) + [f"top-k {self.top_k}"] * bool(self.top_k)
        return ", ".join([f"temperature {self.temperature:g}", *filters])

    def probabilities(self, logits):
        """float32 ``[.., V]`` probabilities of ``logits`` ``[.., V]`` (a tensor) after the temperature,
        top-k and top-p, in that order (transformers' logits warpers' order); zero where filtered."""
        import torch

        scaled = logits.float() / self.temperature
        if self.top_k and self.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # Keep a token while the mass before it is short of top_p: the most likely one always stays.
            keep = (sorted_probs.cumsum(-1) - sorted_probs) < self.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


#: Greedy decoding (temperature 0).
GREEDY = Sampling(temperature=0.0, top_p=1.0, top_k=0)
#: Seed of a held-out measurement (the prompts sampled and, above temperature 0, the tokens): ``dflash eval
#: --seed``'s default and the one seed of the acceptance ``dflash train`` measures, so the two draw alike.
SEED = 0
