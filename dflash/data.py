"""Chat data for drafter training: JSONL reading, chat-template rendering with an
assistant-only loss mask, fixed-shape batches and a resumable, rank-sharded sampler.

Input: one JSON object per line, either OpenAI style ``{"messages": [{"role", "content"}]}``
or ShareGPT style ``{"conversations": [{"from", "value"}]}`` (roles ``human``/``gpt`` map to
``user``/``assistant``), with tool calls, tool results and the tools offered in either's shape
(:mod:`dflash.tool_calls`). Each conversation is rendered once with the target tokenizer's chat
template (tools and tool calls passed to it); the loss mask marks the tokens of assistant turns
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

Bounded work per line: a raw line over ``MAX_LINE_BYTES`` is an error naming it, found before
the line is parsed. A conversation is cut to its first ``seq_len * MAX_CHARS_PER_TOKEN``
characters of content and ``seq_len`` messages before it is rendered and tokenized: no real
tokenizer averages more than ``MAX_CHARS_PER_TOKEN`` characters per token, and every rendered
message is at least one token, so the first ``seq_len`` tokens are all inside the cut and a
conversation that needed the cut is over ``seq_len`` tokens.

Batches are right-padded to a fixed ``seq_len`` so compiled code sees one shape. A row holds
one conversation, or with packing (:mod:`dflash.packing`) several, each a *document* with its
own ``document_ids`` and ``position_ids`` restarting at 0, so that the target, the anchors, the
labels and the DFlash mask treat each as if it were alone (:mod:`dflash.masks`).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.tool_calls import ToolCallError, function_call_turn, message_tool_calls, record_tools, unrendered

logger = logging.getLogger(__name__)

# Role spellings seen in public chat corpora, mapped to the chat-template roles.
_ROLE_ALIASES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system turn
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",  # LLaMA-Factory's ShareGPT name for a tool result
    "function": "tool",  # OpenAI's deprecated role for a function_call's result
}
#: LLaMA-Factory's ShareGPT role of an assistant turn of tool calls (its value: the calls as JSON).
_FUNCTION_CALL_ROLE = "function_call"
# Leading bytes of the binary files chat corpora ship in, with the command that makes JSONL of them
# ({path}, {out}: shell-quoted source and suggested output).
_BINARY_FORMATS = {
    b"\x1f\x8b": ("gzip-compressed", "gunzip -c {path} > {out}"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "zstd -dc {path} > {out}"),
    b"\xfd7zXZ\x00": ("xz-compressed", "xz -dc {path} > {out}"),
    b"BZh": ("bzip2-compressed", "bzip2 -dc {path} > {out}"),
    b"PAR1": (
        "Parquet",
        "python -c \"import datasets; datasets.Dataset.from_parquet('{path}').to_json('{out}')\"",
    ),
}
# Fields of public chat formats that change what the target sees (reasoning kept apart from the content) or
# what is trained on (OpenAI's per-message weight 0), with the value that changes nothing: they are not passed
# to the template.
_UNRENDERED_MESSAGE_KEYS = {"reasoning_content": None, "weight": 1}
OVERFLOW_POLICIES = ("truncate", "drop")
#: Longest raw JSONL line read (bytes): 4M+ tokens, more than any --seq-len keeps.
MAX_LINE_BYTES = 16 << 20
#: Generous bound on the characters per token of real tokenizers (English averages ~4).
MAX_CHARS_PER_TOKEN = 32
# Show progress bars from these sizes on (smaller inputs take a second or two).
_PROGRESS_BYTES = 64 << 20
_PROGRESS_CONVERSATIONS = 5000
#: Bad lines reported in one error; reading stops at this many (a file of another format fails on every line).
MAX_BAD_LINES = 20


class DatasetError(ValueError):
    """A data file that cannot be used, with the file, line and what was expected."""


class TemplateRejected(DatasetError):
    """The target's chat template refuses a conversation (e.g. roles that do not alternate), or
    leaves out its tool calls or tools."""


class Conversation(list):
    """A conversation: its messages (a list of ``{"role", "content"}`` dicts, assistant turns with
    ``tool_calls``, tool results with ``tool_call_id``), and the tools it offers.

    A list, so slicing and indexing work as on the messages; a slice or a concatenation keeps
    ``tools`` (a prefix is rendered with the tools the whole conversation offers).

    Args:
        messages: the messages.
        tools (list[dict], optional): ``{"type": "function", "function": schema}`` each, for the
            chat template's ``tools`` argument; None: no tools.
    """

    def __init__(self, messages=(), tools: list[dict] | None = None) -> None:
        super().__init__(messages)
        self.tools = tools

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return Conversation(item, self.tools) if isinstance(index, slice) else item

    def __add__(self, other):
        return Conversation([*self, *other], self.tools)


@dataclass(frozen=True)
class Example:
    """One tokenized conversation.

    Args:
        input_ids (list[int]): token ids of the rendered conversation, length <= seq_len.
        loss_mask (list[int]): 1 on assistant tokens (trained on), 0 elsewhere; same length.
    """

    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Batch:
    """A fixed-shape training batch of right-padded rows; a row holds one conversation or, packed
    (:mod:`dflash.packing`), several, each a document.

    Args:
        input_ids (torch.Tensor): ``[B, S]`` int64, padding = ``pad_token_id``.
        loss_mask (torch.Tensor): ``[B, S]`` bool, True on supervised (assistant) tokens.
        lengths (torch.Tensor): ``[B]`` int64, number of real (non-padding) tokens per row.
        position_ids (torch.Tensor, optional): ``[B, S]`` int64, each token's position within its
            conversation, as the target sees it alone: 0, 1, ... restarting in each document; the
            padding continues the count of the row's last document. None: ``0..S-1`` in every row
            (one conversation per row).
        document_ids (torch.Tensor, optional): ``[B, S]`` int64, ``0, 1, ...`` for the documents of
            a row in order, -1 on padding. None: 0 on the first ``lengths[b]`` tokens, -1 after.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        batch, seq_len = self.input_ids.shape
        columns = torch.arange(seq_len, device=self.input_ids.device)
        if self.position_ids is None:
            self.position_ids = columns.repeat(batch, 1)
        if self.document_ids is None:
            real = columns < self.lengths.to(columns.device)[:, None]
            self.document_ids = torch.where(real, 0, -1)

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: t.to(device, non_blocking=True)
        return Batch(
            input_ids=move(self.input_ids),
            loss_mask=move(self.loss_mask),
            lengths=move(self.lengths),
            position_ids=move(self.position_ids),
            document_ids=move(self.document_ids),
        )

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the batch."""
        return int(self.lengths.sum())

    @property
    def row_fill(self) -> float:
        """Real tokens / row tokens (``num_tokens / (B * S)``), in [0, 1]."""
        return self.num_tokens / self.input_ids.numel()

    def truncated(self, length: int) -> Batch:
        """The first ``length`` positions of every row (``--vary-seq-len``)."""
        cut = lambda t: t[:, :length].contiguous()
        document_ids = cut(self.document_ids)
        lengths = (document_ids >= 0).sum(1)
        return Batch(cut(self.input_ids), cut(self.loss_mask), lengths, cut(self.position_ids), document_ids)

    def pinned(self) -> Batch:
        """A copy in page-locked host memory, so copies to a GPU run asynchronously."""
        fields = (self.input_ids, self.loss_mask, self.lengths, self.position_ids, self.document_ids)
        return Batch(*(t.pin_memory() for t in fields))


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


def require_data_file(path: str | Path) -> Path:
    """``path`` as a Path, checked to be a file before any expensive work reads it.

    Raises:
        DatasetError: it does not exist or is a directory.
    """
    path = Path(path)
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "no such data file"
        raise DatasetError(f"{path}: {what}; pass --data with a JSONL chat file")
    return path


def read_conversations(
    path: str | Path, *, max_line_bytes: int = MAX_LINE_BYTES, progress: bool = True, max_records: int | None = None
) -> list[list[dict[str, str]]]:
    """Read a JSONL chat file into conversations of ``{"role", "content"}`` messages.

    Blank lines are skipped, and so is a UTF-8 byte order mark at the start of the file. Roles
    are normalised (``human`` -> ``user``, ``gpt`` -> ``assistant``, see ``_ROLE_ALIASES``). A
    file over 64 MiB shows a progress bar unless ``progress`` is off. ``max_records``: stop
    after that many conversations (a quick check of the file's start). Records with fields that
    are not rendered (tool calls and schemas, reasoning, OpenAI's ``weight: 0``) are counted in
    one warning naming the first.

    Raises:
        DatasetError: missing or empty file, a line over ``max_line_bytes`` bytes (found
            without reading the rest of it), bytes that are not UTF-8, a line that is not a
            JSON object (a JSON array file: the message gives the conversion), no
            ``messages``/``conversations`` list, a message without its role or text key, a
            non-string content, or an unknown role. The message names the file and the 1-based
            line number; problems of single lines are collected over the whole file (up to
            :data:`MAX_BAD_LINES`) and reported together, so one run finds them all.
    """
    from tqdm import tqdm

    path = require_data_file(path)
    conversations, unrendered, bad_lines = [], _UnrenderedFields(), []
    size = os.path.getsize(path)
    with (
        path.open("rb") as f,
        tqdm(
            total=size,
            desc=f"reading {path.name}",
            unit="B",
            unit_scale=True,
            disable=not progress or size < _PROGRESS_BYTES,
        ) as bar,
    ):
        for lineno, raw in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), start=1):
            where = f"{path}:{lineno}"
            bar.update(len(raw))
            if lineno == 1:  # Windows editors start UTF-8 files with a byte order mark
                raw = raw.removeprefix(codecs.BOM_UTF8)
                _refuse_binary(path, raw)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):  # the rest of it is not read
                bad_lines.append(
                    f"{where}: line longer than {max_line_bytes:,} bytes; one conversation this long "
                    "is far over any --seq-len: split it into several conversations or remove it"
                )
                break
            if not conversations and not bad_lines and raw.lstrip().startswith(b"["):
                raise DatasetError(f"{where}: a JSON array, not JSONL (one JSON object per line); {_convert(path)}")
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = _json_record(line, where)
                conversations.append(_parse_record(record, where))
            except UnicodeDecodeError as e:
                bad_lines.append(
                    f"{where}: not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
                    "re-encode the file as UTF-8"
                )
            except DatasetError as e:
                bad_lines.append(str(e))
            else:
                unrendered.note(record, where)
            if len(bad_lines) == MAX_BAD_LINES or len(conversations) == max_records:
                break
    if bad_lines:
        raise DatasetError(_bad_lines_message(path, bad_lines))
    if not conversations:
        raise DatasetError(f"{path}: file is empty; expected one JSON chat record per line")
    if max_records is None:  # a quick check of the start is followed by the full read, which warns
        unrendered.warn(path, len(conversations))
    return conversations


def _json_record(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        message = e.msg.removesuffix(" at")  # json's "Unterminated string starting at"
        raise DatasetError(
            f"{where}: malformed JSON ({message} at column {e.colno}); expected one JSON object per line"
        ) from None


def _bad_lines_message(path: Path, bad_lines: list[str]) -> str:
    if len(bad_lines) == 1:
        return bad_lines[0]
    stopped = f" (stopped reading at the {MAX_BAD_LINES}th)" if len(bad_lines) == MAX_BAD_LINES else ""
    return f"{path}: {len(bad_lines)} bad lines{stopped}; fix or remove each:\n  " + "\n  ".join(bad_lines)


def _refuse_binary(path: Path, head: bytes) -> None:
    """Raise DatasetError naming the format and the conversion when ``head`` starts a compressed or
    Parquet file."""
    for magic, (name, command) in _BINARY_FORMATS.items():
        if head.startswith(magic):
            out = shlex.quote(str(_jsonl_beside(path)))
            command = command.format(path=shlex.quote(str(path)), out=out)
            raise DatasetError(
                f"{path}: a {name} file, not JSONL text; convert it with `{command}` and pass --data {out}"
            )


def _jsonl_beside(path: Path) -> Path:
    """Where a conversion of ``path`` to JSONL can go: beside it, never over an existing file."""
    stem = path.name.split(".")[0]
    out = path.with_name(f"{stem}.jsonl")
    return out if not out.exists() else path.with_name(f"{stem}.converted.jsonl")


def _convert(path: Path) -> str:
    """How to turn the JSON array file ``path`` into JSONL."""
    source, lines = shlex.quote(str(path)), shlex.quote(str(_jsonl_beside(path)))
    return f"convert it with `jq -c '.[]' {source} > {lines}` and pass --data {lines}"


class _UnrenderedFields:
    """The records of a file that carry fields the chat is rendered without, for one warning."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.count, self.first = 0, None

    def note(self, record: dict, where: str) -> None:
        names = set()
        for message in record.get("messages") or record.get("conversations"):
            names |= {
                key for key, inert in _UNRENDERED_MESSAGE_KEYS.items() if message.get(key, inert) not in (inert, [], "")
            }
        if names:
            self.names |= names
            self.count += 1
            self.first = self.first or where

    def warn(self, path: Path, total: int) -> None:
        if self.count:
            logger.warning(
                "%s: %d of %d conversations carry fields that are not rendered (%s; first at %s): they are "
                "rendered and trained on without them (reasoning kept apart from the content left out, weight-0 "
                "turns trained on), unlike what the target sees when serving; drop those conversations, or "
                "write the fields' text into the content",
                path,
                self.count,
                total,
                ", ".join(map(repr, sorted(self.names))),
                self.first,
            )


def _parse_record(record: Any, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        messages, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise DatasetError(
            f"{where}: missing key: expected 'messages' (OpenAI: role/content) or "
            f"'conversations' (ShareGPT: from/value), found keys {sorted(record)}"
        )
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: expected a non-empty list of messages")
    try:
        tools = record_tools(record, where)
        parsed = [
            _parse_message(message, role_key, text_key, f"{where}: message {i}") for i, message in enumerate(messages)
        ]
    except ToolCallError as e:
        raise DatasetError(str(e)) from None
    return Conversation(parsed, tools)


def _parse_message(message: Any, role_key: str, text_key: str, where: str) -> dict:
    """One message as the chat template takes it (module docstring; tool calls: :mod:`dflash.tool_calls`).

    Raises:
        DatasetError: no role, no text (unless the turn calls tools), an unknown role.
        ToolCallError: a tool call that cannot be read.
    """
    calls = message_tool_calls(message, where) if isinstance(message, dict) and role_key == "role" else None
    if not isinstance(message, dict) or role_key not in message or (text_key not in message and not calls):
        raise DatasetError(f"{where} must be an object with keys '{role_key}' and '{text_key}', got {message!r:.80}")
    role = message[role_key]
    if role == _FUNCTION_CALL_ROLE and role_key == "from":
        return {"role": "assistant", "content": "", "tool_calls": function_call_turn(message[text_key], where)}
    if role not in _ROLE_ALIASES:
        raise DatasetError(f"{where} has unknown role {role!r}; expected one of {sorted(_ROLE_ALIASES)}")
    parsed = {"role": _ROLE_ALIASES[role]}
    if calls:
        if parsed["role"] != "assistant":
            raise DatasetError(f"{where}: a {role!r} turn with tool calls; only assistant turns call tools")
        content = message.get(text_key)
        parsed["content"] = "" if content is None else _text(content, f"{where} '{text_key}'")
        parsed["tool_calls"] = calls
        return parsed
    parsed["content"] = _text(message[text_key], f"{where} '{text_key}'")
    if parsed["role"] == "tool":  # templates that pair results with their calls read these
        parsed |= {key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)}
    return parsed


def _text(content, where: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts with only text parts
    (``{"type": "text", "text": ...}``), joined.

    Raises:
        DatasetError: no text (null: e.g. an assistant turn of tool calls only), a part that is not
            text (an image), or another type.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None for part in content
        ]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
        kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in content})
        raise DatasetError(
            f"{where}: content parts of types {kinds}; only text parts ({{'type': 'text', 'text': ...}}) can be "
            "trained on: drop the conversations with other parts"
        )
    if content is None:
        raise DatasetError(
            f"{where} is null; give the turn its text, or, for an assistant turn that calls tools, its "
            "'tool_calls' (OpenAI's shape)"
        )
    raise DatasetError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def prompt_messages(conversation: Conversation) -> Conversation | None:
    """The messages before the first assistant turn, with the tools offered (an evaluation prompt);
    None if the conversation has no assistant turn or nothing before it."""
    for i, message in enumerate(conversation):
        if message["role"] == "assistant":
            return conversation[:i] or None
    return None


