"""Conversations tokenized with the target's chat template and an assistant-only loss mask.

Each conversation is rendered once with the target tokenizer's chat template (tools and tool calls
passed to it, :mod:`dflash.data.tool_calls`); the loss mask marks the tokens of assistant turns
(content, tool calls, and the end-of-turn marker, so the drafter learns to stop). A conversation
whose tool use the template does not render is skipped and counted. The spans are found by rendering the conversation
prefix up to each assistant turn (with and without the generation prompt) and matching it
against the full rendering, then mapping characters to tokens through the tokenizer's offset
mapping; templates that rewrite earlier turns (Qwen3 drops old reasoning) fall back to
locating the turn's content text (its answer alone when the template drops the reasoning before
``</think>``). ``{% generation %}`` markers are not needed.

Length policy (``overflow``): ``"truncate"`` keeps the first ``seq_len`` tokens, ``"drop"``
skips longer conversations. Conversations left with fewer than two supervised tokens (no
possible anchor, see ``docs/dflash.md``: an anchor needs ``loss_mask[a]`` and
``loss_mask[a + 1]``) are skipped; the counts are logged.

Bounded work per conversation: it is cut to its first ``seq_len * MAX_CHARS_PER_TOKEN``
characters of content and ``seq_len`` messages before it is rendered and tokenized: no real
tokenizer averages more than ``MAX_CHARS_PER_TOKEN`` characters per token, and every rendered
message is at least one token, so the first ``seq_len`` tokens are all inside the cut and a
conversation that needed the cut is over ``seq_len`` tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.choices import check_choice
from dflash.config import Overflow
from dflash.data.chats import Conversation, DatasetError
from dflash.data.tool_calls import unrendered

logger = logging.getLogger(__name__)

#: Generous bound on the characters per token of real tokenizers (English averages ~4).
MAX_CHARS_PER_TOKEN = 32
# Show a progress bar from this many conversations on (fewer take a second or two).
_PROGRESS_CONVERSATIONS = 5000


class TemplateRejected(DatasetError):
    """The target's chat template refuses a conversation (e.g. roles that do not alternate), or
    leaves out its tool calls or tools."""


@dataclass(frozen=True)
class Example:
    """One tokenized conversation.

    Args:
        input_ids (list[int]): token ids of the rendered conversation, length <= seq_len.
        loss_mask (list[int]): 1 on assistant tokens (trained on), 0 elsewhere; same length.
    """

    input_ids: list[int]
    loss_mask: list[int]


def render_chat(tokenizer, messages, *, add_generation_prompt: bool) -> str:
    """``messages`` rendered with the target's chat template, with the tools they offer
    (:class:`Conversation`) as its ``tools``.

    Raises:
        TemplateRejected: the template raises on them (jinja's ``raise_exception``, or an error
            of transformers' own: both name the reason).
    """
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=getattr(messages, "tools", None),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # jinja2.TemplateError and transformers' ValueErrors alike
        raise TemplateRejected(f"the target's chat template rejects it: {e}") from None


def assistant_char_spans(tokenizer, conversation: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``conversation`` and return ``(text, spans)``: the character spans
    ``[start, end)`` of each assistant turn inside ``text``.

    A turn starts where the rendering of the prefix with the generation prompt ends and
    stops where the rendering of the prefix including the turn ends (so the end-of-turn
    marker is included). When the template is not prefix-stable, the turn's content is
    located by text search instead, from where the prefix ends when that renders as in ``text``,
    and followed by the end-of-turn marker that the prefix rendering puts after it.

    Raises:
        DatasetError: the template is not prefix-stable and the content cannot be found.
    """
    text = render_chat(tokenizer, conversation, add_generation_prompt=False)
    spans, cursor = [], 0
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        # An assistant turn that opens the conversation has no prefix to render: found by search.
        before = render_chat(tokenizer, conversation[:i], add_generation_prompt=True) if i else None
        through = render_chat(tokenizer, conversation[: i + 1], add_generation_prompt=False) if i else None
        if i and text.startswith(before) and text.startswith(through) and len(through) > len(before):
            start, end = len(before), len(through)
        else:
            # Where the prefix still renders as in the full text, the turn starts after it: a search
            # from the last span would find the answer in a user turn that quotes it.
            after = _prefix_end(tokenizer, conversation[:i], text, before) if i else cursor
            start, end = _find_turn(text, message["content"], max(cursor, after))
            if start < 0:
                raise DatasetError(
                    f"assistant turn {i} not found in the rendered chat template; the tokenizer's "
                    "template rewrites message content, so the loss mask cannot be derived"
                )
            turn = through[len(before) :] if through and through.startswith(before) else through
            end += len(_end_of_turn(text, start, end, turn))
        spans.append((start, end))
        cursor = end
    reason = unrendered(conversation, getattr(conversation, "tools", None), text, spans)
    if reason:
        raise TemplateRejected(f"the target's chat template {reason}")
    return text, spans


def _prefix_end(tokenizer, prefix: Sequence[dict[str, str]], text: str, before: str) -> int:
    """Where the rendering of ``prefix`` ends in ``text``: with the generation prompt when ``text`` has
    it there, else without it (DeepSeek-R1's prompt opens the reply with ``<think>\\n``, which the
    rendered turn lacks); 0 when ``text`` rewrites the prefix itself."""
    if text.startswith(before):
        return len(before)
    bare = render_chat(tokenizer, prefix, add_generation_prompt=False)
    return len(bare) if text.startswith(bare) else 0


def _find_turn(text: str, content: str, cursor: int) -> tuple[int, int]:
    """``(start, end)`` of an assistant turn's content in ``text`` from ``cursor`` on; start -1 if absent.

    Reasoning templates (Qwen3, QwQ, DeepSeek-R1) render an earlier turn without the reasoning that
    ends at its ``</think>``: such a turn is found, and trained on, by its answer alone."""
    start = text.find(content, cursor)
    if start < 0 and "</think>" in content:
        content = content.rsplit("</think>", 1)[1].strip()
        start = text.find(content, cursor)
    return start, start + len(content)


def _end_of_turn(text: str, start: int, end: int, turn: str | None) -> str:
    """The end-of-turn marker that follows a turn found at ``text[start:end]``: what ``turn`` (the turn
    as the prefix rendered up to it renders it) has after the turn's text, when ``text`` has it there
    too; else "". Qwen3 renders a turn that is last differently (an empty think block), so prefix
    matching fails for every earlier turn, but its ``<|im_end|>`` is the same: the drafter learns to
    stop. A turn with no text (tool calls alone) gets the longest tail of ``turn`` that ``text`` has
    at ``end``: its calls and the marker (Qwen3: ``<tool_call>...</tool_call><|im_end|>``)."""
    found = text[start:end]
    if not found:
        return next((turn[k:] for k in range(len(turn or "")) if text.startswith(turn[k:], end)), "")
    at = turn.rfind(found) if turn else -1
    marker = turn[at + len(found) :] if at >= 0 else ""
    return marker if marker and text.startswith(marker, end) else ""


def encode(tokenizer, text: str, **kwargs):
    """``tokenizer(text, add_special_tokens=False, **kwargs)`` for text this module measures or
    truncates itself: transformers' "Token indices sequence length is longer than the specified
    maximum ... indexing errors" warning (``verbose``) is about feeding the whole sequence to the
    model, which never happens to these ids."""
    return tokenizer(text, add_special_tokens=False, verbose=False, **kwargs)


def padding_id(tokenizer) -> int:
    """The token that pads a batch: the tokenizer's pad token, else its eos token (many ship no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def char_budget(max_tokens: int) -> int:
    """Characters of content that surely hold ``max_tokens`` tokens (module docstring)."""
    return max_tokens * MAX_CHARS_PER_TOKEN


def cut_to_budget(conversation: Conversation, max_tokens: int) -> tuple[Conversation, bool]:
    """``(messages, cut)``: the conversation's first :func:`char_budget` characters of content (the
    tools' schemas and tool calls counted as their JSON text) and first ``max_tokens`` messages;
    ``cut`` says whether anything was left out (then the whole conversation is over ``max_tokens``
    tokens). A message of tool calls is kept whole or not at all; no message is kept when the
    tools alone are over the budget."""
    tools = getattr(conversation, "tools", None)
    budget, kept = char_budget(max_tokens) - (len(json.dumps(tools)) if tools else 0), []
    for message in conversation[:max_tokens]:
        size = len(message["content"]) + (len(json.dumps(message["tool_calls"])) if "tool_calls" in message else 0)
        if size >= budget:
            if "tool_calls" not in message and budget > 0:
                kept.append({**message, "content": message["content"][:budget]})
            return Conversation(kept, tools), True
        budget -= size
        kept.append(message)
    return Conversation(kept, tools), len(conversation) > max_tokens


def tokenize_conversation(
    tokenizer, conversation: Sequence[dict[str, str]], *, max_chars: int | None = None
) -> Example:
    """Tokenize a conversation with the target's chat template and mark assistant tokens.

    A token is supervised when its first character lies in an assistant span. Needs a fast
    tokenizer (offset mapping). ``max_chars``: tokenize only that many characters of the
    rendered text (for a conversation :func:`cut_to_budget` cut, so the template's closing
    marker of the cut message is left out).

    Raises:
        DatasetError: see :func:`assistant_char_spans`; the tokenizer has no offsets.
    """
    text, spans = assistant_char_spans(tokenizer, conversation)
    try:
        encoded = encode(tokenizer, text[:max_chars], return_offsets_mapping=True)
    except NotImplementedError as e:
        raise DatasetError("the target tokenizer has no offset mapping; use a fast tokenizer (tokenizer.json)") from e
    mask = [0] * len(encoded["input_ids"])
    span_iter = iter(spans)
    span = next(span_iter, None)
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        while span is not None and start >= span[1]:
            span = next(span_iter, None)
        if span is not None and span[0] <= start < span[1] and end > start:
            mask[t] = 1
    return Example(input_ids=list(encoded["input_ids"]), loss_mask=mask)


@dataclass
class Tokenized:
    """Examples of a run of conversations, and the counts of what was left out (one log line).

    Args:
        examples (list[Example]): the usable conversations' examples, in order.
        conversations (int): conversations tokenized.
        too_long (int): longer than ``seq_len`` (truncated or dropped).
        unsupervised (int): skipped without two consecutive assistant tokens.
        short_cuts (int): cut for their characters but under ``seq_len`` tokens.
        rejected (int): skipped because the chat template rejects them or leaves out their tool use.
        first_rejected (str): the first of those, and why ("" if none).
    """

    examples: list[Example]
    conversations: int = 0
    too_long: int = 0
    unsupervised: int = 0
    short_cuts: int = 0
    rejected: int = 0
    first_rejected: str = ""

    @classmethod
    def joined(cls, parts: Sequence[Tokenized]) -> Tokenized:
        """The parts of consecutive runs of conversations, in order, as one."""
        counts = ("conversations", "too_long", "unsupervised", "short_cuts", "rejected")
        return cls(
            [example for part in parts for example in part.examples],
            **{name: sum(getattr(part, name) for part in parts) for name in counts},
            first_rejected=next((part.first_rejected for part in parts if part.first_rejected), ""),
        )


def tokenize_conversations(
    tokenizer, conversations, *, seq_len: int, overflow: str, source: str, first: int = 1, bar=None
) -> Tokenized:
    """Tokenize conversations and apply the length policy (module docstring); ``first`` is the
    1-based index in ``source`` of the first (for messages), ``bar`` a progress bar to advance.

    Raises:
        DatasetError: a conversation's loss mask cannot be derived (names its index in ``source``).
    """
    done = Tokenized([], conversations=len(conversations))
    for index, conversation in enumerate(conversations, start=first):
        if bar is not None:
            bar.update(1)
        kept, cut = cut_to_budget(conversation, seq_len)
        if cut and (overflow == "drop" or not kept):  # nothing kept: the tools alone are over seq_len
            done.too_long += 1
            continue
        try:
            example = tokenize_conversation(tokenizer, kept, max_chars=char_budget(seq_len) if cut else None)
        except TemplateRejected as e:
            done.rejected += 1
            done.first_rejected = done.first_rejected or f"conversation {index}: {e}"
            logger.debug("%s: conversation %d skipped: %s", source, index, e)
            continue
        except DatasetError as e:
            raise DatasetError(f"{source}: conversation {index}: {e}") from None
        if cut and len(example.input_ids) < seq_len:
            done.short_cuts += 1
        if cut or len(example.input_ids) > seq_len:
            done.too_long += 1
            if overflow == "drop":
                continue
            example = Example(example.input_ids[:seq_len], example.loss_mask[:seq_len])
        if not _has_anchor(example.loss_mask):
            done.unsupervised += 1
            logger.debug("%s: conversation %d skipped: no two consecutive assistant tokens", source, index)
            continue
        done.examples.append(example)
    return done


def usable_examples(tokenized: Tokenized, *, seq_len: int, overflow: str, source: str) -> list[Example]:
    """``tokenized.examples``, after logging what was left out (one line, and a warning each for
    conversations cut short or skipped by the chat template).

    Raises:
        DatasetError: no usable conversation is left (names ``source``).
    """
    logger.info(
        "%s: %d conversations, %d longer than seq_len=%d (%s), %d skipped without two "
        "consecutive assistant tokens (within seq_len, for the longer ones), %d kept",
        source,
        tokenized.conversations,
        tokenized.too_long,
        seq_len,
        "truncated" if overflow == "truncate" else "dropped",
        tokenized.unsupervised,
        len(tokenized.examples),
    )
    if tokenized.too_long * 2 > tokenized.conversations:
        logger.warning(
            "%s: %d of %d conversations are longer than --seq-len %d and were %s: a longer --seq-len (up to "
            "the target's context) trains on more of them",
            source,
            tokenized.too_long,
            tokenized.conversations,
            seq_len,
            "cut to it (what follows is not trained on)" if overflow == "truncate" else "dropped",
        )
    if tokenized.short_cuts:
        logger.warning(
            "%s: %d conversations averaged over %d characters per token in their first %d characters, "
            "so they were kept shorter than seq_len=%d (runs of one repeated character?)",
            source,
            tokenized.short_cuts,
            MAX_CHARS_PER_TOKEN,
            char_budget(seq_len),
            seq_len,
        )
    if tokenized.rejected:
        logger.warning(
            "%s: %d conversations skipped: the target's chat template rejects them or leaves out their tool use "
            "(first: %s)",
            source,
            tokenized.rejected,
            tokenized.first_rejected,
        )
    if not tokenized.examples:
        raise DatasetError(f"{source}: no conversation left to train on: {_why_none(tokenized, seq_len, overflow)}")
    return tokenized.examples


def _why_none(tokenized: Tokenized, seq_len: int, overflow: str) -> str:
    """Why no conversation of ``tokenized`` is usable, each reason with its count and its fix."""
    reasons = []
    if tokenized.unsupervised:
        reasons.append(
            f"{tokenized.unsupervised} have no assistant reply of at least two tokens within --seq-len {seq_len} "
            "(each needs an assistant turn after its prompt: only system or user turns train nothing)"
        )
    if tokenized.too_long and overflow == "drop":
        reasons.append(
            f"{tokenized.too_long} are longer than --seq-len {seq_len} and were dropped (raise --seq-len, or pass "
            "--overflow truncate)"
        )
    if tokenized.rejected:
        reasons.append(
            f"{tokenized.rejected} were rejected by the target's chat template or had their tool use left out "
            f"(first: {tokenized.first_rejected}; write their roles and tool calls as the template renders them)"
        )
    return "; ".join(reasons) or f"the file holds {tokenized.conversations} conversations"


def tokenizing_bar(total: int, *, source: str, progress: bool, initial: int = 0):
    """The progress bar of tokenizing ``total`` conversations of ``source`` (shown from 5000 on
    unless ``progress`` is off; without it a line says the work started)."""
    from tqdm import tqdm

    if total >= _PROGRESS_CONVERSATIONS and not progress:  # minutes of silence otherwise
        logger.info("%s: tokenizing %d conversations", source, total - initial)
    return tqdm(
        total=total,
        initial=initial,
        desc=f"tokenizing {Path(source).name}",
        unit="conv",
        disable=not progress or total < _PROGRESS_CONVERSATIONS,
    )


def build_examples(
    tokenizer, conversations, *, seq_len: int, overflow: str = "truncate", source: str = "data", progress: bool = True
) -> list[Example]:
    """Tokenize conversations and apply the length policy (module docstring), in this process
    (:mod:`dflash.data.token_cache` caches and parallelises it for training runs).

    At most ``seq_len * MAX_CHARS_PER_TOKEN`` characters of each conversation are rendered and
    tokenized, so a huge conversation costs no more than one of that size. From 5000
    conversations on a progress bar is shown unless ``progress`` is off.

    Raises:
        ValueError: unknown ``overflow``.
        DatasetError: no usable conversation is left (names ``source``), or a conversation's
            loss mask cannot be derived (names its 1-based index in ``source``).
    """
    check_choice("overflow", overflow, Overflow)
    with tokenizing_bar(len(conversations), source=source, progress=progress) as bar:
        tokenized = tokenize_conversations(
            tokenizer, conversations, seq_len=seq_len, overflow=overflow, source=source, bar=bar
        )
    return usable_examples(tokenized, seq_len=seq_len, overflow=overflow, source=source)


def check_token_ids(examples: Sequence[Example], *, vocab_size: int, source: str) -> None:
    """Every token id of ``examples`` is a row of the target's embedding (``< vocab_size``).

    Raises:
        DatasetError: an id past it (a tokenizer with tokens the model was never resized for),
            naming the largest id, how many examples hold such ids, and ``source``.
    """
    past = [max(example.input_ids) for example in examples if max(example.input_ids, default=0) >= vocab_size]
    if past:
        raise DatasetError(
            f"{source}: token id {max(past)} is past the target's embedding of {vocab_size} rows "
            f"(vocab_size in its config.json; {len(past)} of {len(examples)} tokenized conversations hold such "
            "ids): the tokenizer in the target directory has tokens the model was not resized for; use the "
            "tokenizer the model was trained with, or resize the model's embeddings"
        )


def _has_anchor(mask: Sequence[int]) -> bool:
    return any(a and b for a, b in zip(mask, mask[1:]))
