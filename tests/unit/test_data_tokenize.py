"""dflash.data: reading, assistant-only loss mask, length policy, batches, sampler."""

import json
from itertools import islice

import pytest
from tiny import CONVERSATIONS, chat_template, make_tokenizer, supervised_text, write_jsonl

from dflash.data.batches import BatchLoader, ShardedSampler
from dflash.data.chats import MAX_BAD_LINES, DatasetError, prompt_messages, read_conversations
from dflash.data.tokenize import build_examples, tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_reads_openai_and_sharegpt_alike(tmp_path):
    openai = write_jsonl(tmp_path / "a.jsonl", [{"messages": CONVERSATIONS[0]}])
    sharegpt = write_jsonl(
        tmp_path / "b.jsonl",
        [
            "",
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": "what is two plus two?"},
                        {"from": "gpt", "value": "two plus two is four."},
                    ]
                }
            ),
        ],
    )
    assert read_conversations(openai) == read_conversations(sharegpt) == [CONVERSATIONS[0]]


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", r"empty\.jsonl: file is empty"),
        (b'{"messages": [}\n', r"bad\.jsonl:1: malformed JSON"),
        (
            b'{"messages": "unterminated',
            r"bad\.jsonl:1: malformed JSON \(Unterminated string starting at column 14\)",
        ),
        (b'{"messages": []}\n{"text": "hi"}\n', r"bad\.jsonl:1: expected a non-empty list"),
        (
            b'{"messages": [{"role": "user", "content": "x"}]}\n{"text": "hi"}\n',
            r"bad\.jsonl:2: missing key: expected 'messages'.*found keys \['text'\]",
        ),
        (
            b'{"messages": [{"role": "user"}]}\n',
            r"bad\.jsonl:1: message 0 must be an object with keys 'role' and 'content'",
        ),
        (
            b'{"conversations": [{"from": "robot", "value": "x"}]}\n',
            r"bad\.jsonl:1: message 0 has unknown role 'robot'",
        ),
        (
            b'{"messages": [{"role": "user", "content": 3}]}\n',
            r"'content' must be a string or a list of text parts, got int",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}\n',
            r"bad\.jsonl:1: message 1 'content' is null; give the turn its text, or, for an assistant turn that "
            r"calls tools, its 'tool_calls'",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "x"}]}]}\n',
            r"message 0 'content': content parts of types \['image_url', 'text'\]; only text parts",
        ),
        (b"[1, 2]\n", r"bad\.jsonl:1: a JSON array, not JSONL"),
        (
            b'{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": "\xff\xfe"}\n',
            r"bad\.jsonl:2: not valid UTF-8.*re-encode the file as UTF-8",
        ),
    ],
)
def test_bad_input_names_file_line_and_expectation(tmp_path, content, match):
    path = tmp_path / ("empty.jsonl" if not content else "bad.jsonl")
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=match):
        read_conversations(path)


def test_missing_file_is_a_value_error_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl: no such data file; pass --data"):
        read_conversations(tmp_path / "nope.jsonl")


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    example = tokenize_conversation(tokenizer, CONVERSATIONS[1])
    supervised = supervised_text(tokenizer, example)
    assert supervised == ("the fox sat on the mat and looked at the dog<|im_end|>\nthe cat sat on the mat<|im_end|>\n")
    # Round trip: the full token sequence is the rendered template, nothing lost or added.
    rendered = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered


def test_loss_mask_falls_back_to_content_search_for_rewriting_templates(tokenizer):
    # Like Qwen3 (which drops the reasoning of earlier turns), this template renders an
    # assistant turn differently once it is no longer last, so prefix matching fails for the
    # first turn; its content must still be found and masked, with the end marker after it.
    rewriting = tokenizer.chat_template.replace(
        "{{ m['content'] }}", "{% if loop.last and m['role'] == 'assistant' %}[think]{% endif %}{{ m['content'] }}"
    )
    with chat_template(tokenizer, rewriting):
        example = tokenize_conversation(tokenizer, CONVERSATIONS[1])
    supervised = supervised_text(tokenizer, example)
    assert supervised == (
        "the fox sat on the mat and looked at the dog<|im_end|>\n[think]the cat sat on the mat<|im_end|>\n"
    )


def test_length_policy_truncates_or_drops(tokenizer):
    lengths = [len(tokenize_conversation(tokenizer, c).input_ids) for c in CONVERSATIONS]
    seq_len = sorted(lengths)[1]
    truncated = build_examples(tokenizer, CONVERSATIONS, seq_len=seq_len, overflow="truncate")
    dropped = build_examples(tokenizer, CONVERSATIONS, seq_len=seq_len, overflow="drop")
    assert all(len(e.input_ids) <= seq_len for e in truncated + dropped)
    assert len(dropped) == sum(n <= seq_len for n in lengths)
    assert len(truncated) > len(dropped)
    dropped_all = r"no conversation left to train on: .*longer than --seq-len 3 and were dropped \(raise --seq-len"
    with pytest.raises(DatasetError, match=dropped_all):
        build_examples(tokenizer, CONVERSATIONS, seq_len=3, overflow="drop")
    with pytest.raises(ValueError, match="overflow must be one of"):
        build_examples(tokenizer, CONVERSATIONS, seq_len=64, overflow="wrap")


