"""Decoding for ``dflash eval``: target-only decoding and speculative decoding with a DFlash
drafter, each timed, greedy or sampled (:mod:`dflash.evaluation.sampling` chooses the tokens).

One speculative step (paper Sec. 3; gpt-fast ``speculative_decode`` has the same shape):
the drafter fills a block ``[last token, MASK x (Bs-1)]`` from the target hidden states of
the verified prefix; the target verifies the block in one forward. Greedy, drafts are accepted
while they equal the target's argmax and the target's next argmax is the bonus token, so the
output is exactly the target's greedy output (:func:`target_generate`;
``tests/unit/test_evaluate.py`` checks it). Sampled, drafts are accepted by the rejection rule
of speculative sampling and the output is distributed as the target's own sampling
(``tests/unit/test_speculative_sampling.py`` checks it). Each step emits ``accepted + 1`` tokens;
the counts each step records are those of :mod:`dflash.evaluation.report`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from dflash.evaluation.sampling import Decoder
from dflash.target_model.model import Target
from dflash.target_model.rollback import StateRollback, crop, new_cache


@dataclass
class Generation:
    """Output of one generation.

    Args:
        tokens (list[int]): generated ids (prompt excluded), ending at the first EOS if any.
        accept_lengths (list[int]): per speculative step, accepted drafts + 1, cut at EOS and at
            ``max_new_tokens`` (empty for greedy); z-lab's ``acceptance_lengths`` (module docstring).
        seconds (float): wall time of the generation.
        prefill_seconds (float): the part of ``seconds`` spent on the prompt forward and the
            first token.
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # sum + 1 (prefill token) == len(tokens)
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def decode_ms_per_token(self) -> float:
        """Milliseconds per output token after prefill (z-lab's time per output token)."""
        return 1e3 * (self.seconds - self.prefill_seconds) / len(self.tokens)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def stop_token_ids(tokenizer, target_config) -> set[int]:
    """Token ids that end a generation: the tokenizer's eos and the target config's ``eos_token_id``(s)."""
    configured = getattr(target_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def target_generate(
    target: Target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_ids: set[int], decoder: Decoder
) -> Generation:
    """Decoding with the target alone, one token per forward (KV cache), each token chosen by
    ``decoder`` (the argmax, or a draw from the processed distribution).

    Args:
        prompt_ids: int64 ``[1, P]``.
    """
    _sync(target.device)
    start = time.perf_counter()
    cache = new_cache(target)
    out = target.decoder_forward(prompt_ids.to(target.device), past_key_values=cache)
    tokens, prefill_seconds = [], None
    while True:
        token = decoder.next_token(target.lm_head(out.last_hidden_state[:, -1]))  # [1]
        tokens.append(int(token))  # int() waits for the device
        if prefill_seconds is None:
            prefill_seconds = time.perf_counter() - start
        if len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            break
        out = target.decoder_forward(token[:, None], past_key_values=cache)
    _sync(target.device)
    return Generation(
        tokens=_finish(tokens, max_new_tokens, eos_ids),
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
    )


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter,
    prompt_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    decoder: Decoder,
    rollback_strategy: str = "mixers",
) -> Generation:
    """Speculative decoding: greedy, its output identical to :func:`target_generate`'s; sampled,
    distributed as it (``decoder``, module docstring).

    A hybrid target's linear-attention states are rolled back to the last kept token after each
    rejection (:mod:`dflash.target_model.rollback`); attention layers' KV is cropped.

    Args:
        drafter: an ``AnchoredDrafter`` (``draft_block``; ``block_hidden`` to sample), same device
            as the target, tapping ``target.layer_ids``.
        prompt_ids: int64 ``[1, P]``.
        decoder (Decoder): chooses, drafts and verifies the tokens.
        rollback_strategy (str): how a hybrid target's states advance past a rejection, one of
            :data:`dflash.target_model.rollback.STRATEGIES`.

    Raises:
        ValueError: the drafter taps other layers than ``target.layer_ids``.
    """
    if list(drafter.config.target_layer_ids) != target.layer_ids:
        raise ValueError(
            f"drafter taps target layers {drafter.config.target_layer_ids}, the target "
            f"was loaded with {target.layer_ids}"
        )
    block_size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    device = target.device
    _sync(device)
    start = time.perf_counter()
    cache = new_cache(target)
    out = target.decoder_forward(prompt_ids.to(device), past_key_values=cache)
    rollback = StateRollback.for_target(target, cache, rollback_strategy)
    context = target.select(out.hidden_states)  # [1, P, K*H]: states of every verified token
    last = decoder.next_token(target.lm_head(out.last_hidden_state[:, -1]))  # [1], no target state yet
    tokens, accept_lengths = [int(last)], []  # int() waits for the device
    prefill_seconds = time.perf_counter() - start
    masks = torch.full((1, block_size - 1), mask_id, dtype=torch.long, device=device)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        block = torch.cat([last[:, None], masks], dim=1)  # [1, Bs]
        draft = decoder.draft(drafter, context, target.embed_tokens(block), target.lm_head, last)
        verified = context.shape[1]
        block = torch.cat([last[:, None], draft.tokens], dim=1)
        with rollback.verifying() if rollback else contextlib.nullcontext():
            out = target.decoder_forward(block, past_key_values=cache)
        # [Bs, V]: the target's logits of the token after each slot.
        accepted, last = decoder.verify(draft, target.lm_head(out.last_hidden_state)[0])
        # Emit the accepted drafts and the token after them, but nothing past EOS or the token budget:
        # tau counts tokens the step really contributed, so sum(accept_lengths) + 1 == len(tokens).
        proposed = draft.tokens[0, :accepted].tolist() + [int(last)]
        emitted = _finish(proposed, max_new_tokens - len(tokens), eos_ids)
        tokens.extend(emitted)
        accept_lengths.append(len(emitted))
        # Keep target states/cache for the block's first token and the accepted drafts only.
        context = torch.cat([context, target.select(out.hidden_states)[:, : accepted + 1]], dim=1)
        if rollback:
            rollback.keep(block[:, : accepted + 1], verified)
        else:
            crop(cache, verified + accepted + 1)
    _sync(device)
    return Generation(
        tokens=tokens,
        accept_lengths=accept_lengths,
        seconds=time.perf_counter() - start,
        prefill_seconds=prefill_seconds,
    )
