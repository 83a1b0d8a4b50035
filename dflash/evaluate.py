"""Greedy (T=0) speculative decoding with a DFlash drafter against its target, and the
numbers that judge a drafter: acceptance length tau, its histogram and the speedup.

One speculative step (paper Sec. 3; gpt-fast ``speculative_decode`` has the same shape):
the drafter fills a block ``[last token, MASK x (Bs-1)]`` from the target hidden states of
the verified prefix; the target verifies the block in one forward; drafts are accepted while
they equal the target's argmax, and the target's next argmax is the bonus token. Each step
therefore emits ``accepted + 1`` tokens, and the output is exactly the target's greedy output
(:func:`greedy_generate`; ``tests/test_evaluate.py`` checks it).

tau = mean of ``accepted + 1`` over steps; speedup = (target-only seconds per output token) /
(speculative seconds per output token), both timed on the same prompts after a warm-up.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.target import Target

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """Output of one generation.

    Args:
        tokens (list[int]): generated ids (prompt excluded), ending at the first EOS if any.
        accept_lengths (list[int]): per speculative step, accepted drafts + 1, cut at EOS and at
            ``max_new_tokens`` (empty for greedy).
        seconds (float): wall time of the generation.
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # sum + 1 (prefill token) == len(tokens)
    seconds: float = 0.0


