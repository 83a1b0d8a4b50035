"""Chat data read strictly: a JSONL file of conversations, each checked and normalised for the chat
template, with errors that name the file, the line and the fix.

Input: one JSON object per line, either OpenAI style ``{"messages": [{"role", "content"}]}``
or ShareGPT style ``{"conversations": [{"from", "value"}]}`` (roles ``human``/``gpt`` map to
``user``/``assistant``), with tool calls, tool results and the tools offered in either's shape
(:mod:`dflash.data.tool_calls`).

Bounded work per line: a raw line over ``MAX_LINE_BYTES`` is an error naming it, found before
the line is parsed.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from dflash.data.tool_calls import ToolCallError, function_call_turn, message_tool_calls, record_tools

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
#: Longest raw JSONL line read (bytes): 4M+ tokens, more than any --seq-len keeps.
MAX_LINE_BYTES = 16 << 20
# Show a progress bar from this size on (smaller files take a second or two).
_PROGRESS_BYTES = 64 << 20
#: Bad lines reported in one error; reading stops at this many (a file of another format fails on every line).
MAX_BAD_LINES = 20


class DatasetError(ValueError):
    """A data file that cannot be used, with the file, line and what was expected."""


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


def require_data_file(path: str | Path, *, flag: str = "--data") -> Path:
    """``path`` as a Path, checked to be a file before any expensive work reads it.

    Args:
        flag: the flag that named it, for the message (``--eval-data``).

    Raises:
        DatasetError: it does not exist or is a directory.
    """
    path = Path(path)
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "no such data file"
        raise DatasetError(f"{path}: {what}; pass {flag} with a JSONL chat file")
    return path


def read_conversations(
    path: str | Path,
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    progress: bool = True,
    max_records: int | None = None,
    flag: str = "--data",
) -> list[list[dict[str, str]]]:
    """Read a JSONL chat file into conversations of ``{"role", "content"}`` messages.

    Blank lines are skipped, and so is a UTF-8 byte order mark at the start of the file. Roles
    are normalised (``human`` -> ``user``, ``gpt`` -> ``assistant``, see ``_ROLE_ALIASES``). A
    file over 64 MiB shows a progress bar unless ``progress`` is off. ``max_records``: stop
    after that many conversations (a quick check of the file's start). Records with fields that
    are not rendered (tool calls and schemas, reasoning, OpenAI's ``weight: 0``) are counted in
    one warning naming the first. ``flag``: the flag that named the file, for the messages.

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

    path = require_data_file(path, flag=flag)
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
                _refuse_binary(path, raw, flag)
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):  # the rest of it is not read
                bad_lines.append(
                    f"{where}: line longer than {max_line_bytes:,} bytes; one conversation this long "
                    "is far over any --seq-len: split it into several conversations or remove it"
                )
                break
            if not conversations and not bad_lines and raw.lstrip().startswith(b"["):
                raise DatasetError(
                    f"{where}: a JSON array, not JSONL (one JSON object per line); {_convert(path, flag)}"
                )
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


def _refuse_binary(path: Path, head: bytes, flag: str) -> None:
    """Raise DatasetError naming the format and the conversion when ``head`` starts a compressed or
    Parquet file."""
    for magic, (name, command) in _BINARY_FORMATS.items():
        if head.startswith(magic):
            out = shlex.quote(str(_jsonl_beside(path)))
            command = command.format(path=shlex.quote(str(path)), out=out)
            raise DatasetError(
                f"{path}: a {name} file, not JSONL text; convert it with `{command}` and pass {flag} {out}"
            )


def _jsonl_beside(path: Path) -> Path:
    """Where a conversion of ``path`` to JSONL can go: beside it, never over an existing file."""
    stem = path.name.split(".")[0]
    out = path.with_name(f"{stem}.jsonl")
    return out if not out.exists() else path.with_name(f"{stem}.converted.jsonl")


def _convert(path: Path, flag: str) -> str:
    """How to turn the JSON array file ``path`` into JSONL (and pass it with ``flag``)."""
    source, lines = shlex.quote(str(path)), shlex.quote(str(_jsonl_beside(path)))
    return f"convert it with `jq -c '.[]' {source} > {lines}` and pass {flag} {lines}"


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
    """One message as the chat template takes it (module docstring; tool calls: :mod:`dflash.data.tool_calls`).

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