# ---------------------------------------------------------------------------------------
# Tokenizing with an assistant-only loss mask
# ---------------------------------------------------------------------------------------


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
    (:mod:`dflash.token_cache` caches and parallelises it for training runs).

    At most ``seq_len * MAX_CHARS_PER_TOKEN`` characters of each conversation are rendered and
    tokenized, so a huge conversation costs no more than one of that size. From 5000
    conversations on a progress bar is shown unless ``progress`` is off.

    Raises:
        ValueError: unknown ``overflow``.
        DatasetError: no usable conversation is left (names ``source``), or a conversation's
            loss mask cannot be derived (names its 1-based index in ``source``).
    """
    check_overflow(overflow)
    with tokenizing_bar(len(conversations), source=source, progress=progress) as bar:
        tokenized = tokenize_conversations(
            tokenizer, conversations, seq_len=seq_len, overflow=overflow, source=source, bar=bar
        )
    return usable_examples(tokenized, seq_len=seq_len, overflow=overflow, source=source)


def check_overflow(overflow: str) -> None:
    """Raises ValueError for an ``overflow`` policy that is not one of :data:`OVERFLOW_POLICIES`."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")


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


def collate(rows: Sequence[Sequence[Example]], *, seq_len: int, pad_token_id: int) -> Batch:
    """Lay out rows of examples as a right-padded ``[len(rows), seq_len]`` batch.

    The examples of a row follow each other as documents ``0, 1, ...`` with positions restarting
    at 0; padding has loss mask 0 and document id -1 (see :class:`Batch`). One example per row is
    the unpacked layout.

    Raises:
        ValueError: a row's examples hold more than ``seq_len`` tokens together.
    """
    ids = torch.full((len(rows), seq_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.bool)
    positions = torch.empty((len(rows), seq_len), dtype=torch.long)
    documents = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    lengths = torch.empty(len(rows), dtype=torch.long)
    for row, examples in enumerate(rows):
        sizes = [len(example.input_ids) for example in examples]
        n = sum(sizes)
        if n > seq_len:
            raise ValueError(
                f"row {row} holds {len(sizes)} examples of {sizes} tokens, {n} > seq_len={seq_len}; "
                "pack rows with dflash.packing.pack_rows (or truncate examples to seq_len)"
            )
        ids[row, :n] = torch.tensor([t for example in examples for t in example.input_ids], dtype=torch.long)
        mask[row, :n] = torch.tensor([m for example in examples for m in example.loss_mask], dtype=torch.bool)
        documents[row, :n] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))
        # Positions restart in each document; the padding continues the last document's count.
        last = sizes[-1] if sizes else 0
        positions[row] = torch.cat([torch.arange(size) for size in sizes[:-1]] + [torch.arange(seq_len - n + last)])
        lengths[row] = n
    return Batch(ids, mask, lengths, positions, documents)


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------


