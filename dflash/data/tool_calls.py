"""Tool calls in chat data: read from the shapes corpora ship them in, for the target's chat template.

Agentic corpora hold an assistant turn that calls tools, the tools' results, and the tools offered:

- OpenAI (Chat Completions): an assistant message ``{"content": null, "tool_calls": [{"id",
  "type": "function", "function": {"name", "arguments": "<JSON text>"}}]}``, then one
  ``{"role": "tool", "tool_call_id", "content"}`` per result; the record's ``tools`` lists
  ``{"type": "function", "function": {"name", "description", "parameters"}}``. The deprecated
  form, an assistant ``function_call: {"name", "arguments"}``, a ``function`` role for its result
  and the record's ``functions``, reads the same way.
- ShareGPT as LLaMA-Factory writes it: a ``function_call`` turn whose value is the call as JSON
  text (``{"name", "arguments"}``, or a list for parallel calls), an ``observation`` turn for the
  result, and ``tools`` as JSON text of the function schemas.

Both become transformers' chat-template input (its "Tool use" guide): an assistant message with
``tool_calls`` of ``{"type": "function", "function": {"name", "arguments"}}``, arguments parsed to
a dict where they are JSON objects (as vLLM passes them to the template), ``tool`` messages, and the
``tools`` argument of ``apply_chat_template``. The template renders them the way the target saw
them in its own training (Qwen3: ``<tool_call>`` blocks in the assistant turn, the schemas in the
system turn); :func:`unrendered` says when a template leaves them out, so the conversation is
skipped instead of trained on without its calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


class ToolCallError(ValueError):
    """A tool call or tool schema that cannot be read (the message says which and why)."""


def _parsed(text, what: str):
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"{what} is not valid JSON text ({e.msg} at column {e.colno})") from None


def _call(call, what: str) -> dict:
    """``{"type": "function", "function": {"name", "arguments"}}`` (+ ``id``) of one call in OpenAI's
    shape or the bare ``{"name", "arguments"}`` one."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"{what}: expected an object with a function name, got {call!r:.80}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    parsed = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {**({"id": call["id"]} if isinstance(call.get("id"), str) else {}), **parsed}


def message_tool_calls(message: dict, what: str) -> list[dict] | None:
    """The tool calls of an OpenAI message (``tool_calls``, or the deprecated ``function_call``);
    None when it has none.

    Raises:
        ToolCallError: a call that is not an object with a function name.
    """
    calls = message.get("tool_calls")
    if not calls and message.get("function_call"):
        calls = [message["function_call"]]
    if not calls:
        return None
    if not isinstance(calls, list):
        raise ToolCallError(f"{what} 'tool_calls': expected a list of calls, got {type(calls).__name__}")
    return [_call(call, f"{what} tool call {k}") for k, call in enumerate(calls)]


def function_call_turn(value, what: str) -> list[dict]:
    """The tool calls of a ShareGPT ``function_call`` turn: its value is one call or a list of calls,
    as JSON text (LLaMA-Factory) or as objects.

    Raises:
        ToolCallError: not JSON, or not calls with a function name.
    """
    calls = _parsed(value, f"{what} (a function_call turn)")
    calls = calls if isinstance(calls, list) else [calls]
    if not calls:
        raise ToolCallError(f"{what}: a function_call turn without a call")
    return [_call(call, f"{what} call {k}") for k, call in enumerate(calls)]


def record_tools(record: dict, where: str) -> list[dict] | None:
    """The tools a record offers (``tools``, or the deprecated ``functions``), each as
    ``{"type": "function", "function": schema}``; None when it offers none.

    Raises:
        ToolCallError: not a list (or JSON text of one) of schemas with a function name.
    """
    tools = record.get("tools") or record.get("functions")
    if not tools:
        return None
    tools = _parsed(tools, f"{where}: 'tools'")
    if not isinstance(tools, list):
        raise ToolCallError(f"{where}: 'tools' must be a list of tool schemas, got {type(tools).__name__}")
    parsed = []
    for k, tool in enumerate(tools):
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise ToolCallError(f"{where}: tool {k} must be a function schema with a name, got {tool!r:.80}")
        parsed.append({"type": "function", "function": schema})
    return parsed or None


def unrendered(messages: Sequence[dict], tools: list[dict] | None, text: str, spans: list[tuple[int, int]]) -> str:
    """What of the conversation's tool use the chat template left out of ``text`` ("" if nothing).

    Each assistant turn with tool calls (in the order of ``spans``, one per assistant turn) must name
    every called function inside its span; each offered tool's name must appear outside the spans
    (the schemas are part of the prompt, not of a reply).
    """
    turns = [m for m in messages if m["role"] == "assistant"]
    for i, (message, (start, end)) in enumerate(zip(turns, spans)):
        names = [call["function"]["name"] for call in message.get("tool_calls") or ()]
        missing = [name for name in names if name not in text[start:end]]
        if missing:
            return f"does not render tool calls (assistant turn {i} calls {', '.join(missing)})"
    prompt = "".join(text[a:b] for a, b in zip([0, *(end for _, end in spans)], [*(s for s, _ in spans), len(text)]))
    missing = [tool["function"]["name"] for tool in tools or () if tool["function"]["name"] not in prompt]
    if missing:
        return f"does not render the tools offered ({', '.join(missing)})"
    return ""
