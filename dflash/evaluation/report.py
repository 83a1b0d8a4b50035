"""The numbers that judge a drafter, from the generations of :mod:`dflash.evaluation.decoding`:
acceptance length tau, its histogram and the speedup, with intervals for a sample of prompts.

Each figure comes in two conventions, both reported (labelled) so results compare with ours and
with the published ones (z-lab/dflash ``benchmark.py``, whose numbers the DFlash paper reports):

- tau per step: mean of ``accepted + 1`` over all steps of all prompts, the last step of a prompt
  cut at EOS / the token budget (it counts only tokens the step really emitted).
- tau per prompt (z-lab): mean over prompts of each prompt's mean ``accepted + 1``, counted as
  z-lab/dflash's ``dflash_generate`` counts it at commit 10129599 (``dflash/model.py``): it steps
  while ``start + 1 < max_length`` and no stop token was written, records ``produced = min(accepted
  + 1, max_length - start - 1)`` cut after the first stop token, and takes no step when the
  prefill token is a stop token (nor when the budget is that token alone). Those are exactly the
  steps and cut counts of tau per step; a prompt without steps has no mean and is left out (z-lab's
  ``np.mean`` of it would be NaN). One difference remains: near the budget z-lab drafts a shorter
  last block (``verify_size = min(block_size, max_length - start)``), so with bidirectional layers
  its last drafts, and that step's count, can differ from ours, which drafts the whole block and
  cuts. (Its older loop, at 44947fb, also counted the last step uncut and ran one more step at the
  budget.)
- speedup with prefill: (target-only seconds per output token) / (speculative seconds per output
  token), whole generations, summed over prompts.
- decoding speedup (z-lab): the same ratio of per-prompt decoding time per output token, prefill
  excluded, each averaged over prompts.

Both methods run on the same prompts after a warm-up (:func:`dflash.evaluation.measure.evaluate`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from dflash.evaluation.decoding import Generation
from dflash.evaluation.sampling_settings import Sampling


@dataclass
class EvalReport:
    """Aggregate over prompts (what ``dflash eval`` prints; see the module docstring).

    Args:
        tau_per_step (float): mean emitted tokens per step, last step cut at EOS/budget.
        tau_per_prompt (float): z-lab's: mean over prompts of the per-prompt mean (module docstring).
        histogram (dict[int, int]): steps by emitted tokens (``accepted + 1``, cut), 1..block_size.
        speedup (float): target-only / speculative time per output token, prefill included.
        decode_speedup (float): the same after prefill, per-prompt times averaged (z-lab's).
        target_ms_per_token, speculative_ms_per_token (float): whole generations, prefill included.
        target_decode_ms_per_token, speculative_decode_ms_per_token (float): mean over prompts of
            the decoding time per output token.
        num_prompts, num_tokens, block_size (int): speculative output tokens over all prompts.
        temperature, top_p (float), top_k (int): how both methods chose tokens
            (:class:`dflash.evaluation.sampling.Sampling`; temperature 0 is greedy).
        intervals (dict[str, tuple[float, float]]): for a sample of the held-out prompts or a
            sampled measurement, the 95% interval of each of tau_per_step, tau_per_prompt, speedup
            and decode_speedup (:func:`bootstrap_intervals`); empty for the whole set decoded greedily.
        mismatches (int, optional): prompts whose speculative output differs from the target's greedy
            output; None when sampled (two draws of one distribution are not compared).
        dtype (str): the target's dtype during the measurement (``"float32"``, ``"bfloat16"``).
    """

    tau_per_step: float
    tau_per_prompt: float
    histogram: dict[int, int]
    speedup: float
    decode_speedup: float
    target_ms_per_token: float
    speculative_ms_per_token: float
    target_decode_ms_per_token: float
    speculative_decode_ms_per_token: float
    num_prompts: int
    num_tokens: int
    block_size: int
    temperature: float
    top_p: float
    top_k: int
    intervals: dict = field(default_factory=dict)
    mismatches: int | None = 0
    dtype: str = "float32"

    @property
    def sampling(self) -> Sampling:
        """How both methods chose tokens."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def verification_failed(self) -> bool:
        """Whether a speculative output differed from greedy decoding in float32, where verification
        is exact (in lower precision the batched verify forward may break argmax ties otherwise)."""
        return bool(self.mismatches) and self.dtype == "float32"

    def to_dict(self) -> dict:
        """The fields, and ``decoding``: how tokens were chosen, in words (``greedy``, ``temperature 1, top-p 0.9``)."""
        fields = {k: (dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in vars(self).items()}
        return {**fields, "decoding": self.sampling.describe()}


def summarize(
    plains: list[Generation], specs: list[Generation], *, block_size: int, dtype: torch.dtype, sampling: Sampling
) -> EvalReport:
    """The report of target-only (``plains``) and speculative (``specs``) generations of the same
    prompts by a target in ``dtype``, both choosing tokens by ``sampling``, in both conventions of
    the module docstring.

    A generation without steps (its prefill token was a stop token, or the whole budget) has no
    per-prompt tau and is left out of ``tau_per_prompt``; a figure with nothing to average is NaN.
    """
    lengths = [n for spec in specs for n in spec.accept_lengths]
    per_prompt = [_mean(spec.accept_lengths) for spec in specs if spec.accept_lengths]
    target_ms = 1e3 * sum(p.seconds for p in plains) / sum(len(p.tokens) for p in plains)
    spec_ms = 1e3 * sum(s.seconds for s in specs) / sum(len(s.tokens) for s in specs)
    target_decode_ms = _mean([p.decode_ms_per_token for p in plains])
    spec_decode_ms = _mean([s.decode_ms_per_token for s in specs])
    return EvalReport(
        tau_per_step=_mean(lengths),
        tau_per_prompt=_mean(per_prompt),
        histogram=dict(Counter(lengths)),
        speedup=target_ms / spec_ms,
        decode_speedup=target_decode_ms / spec_decode_ms if spec_decode_ms > 0 else float("nan"),
        target_ms_per_token=target_ms,
        speculative_ms_per_token=spec_ms,
        target_decode_ms_per_token=target_decode_ms,
        speculative_decode_ms_per_token=spec_decode_ms,
        num_prompts=len(specs),
        num_tokens=sum(len(s.tokens) for s in specs),
        block_size=block_size,
        mismatches=sum(plain.tokens != spec.tokens for plain, spec in zip(plains, specs)) if sampling.greedy else None,
        dtype=str(dtype).removeprefix("torch."),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
    )


#: Resamples of the prompts behind a sample's 95% intervals.
BOOTSTRAP_RESAMPLES = 2000


def bootstrap_intervals(
    plains: list[Generation], specs: list[Generation], *, level: float = 0.95, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap intervals (Efron & Tibshirani, "An Introduction to the Bootstrap",
    1993, ch. 13) of the figures of :func:`summarize`, resampling prompts (the unit a sample of
    the held-out set draws) :data:`BOOTSTRAP_RESAMPLES` times with ``seed``.

    Returns:
        dict: ``tau_per_step``, ``tau_per_prompt``, ``speedup``, ``decode_speedup`` -> (low, high).
    """
    import random

    # Per prompt, the sums each figure is a ratio or mean of, so a resample costs O(prompts).
    columns = {
        "emitted": [sum(s.accept_lengths) for s in specs],
        "steps": [len(s.accept_lengths) for s in specs],
        "plain_s": [p.seconds for p in plains],
        "plain_n": [len(p.tokens) for p in plains],
        "spec_s": [s.seconds for s in specs],
        "spec_n": [len(s.tokens) for s in specs],
        "plain_decode": [p.decode_ms_per_token for p in plains],
        "spec_decode": [s.decode_ms_per_token for s in specs],
    }
    per_prompt = [_mean(s.accept_lengths) if s.accept_lengths else None for s in specs]

    def figures(pick: list[int]) -> dict[str, float]:
        total = {name: sum(column[j] for j in pick) for name, column in columns.items()}
        return {
            "tau_per_step": total["emitted"] / total["steps"] if total["steps"] else float("nan"),
            "tau_per_prompt": _mean([per_prompt[j] for j in pick if per_prompt[j] is not None]),
            "speedup": (total["plain_s"] / total["plain_n"]) / (total["spec_s"] / total["spec_n"]),
            "decode_speedup": total["plain_decode"] / total["spec_decode"] if total["spec_decode"] else float("nan"),
        }

    rng = random.Random(seed)
    resamples = [figures([rng.randrange(len(specs)) for _ in specs]) for _ in range(BOOTSTRAP_RESAMPLES)]
    return {name: _quantiles([r[name] for r in resamples], level) for name in resamples[0]}


def _quantiles(values: list[float], level: float) -> tuple[float, float]:
    kept = sorted(v for v in values if v == v)  # NaN: a resample with nothing to average
    if not kept:
        return float("nan"), float("nan")
    at = lambda q: kept[min(len(kept) - 1, int(q * len(kept)))]
    return at((1 - level) / 2), at((1 + level) / 2)


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")
