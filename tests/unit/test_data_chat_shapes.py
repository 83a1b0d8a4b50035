"""dflash.data on chat files as real corpora ship them: reasoning turns under a Qwen3-style template
that drops the reasoning of earlier turns, JSON arrays instead of JSONL, and tool-call fields the
reader does not render. Fast, in-process (tiny tokenizer, no model)."""

import json
import logging

import pytest
from tiny import chat_template, make_tokenizer, supervised_text, write_jsonl

from dflash.data.chats import DatasetError, read_conversations
from dflash.data.tokenize import tokenize_conversation

# Qwen3's rule for assistant turns: the reasoning before ``</think>`` is rendered only for turns after
# the last user query; earlier turns keep just the answer, with its leading newlines stripped.
QWEN3_STYLE_THINK = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and '</think>' in content and loop.index0 < ns.last_user %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_reasoning_dropped_from_earlier_turns_leaves_their_answer_supervised(tokenizer):
    conversation = [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "<think>\nthe cat sat\n</think>\n\ntwo plus two is four."},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "<think>\nthe dog\n</think>\n\nthe cat sat on the mat"},
    ]
    with chat_template(tokenizer, QWEN3_STYLE_THINK):
        example = tokenize_conversation(tokenizer, conversation)
    # The first turn is trained on what the target sees of it (the answer and its end), the last in full.
    assert supervised_text(tokenizer, example) == (
        "two plus two is four.<|im_end|>\n<think>\nthe dog\n</think>\n\nthe cat sat on the mat<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "text",
    [
        '[\n {"messages": [{"role": "user", "content": "hi"}]}\n]\n',  # json.dump(..., indent=1)
        '[{"messages": [{"role": "user", "content": "hi"}]}]\n',  # json.dump(...) on one line
    ],
)
def test_a_json_array_file_is_refused_with_the_conversion(tmp_path, text):
    path = tmp_path / "chats.json"
    path.write_text(text)
    with pytest.raises(DatasetError, match=r"chats\.json:1: a JSON array, not JSONL.*jq -c '\.\[\]'"):
        read_conversations(path)


def test_a_list_on_a_later_line_is_still_named_as_such(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, "[1, 2]"])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: expected a JSON object, got list"):
        read_conversations(path)


def test_fields_the_chat_is_rendered_without_are_named_in_a_warning(tmp_path, caplog):
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    records = [
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [call], "reasoning_content": "hm"},
                {"role": "tool", "content": "21 C"},
                {"role": "assistant", "content": "It is 21 C."},
            ],
            "tools": [{"type": "function", "function": {"name": "weather"}}],
        },
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    path = write_jsonl(tmp_path / "tools.jsonl", [json.dumps(r) for r in records])
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        conversations = read_conversations(path)
    assert len(conversations) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "1 of 2 conversations" in warnings[0]
    # Tool calls and tools are rendered: only the reasoning is named.
    assert "carry fields that are not rendered ('reasoning_content'; first at" in warnings[0]
    assert "tools.jsonl:1" in warnings[0]  # the first one, to look at


def test_plain_chats_read_without_a_warning(tmp_path, caplog):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"messages": [{"role": "user", "content": "hi", "name": "x"}]}])
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        read_conversations(path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_openai_weight_one_is_the_default_and_not_warned_about(tmp_path, caplog):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 1}]}
    path = write_jsonl(tmp_path / "w.jsonl", [record, {**record, "messages": [record["messages"][0]] * 2}])
    record["messages"][1]["weight"] = 0
    path.write_text(path.read_text() + json.dumps(record) + "\n")
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        read_conversations(path)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "1 of 3 conversations" in warning and "'weight'" in warning and "w.jsonl:3" in warning


def test_the_conversion_of_a_json_array_never_writes_over_the_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('[{"messages": [{"role": "user", "content": "hi"}]}]\n')
    with pytest.raises(
        DatasetError, match=r"chats\.jsonl > \S*chats\.converted\.jsonl` and pass --data \S*chats\.conv"
    ):
        read_conversations(path)


def test_a_quick_check_of_the_start_does_not_warn(tmp_path, caplog):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]}
    path = write_jsonl(tmp_path / "t.jsonl", [record])
    with caplog.at_level(logging.WARNING, logger="dflash.data"):
        read_conversations(path, max_records=1)
    assert not caplog.records