class ShardedSampler:
    """Deterministic, resumable sampler of row batches, sharded across ranks.

    Each epoch draws a permutation of ``range(num_examples)`` from ``seed + epoch`` (identical on
    every rank) and groups it into rows: one example per row, or with ``packer`` (e.g.
    :func:`dflash.packing.row_packer`) several examples per row. The rows are trimmed to a multiple
    of ``world_size * batch_size`` and rank ``r`` gets the batches ``r, r + world_size, ...``, so
    ranks never share an example and all ranks run the same number of steps. Each example appears
    at most once per epoch (the trimmed tail, fewer rows than one global batch, waits for the next
    epoch's permutation). The state is ``{"epoch", "position"}`` (position = batches already
    yielded in the epoch); restoring it continues exactly.

    Args:
        num_examples (int): examples to draw from.
        batch_size (int): rows per batch.
        seed (int): seed of the permutations.
        shuffle (bool): False keeps ``0..num_examples-1`` in order (and the packer's row order).
        rank (int), world_size (int): this process's shard.
        packer (Callable, optional): ``packer(order, generator) -> rows``, example indices grouped
            into rows (each index exactly once); ``generator`` is the epoch's RNG, None without
            shuffling. None: one example per row.

    Raises:
        ValueError: bad rank/world_size/batch_size, or fewer rows than one global batch.
    """

    def __init__(
        self,
        num_examples: int,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        packer: Callable[[list[int], torch.Generator | None], list[list[int]]] | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.shuffle, self.rank, self.world_size, self.packer = shuffle, rank, world_size, packer
        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[list[int]]] | None = None
        rows = len(self._epoch_rows(0))
        if rows < batch_size * world_size:
            are = f"pack into {rows} rows, which are" if packer is not None else "are"
            raise ValueError(
                f"{num_examples} examples {are} fewer than one global batch "
                f"(batch_size={batch_size} x world_size={world_size}); add data or "
                "lower --batch-size"
            )

    @property
    def batches_per_epoch(self) -> int:
        """Batches per rank in the current epoch (with packing the row count varies a little by epoch)."""
        return len(self._epoch_rows(self.epoch)) // (self.batch_size * self.world_size)

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        # Packing a large corpus takes seconds: keep the current epoch's rows.
        if self._cached is None or self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch) if self.shuffle else None
            if generator is not None:
                order = torch.randperm(self.num_examples, generator=generator).tolist()
            else:
                order = list(range(self.num_examples))
            rows = self.packer(order, generator) if self.packer is not None else [[i] for i in order]
            self._cached = (epoch, rows)
        return self._cached[1]

    def _epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        rows = self._epoch_rows(epoch)
        b = self.batch_size
        n = len(rows) // (b * self.world_size) * self.world_size
        batches = [rows[i * b : (i + 1) * b] for i in range(n)]
        return batches[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Yield batches of rows (lists of example indices) forever, epoch after epoch, from the
        current state."""
        while True:
            batches = self._epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1
                yield batches[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class BatchLoader:
    """Fixed-shape batches of tokenized examples in sampler order (an infinite iterator).

    ``state_dict()`` is the sampler state after the last batch returned, so a checkpoint
    taken between steps resumes with the next unseen batch.
    """

    def __init__(self, examples: Sequence[Example], sampler: ShardedSampler, *, seq_len: int, pad_token_id: int):
        self.examples, self.sampler = examples, sampler
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self._indices = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if self._indices is None:
            self._indices = iter(self.sampler)
        rows = [[self.examples[i] for i in row] for row in next(self._indices)]
        return collate(rows, seq_len=self.seq_len, pad_token_id=self.pad_token_id)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self._indices = None  # restart the generator from the restored position
