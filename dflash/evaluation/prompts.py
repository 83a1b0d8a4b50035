"""The held-out prompts ``dflash eval`` and the trainer's held-out measurement decode: the
messages of each held-out conversation before its first assistant turn, rendered with the
target's chat template, those that fit the target's context with the tokens to generate."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.data.chats import DatasetError, prompt_messages, read_conversations
from dflash.data.tokenize import TemplateRejected, cut_to_budget, encode, render_chat
from dflash.evaluation.sampling_settings import SEED


@dataclass
class HeldOutPrompts:
    """The prompts :func:`load_prompts` took from a held-out file, and what it left out.

    Args:
        source (Path): the JSONL file.
        prompts (list[torch.Tensor]): int64 ``[1, P]`` each, ``P <= max_prompt_tokens``, in file order.
        requested (int, optional): prompts asked for (``--num-prompts``); None: every usable one.
        context (int): the target's ``max_position_embeddings``.
        max_new_tokens (int): tokens each prompt is continued by.
        too_long (int): conversations skipped for a prompt over ``max_prompt_tokens`` tokens.
        without_prompt (int): conversations skipped for no user turn before an assistant turn, or
            a prompt the target's chat template rejects.
        usable (int): usable prompts in the file; ``prompts`` is a random sample of them when fewer.
        messages (list): the messages of each prompt (:func:`dflash.data.chats.prompt_messages`), as ``prompts``.
    """

    source: Path
    prompts: list[torch.Tensor]
    requested: int | None
    context: int
    max_new_tokens: int
    too_long: int = 0
    without_prompt: int = 0
    usable: int = 0
    messages: list = field(default_factory=list)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt whose generation stays within the target's context."""
        return self.context - self.max_new_tokens

    @property
    def sampled(self) -> bool:
        """Whether the prompts are a sample of the usable ones (not all of them)."""
        return len(self.prompts) < self.usable

    def to_dict(self) -> dict:
        return {
            "source": str(self.source),
            "requested": self.requested,
            "used": len(self.prompts),
            "usable": self.usable,
            "max_prompt_tokens": self.max_prompt_tokens,
            "skipped_too_long": self.too_long,
            "skipped_without_prompt": self.without_prompt,
        }


def load_prompts(
    tokenizer, path: str | Path, *, num_prompts: int | None, context: int, max_new_tokens: int, seed: int = SEED
) -> HeldOutPrompts:
    """The usable prompts of held-out conversations, all of them or a random sample of
    ``num_prompts`` (drawn with ``seed``, kept in file order): the messages before the first
    assistant turn, rendered with the chat template and its generation prompt.

    A prompt is usable when its rendered length plus ``max_new_tokens`` fits the target's
    ``context`` (positions past ``max_position_embeddings`` make tau and speedup meaningless).
    As in training (:mod:`dflash.data.tokenize`), a prompt with more content than
    :func:`dflash.data.tokenize.char_budget` of that limit is surely too long and skipped unrendered, so
    the work per conversation is bounded (a huge one costs nothing).

    Raises:
        ValueError: ``max_new_tokens`` leaves no room for a prompt in ``context``.
        DatasetError: unreadable file (see :func:`dflash.data.chats.read_conversations`), or no
            usable prompt (the message says why and the fix).
    """
    import random

    held_out = HeldOutPrompts(Path(path), [], num_prompts, context, max_new_tokens)
    limit = held_out.max_prompt_tokens
    if limit < 1:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context} tokens (max_position_embeddings); pass --max-new-tokens below {context}"
        )
    for conversation in read_conversations(path):
        messages = prompt_messages(conversation)
        if messages is None:
            held_out.without_prompt += 1
            continue
        if cut_to_budget(messages, limit)[1]:  # surely over the limit: never rendered whole
            held_out.too_long += 1
            continue
        try:
            text = render_chat(tokenizer, messages, add_generation_prompt=True)
        except TemplateRejected:
            held_out.without_prompt += 1
            continue
        ids = encode(tokenizer, text)["input_ids"]
        if len(ids) > limit:
            held_out.too_long += 1
            continue
        held_out.prompts.append(torch.tensor([ids]))
        held_out.messages.append(messages)
    if not held_out.prompts:
        raise DatasetError(f"{path}: no usable prompt: {_why_none(held_out)}")
    held_out.usable = len(held_out.prompts)
    if num_prompts is not None and num_prompts < held_out.usable:
        keep = sorted(random.Random(seed).sample(range(held_out.usable), num_prompts))
        held_out.prompts = [held_out.prompts[i] for i in keep]
        held_out.messages = [held_out.messages[i] for i in keep]
    return held_out


def _why_none(held_out: HeldOutPrompts) -> str:
    """Why no prompt was usable, and the fix (one line)."""
    reasons, wanted = [], []
    if held_out.too_long:
        reasons.append(
            f"{held_out.too_long} prompts are longer than {held_out.max_prompt_tokens} tokens (the target's "
            f"max_position_embeddings {held_out.context} minus --max-new-tokens {held_out.max_new_tokens})"
        )
        wanted.append("shorter conversations")
    if held_out.without_prompt:
        reasons.append(
            f"{held_out.without_prompt} conversations have no user turn before an assistant turn "
            "(or one the chat template rejects)"
        )
        wanted.append("conversations that have a user turn before an assistant turn")
    fix = f"pass --data with {' and '.join(wanted)}"
    return f"{' and '.join(reasons)}; " + (f"lower --max-new-tokens, or {fix}" if held_out.too_long else fix)