def test_batches_have_a_fixed_shape_and_masked_padding(tokenizer):
    examples = build_examples(tokenizer, CONVERSATIONS, seq_len=64)
    loader = BatchLoader(
        examples, ShardedSampler(len(examples), batch_size=2, seed=0), seq_len=64, pad_token_id=tokenizer.pad_token_id
    )
    for _ in range(3):
        batch = next(loader)
        assert batch.input_ids.shape == batch.loss_mask.shape == (2, 64)
        for row, n in enumerate(batch.lengths.tolist()):
            assert (batch.input_ids[row, n:] == tokenizer.pad_token_id).all()
            assert not batch.loss_mask[row, n:].any()


def test_sampler_resumes_exactly_and_shards_disjointly():
    full = ShardedSampler(10, batch_size=2, seed=3)
    reference = list(islice(full, 12))  # crosses two epoch boundaries
    first = ShardedSampler(10, batch_size=2, seed=3)
    head = list(islice(first, 7))
    resumed = ShardedSampler(10, batch_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    assert first.state_dict() == {"epoch": 1, "position": 2}
    assert head + list(islice(resumed, 5)) == reference
    assert all(len(row) == 1 for batch in reference for row in batch)  # one example per row
    assert sorted(_indices(reference[:5])) == list(range(10))  # one epoch = a permutation

    shards = [ShardedSampler(11, batch_size=2, seed=3, rank=r, world_size=2) for r in range(2)]
    epoch = [_indices(islice(s, s.batches_per_epoch)) for s in shards]
    assert not set(epoch[0]) & set(epoch[1]) and len(epoch[0]) == len(epoch[1]) == 4
    with pytest.raises(ValueError, match="rank must be in"):
        ShardedSampler(10, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedSampler(3, batch_size=2, world_size=2)


def _indices(batches) -> list[int]:
    """Example indices of sampler batches (lists of rows), in order."""
    return [i for batch in batches for row in batch for i in row]


def test_prompt_is_the_conversation_before_the_first_assistant_turn():
    assert prompt_messages(CONVERSATIONS[1]) == CONVERSATIONS[1][:2]
    assert prompt_messages([{"role": "assistant", "content": "hi"}]) is None


def test_every_bad_line_is_reported_in_one_error(tmp_path):
    good = json.dumps({"messages": CONVERSATIONS[0]})
    lines = [good, '{"messages": [}', good, '{"conversations": [{"from": "robot", "value": "x"}]}', good]
    path = tmp_path / "two.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as error:
        read_conversations(path)
    message = str(error.value)
    assert message.startswith(f"{path}: 2 bad lines; fix or remove each:")
    assert "two.jsonl:2: malformed JSON" in message and "two.jsonl:4: message 0 has unknown role 'robot'" in message

    many = tmp_path / "many.jsonl"  # another format altogether: reading stops at MAX_BAD_LINES
    many.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(MAX_BAD_LINES + 5)))
    with pytest.raises(
        DatasetError, match=rf"many\.jsonl: {MAX_BAD_LINES} bad lines \(stopped reading at the {MAX_BAD_LINES}th\)"
    ):
        read_conversations(many)


def test_a_utf8_byte_order_mark_at_the_start_is_accepted(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": c} for c in CONVERSATIONS[:2]])
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())  # what Notepad's "UTF-8 with BOM" writes
    assert read_conversations(bom) == read_conversations(plain) == CONVERSATIONS[:2]
    middle = tmp_path / "middle.jsonl"  # only the file's start may carry one
    middle.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + plain.read_bytes())
    with pytest.raises(DatasetError, match=r"middle\.jsonl:3: malformed JSON"):
        read_conversations(middle)


# Gemma/Mistral-style: roles must alternate user/assistant from the first message.
ALTERNATING_ONLY = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_conversations_the_chat_template_rejects_are_skipped_and_named(tmp_path, caplog):
    strict = make_tokenizer(tmp_path / "strict")
    strict.chat_template = ALTERNATING_ONLY
    good = CONVERSATIONS[0]
    two_users = [{"role": "user", "content": "hi"}, {"role": "user", "content": "hello?"}, good[1]]
    examples = build_examples(strict, [good, two_users, good], seq_len=64, source="chats.jsonl", progress=False)
    assert len(examples) == 2
    assert (
        "chats.jsonl: 1 conversations skipped: the target's chat template rejects them or leaves out their tool "
        "use (first: conversation 2: "
        "the target's chat template rejects it: Conversation roles must alternate" in caplog.text
    )
    with pytest.raises(
        DatasetError, match=r"1 were rejected by the target's chat template .*\(first: conversation 1: .*alternate"
    ):
        build_examples(strict, [two_users], seq_len=64, source="chats.jsonl", progress=False)


def test_a_conversation_that_opens_with_an_assistant_turn_is_trained_on(tokenizer):
    greeting = [{"role": "assistant", "content": "hello there"}, *CONVERSATIONS[0]]
    example = tokenize_conversation(tokenizer, greeting)
    supervised = supervised_text(tokenizer, example)
    assert "hello there" in supervised and CONVERSATIONS[0][1]["content"] in supervised
    assert CONVERSATIONS[0][0]["content"] not in supervised


def test_openai_text_parts_are_joined(tmp_path):
    parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": "two plus two?"}]
    record = {"messages": [{"role": "user", "content": parts}, CONVERSATIONS[0][1]]}
    path = write_jsonl(tmp_path / "parts.jsonl", [record])
    assert read_conversations(path, progress=False) == [CONVERSATIONS[0]]