@dataclass
class EvalReport:
    """Aggregate over prompts (what ``dflash eval`` prints)."""

    tau: float
    histogram: dict[int, int]
    speedup: float
    target_ms_per_token: float
    speculative_ms_per_token: float
    num_prompts: int
    num_tokens: int
    block_size: int

    def to_dict(self) -> dict:
        return {k: (dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in vars(self).items()}


def _crop(cache, keep: int) -> None:
    # DynamicCache.crop(-n) drops the last n tokens in transformers 4.x and 5.x alike.
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_generate(target: Target, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """Plain greedy decoding with the target alone, one token per forward (KV cache).

    Args:
        prompt_ids: int64 ``[1, P]``.
    """
    from transformers import DynamicCache

    _sync(target.device)
    start = time.perf_counter()
    cache = DynamicCache()
    out = target.decoder_forward(prompt_ids.to(target.device), past_key_values=cache)
    tokens = []
    while True:
        token = target.lm_head(out.last_hidden_state[:, -1]).argmax(-1)  # [1]
        tokens.append(int(token))
        if len(tokens) >= max_new_tokens or tokens[-1] in eos_ids:
            break
        out = target.decoder_forward(token[:, None], past_key_values=cache)
    _sync(target.device)
    return Generation(tokens=_finish(tokens, max_new_tokens, eos_ids), seconds=time.perf_counter() - start)


@torch.no_grad()
def speculative_generate(
    target: Target, drafter, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_ids: set[int]
) -> Generation:
    """Greedy speculative decoding; output identical to :func:`greedy_generate`.

    Args:
        drafter: a ``DFlashDraftModel`` (``draft_block``), same device as the target, tapping
            ``target.layer_ids``.
        prompt_ids: int64 ``[1, P]``.

    Raises:
        ValueError: the drafter taps other layers than ``target.layer_ids``.
    """
    from transformers import DynamicCache

    if list(drafter.config.target_layer_ids) != target.layer_ids:
        raise ValueError(
            f"drafter taps target layers {drafter.config.target_layer_ids}, the target "
            f"was loaded with {target.layer_ids}"
        )
    block_size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    device = target.device
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache()
    out = target.decoder_forward(prompt_ids.to(device), past_key_values=cache)
    context = target.select(out.hidden_states)  # [1, P, K*H]: states of every verified token
    last = target.lm_head(out.last_hidden_state[:, -1]).argmax(-1)  # [1], no target state yet
    tokens, accept_lengths = [int(last)], []
    masks = torch.full((1, block_size - 1), mask_id, dtype=torch.long, device=device)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        block = torch.cat([last[:, None], masks], dim=1)  # [1, Bs]
        draft = drafter.draft_block(context, target.embed_tokens(block), target.lm_head)  # [1, Bs-1]
        verified = context.shape[1]
        out = target.decoder_forward(torch.cat([last[:, None], draft], dim=1), past_key_values=cache)
        greedy = target.lm_head(out.last_hidden_state).argmax(-1)[0]  # [Bs]: next token after each slot
        matches = (draft[0] == greedy[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        # Emit the accepted drafts and the bonus token, but nothing past EOS or the token budget:
        # tau counts tokens the step really contributed, so sum(accept_lengths) + 1 == len(tokens).
        emitted = _finish(draft[0, :accepted].tolist() + [int(greedy[accepted])], max_new_tokens - len(tokens), eos_ids)
        tokens.extend(emitted)
        accept_lengths.append(len(emitted))
        # Keep target states/cache for the block's first token and the accepted drafts only.
        context = torch.cat([context, target.select(out.hidden_states)[:, : accepted + 1]], dim=1)
        _crop(cache, verified + accepted + 1)
        last = greedy[accepted : accepted + 1]
    _sync(device)
    return Generation(tokens=tokens, accept_lengths=accept_lengths, seconds=time.perf_counter() - start)


def load_drafter(path: str | Path, *, device: torch.device, dtype: torch.dtype):
    """Load a drafter from a run directory, its ``checkpoints/`` or a step directory (verified
    against its manifest), in ``dtype`` on ``device``, with SDPA attention.

    Raises:
        CheckpointError: see :func:`dflash.checkpoint.find_checkpoint`.
    """
    from dflash.checkpoint import find_checkpoint
    from dflash.model import DFlashDraftModel

    step_dir = find_checkpoint(path)
    drafter = DFlashDraftModel.from_pretrained(step_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    logger.info(
        "drafter %s: %d layers, block size %d, taps target layers %s",
        step_dir,
        drafter.config.num_hidden_layers,
        drafter.config.block_size,
        drafter.config.target_layer_ids,
    )
    return drafter.to(device).eval()


def load_prompts(tokenizer, path: str | Path, *, num_prompts: int) -> list[torch.Tensor]:
    """Prompts from held-out conversations: the messages before the first assistant turn,
    rendered with the chat template and its generation prompt. Returns int64 ``[1, P]`` each.

    Raises:
        DatasetError: unreadable file (see :func:`dflash.data.read_conversations`) or no
            conversation with a prompt before an assistant turn.
    """
    from dflash.data import DatasetError, prompt_messages, read_conversations

    prompts = []
    for conversation in read_conversations(path):
        messages = prompt_messages(conversation)
        if messages is None:
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise DatasetError(f"{path}: no conversation has a user turn before an assistant turn to use as a prompt")
    return prompts


def evaluate(
    target: Target,
    drafter,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    progress: bool = False,
) -> EvalReport:
    """Run target-only greedy and speculative decoding on every prompt and compare.

    The first prompt is run once untimed by both methods as a warm-up. Each speculative output
    is checked against the greedy one. A mismatch is an error in float32 (verification must be
    exact there) and a warning in bf16, where the batched verify forward and one-token decoding
    round differently and can break argmax ties.
    """
    from tqdm import tqdm

    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    greedy_generate(target, prompts[0], **kwargs)
    speculative_generate(target, drafter, prompts[0], **kwargs)
    greedy_s = spec_s = 0.0
    greedy_tokens = spec_tokens = mismatches = 0
    lengths: list[int] = []
    for prompt in tqdm(prompts, desc="eval", disable=not progress):
        plain = greedy_generate(target, prompt, **kwargs)
        spec = speculative_generate(target, drafter, prompt, **kwargs)
        mismatches += plain.tokens != spec.tokens
        greedy_s, greedy_tokens = greedy_s + plain.seconds, greedy_tokens + len(plain.tokens)
        spec_s, spec_tokens = spec_s + spec.seconds, spec_tokens + len(spec.tokens)
        lengths += spec.accept_lengths
    if mismatches and target.dtype == torch.float32:
        logger.error(
            "%d/%d speculative outputs differ from the target's greedy output in float32: "
            "a bug in verification, please report it",
            mismatches,
            len(prompts),
        )
    elif mismatches:
        logger.warning(
            "%d/%d speculative outputs differ from the target's greedy output: in %s the "
            "batched verify forward and one-token decoding round differently and can break "
            "argmax ties; rerun with float32 to check exactness",
            mismatches,
            len(prompts),
            target.dtype,
        )
    target_ms, spec_ms = 1e3 * greedy_s / greedy_tokens, 1e3 * spec_s / spec_tokens
    return EvalReport(
        tau=sum(lengths) / max(len(lengths), 1),
        histogram=dict(Counter(lengths)),
        speedup=target_ms / spec_ms,
        target_ms_per_token=target_ms,
        speculative_ms_per_token=spec_ms,
        num_prompts=len(prompts),
        num_tokens=spec_tokens,
        block_size=drafter.config.block_size,
    )
