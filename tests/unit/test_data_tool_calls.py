"""Tool-calling chats train: OpenAI ``tool_calls``/``tool`` turns and ``tools`` (and their deprecated
``function_call`` form), and LLaMA-Factory's ShareGPT ``function_call``/``observation`` turns, reach the
target's chat template, and the loss mask covers the assistant's tool-call text. Under Qwen3's own
template (below, as Qwen3-8B ships it in tokenizer_config.json) a tool-call turn renders differently
when it is last, so the turn is found by its rendering; a template that leaves tool use out skips
the conversation with a count. Fast, in-process (tiny tokenizer, no model)."""

import json
import logging

import pytest
from tiny import chat_template, make_tokenizer, supervised_text, write_jsonl

from dflash.data.chats import DatasetError, prompt_messages, read_conversations
from dflash.data.regenerate import write_conversations
from dflash.data.tokenize import build_examples, render_chat, tokenize_conversation

# Qwen3's chat template (Qwen/Qwen3-8B, tokenizer_config.json "chat_template"), whitespace control as shipped.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501 (the template's own lines)

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "what is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 C in Paris."},
    ],
    "tools": [{"type": "function", "function": WEATHER}],
}
# The same chat as LLaMA-Factory's ShareGPT files hold it (its "tools" and calls are JSON text).
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "what is the weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 C in Paris."},
    ],
    "tools": json.dumps([WEATHER]),
}
# And in OpenAI's deprecated functions form.
LEGACY = {
    "messages": [
        OPENAI["messages"][0],
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'},
        OPENAI["messages"][3],
    ],
    "functions": [WEATHER],
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAIN = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the cat sat"}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _read(tmp_path, *records):
    return read_conversations(write_jsonl(tmp_path / "chats.jsonl", records))


@pytest.mark.parametrize("record", [OPENAI, SHAREGPT, LEGACY], ids=["openai", "sharegpt", "openai-functions"])
def test_a_tool_call_turn_is_rendered_by_qwen3s_template_and_supervised(tokenizer, tmp_path, record):
    (conversation,) = _read(tmp_path, record)
    with chat_template(tokenizer, QWEN3_TEMPLATE):
        text = render_chat(tokenizer, conversation, add_generation_prompt=False)
        example = tokenize_conversation(tokenizer, conversation)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER["parameters"]) in text
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in text  # not last: no think block
    # The call (what the target generates: the assistant's tool-call text and its end) and the answer are
    # trained on; the tool's result, the schemas and the user's turn are not.
    assert supervised_text(tokenizer, example) == (
        f"{CALL}<|im_end|>\n<think>\n\n</think>\n\nIt is 21 C in Paris.<|im_end|>\n"
    )


def test_the_three_shapes_give_the_same_tokens(tokenizer, tmp_path):
    with chat_template(tokenizer, QWEN3_TEMPLATE):
        examples = [tokenize_conversation(tokenizer, _read(tmp_path, r)[0]) for r in (OPENAI, SHAREGPT, LEGACY)]
    assert examples[0] == examples[1] == examples[2]


def test_text_before_parallel_calls_is_supervised_with_them(tokenizer, tmp_path):
    second = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    record = json.loads(json.dumps(OPENAI))
    record["messages"][1]["content"] = "Let me check both."
    record["messages"][1]["tool_calls"].append(second)
    record["messages"][2:2] = [{"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'}]
    (conversation,) = _read(tmp_path, record)
    with chat_template(tokenizer, QWEN3_TEMPLATE):
        example = tokenize_conversation(tokenizer, conversation)
    rome = CALL.replace("Paris", "Rome")
    assert supervised_text(tokenizer, example).startswith(f"Let me check both.\n{CALL}\n{rome}<|im_end|>\n<think>")


def test_a_template_that_leaves_tool_use_out_skips_the_conversation_with_a_count(tokenizer, tmp_path, caplog):
    conversations = _read(tmp_path, OPENAI, PLAIN, SHAREGPT, PLAIN)
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        examples = build_examples(tokenizer, conversations, seq_len=256, source="chats.jsonl", progress=False)
    assert len(examples) == 2  # the tiny ChatML template renders neither tools nor calls
    assert (
        "chats.jsonl: 2 conversations skipped: the target's chat template rejects them or leaves out their tool use "
        "(first: conversation 1: the target's chat template does not render tool calls (assistant turn 0 calls "
        "get_weather))"
    ) in caplog.text
    # A template that renders the calls but not the schemas offered: the prompt would differ from serving.
    without_tools = QWEN3_TEMPLATE.replace("{%- if tools %}", "{%- if false %}", 1)
    with chat_template(tokenizer, without_tools), caplog.at_level(logging.WARNING, logger="dflash.data"):
        examples = build_examples(tokenizer, conversations[:2], seq_len=256, source="chats.jsonl", progress=False)
    assert len(examples) == 1 and "does not render the tools offered (get_weather)" in caplog.text
    # Only tool conversations: the error names the template's refusal and its fix, not --seq-len.
    with pytest.raises(DatasetError, match=r"2 were rejected by the target's chat template .*tool calls as the") as e:
        build_examples(tokenizer, [conversations[0], conversations[2]], seq_len=256, source="c", progress=False)
    assert "--seq-len" not in str(e.value)


def test_prompts_and_regenerated_corpora_keep_the_tools(tokenizer, tmp_path):
    (conversation,) = _read(tmp_path, OPENAI)
    prompt = prompt_messages(conversation)
    with chat_template(tokenizer, QWEN3_TEMPLATE):
        rendered = render_chat(tokenizer, prompt, add_generation_prompt=True)
    assert '"name": "get_weather"' in rendered and rendered.endswith("<|im_start|>assistant\n")
    write_conversations(tmp_path / "regenerated.jsonl", [prompt + [{"role": "assistant", "content": "ok"}]])
    (again,) = read_conversations(tmp_path / "regenerated.jsonl")
    assert again.tools == conversation.tools and again[-1] == {"role": "assistant", "content": "ok"}