@pytest.mark.parametrize(
    "compress, match",
    [
        (
            "gzip",
            r"chats\.jsonl\.gz: a gzip-compressed file, not JSONL text; convert it with `gunzip -c \S+\.gz > ",
        ),
        ("bz2", r"a bzip2-compressed file.*`bzip2 -dc "),
        ("lzma", r"a xz-compressed file.*`xz -dc "),
    ],
)
def test_a_compressed_file_is_named_with_the_command_that_unpacks_it(tmp_path, compress, match):
    import importlib

    module = importlib.import_module(compress)
    path = tmp_path / "chats.jsonl.gz"
    path.write_bytes(module.compress(b'{"messages": [{"role": "user", "content": "hi"}]}\n'))
    with pytest.raises(DatasetError, match=match) as raised:
        read_conversations(path)
    assert str(tmp_path / "chats.jsonl") in str(raised.value)
    (tmp_path / "chats.jsonl").write_text("")  # an existing file is never written over
    with pytest.raises(DatasetError, match=r"chats\.converted\.jsonl` and pass --data \S+chats\.converted\.jsonl$"):
        read_conversations(path)


def test_a_parquet_file_is_named_with_the_conversion(tmp_path):
    path = tmp_path / "train-00000-of-00001.parquet"
    path.write_bytes(b"PAR1\x15\x04\x15\x10")  # Parquet's leading magic, as the Hub stores datasets
    with pytest.raises(DatasetError, match=r"a Parquet file, not JSONL text.*Dataset\.from_parquet"):
        read_conversations(path)


def test_an_answer_the_user_just_quoted_is_found_in_the_assistant_turn_not_the_user_turn(tokenizer):
    conversation = [
        {"role": "user", "content": "just say the cat sat"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nthe cat sat"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "<think>\nthe dog\n</think>\n\nthe cat sat on the mat"},
    ]
    with chat_template(tokenizer, QWEN3_STYLE_THINK):
        example = tokenize_conversation(tokenizer, conversation)
    supervised = [i for i, m in enumerate(example.loss_mask) if m]
    user_turn = len(tokenizer("<|im_start|>user\njust say the cat sat<|im_end|>\n")["input_ids"])
    assert min(supervised) > user_turn, "the user's words were marked as the assistant's"
    assert supervised_text(tokenizer, example).startswith("the cat sat<|im_end|>\n<think>")


# Qwen3's own rule for the last assistant turn: an (empty) think block even without reasoning, so the
# rendering of a prefix ending at an earlier turn differs from the full chat at that turn.
QWEN3_EMPTY_THINK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_earlier_turns_under_qwen3s_empty_think_block_keep_their_end_marker(tokenizer):
    conversation = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": "the fox sat on the mat"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "the cat sat"},
    ]
    with chat_template(tokenizer, QWEN3_EMPTY_THINK):
        example = tokenize_conversation(tokenizer, conversation)
    assert supervised_text(tokenizer, example) == (
        "the fox sat on the mat<|im_end|>\n<think>\n\n</think>\n\nthe cat sat<|im_end|>\n"
    )


def test_developer_and_observation_roles_are_read_as_system_and_tool(tmp_path):
    path = write_jsonl(
        tmp_path / "roles.jsonl",
        [
            {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {
                "conversations": [
                    {"from": "human", "value": "weather?"},
                    {"from": "observation", "value": "sunny"},
                    {"from": "gpt", "value": "it is sunny"},
                ]
            },
        ],
    )
    first, second = read_conversations(path)
    assert [m["role"] for m in first] == ["system", "user"]
    assert [m["role"] for m in second] == ["user", "tool", "assistant"]


def test_a_function_call_turn_without_a_call_is_refused_naming_it(tmp_path):
    path = write_jsonl(
        tmp_path / "calls.jsonl",
        [{"conversations": [{"from": "human", "value": "weather?"}, {"from": "function_call", "value": "{}"}]}],
    )
    with pytest.raises(
        DatasetError, match=r"calls\.jsonl:1: message 1 call 0: expected an object with a function name"
    ):
        read_conversations(path)
