"""Bounded work per line of chat data: a huge line is named before it is parsed, a huge
conversation is rendered and tokenized only as far as ``seq_len`` can reach, data preparation
shows progress, and transformers' "indexing errors" warning is silenced where it does not apply."""

import logging
import time

import pytest
from tiny import CONVERSATIONS, RecordingTokenizer, chat_template, make_tokenizer, write_jsonl

from dflash.data.chats import DatasetError, read_conversations
from dflash.data.tokenize import build_examples, char_budget, tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _chat(reply: str, turns: int = 1):
    return [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": reply}] * turns


def test_a_line_over_the_byte_limit_is_named_before_it_is_parsed(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"messages": CONVERSATIONS[0]}, '{"messages": "' + "x" * 5000])
    with pytest.raises(DatasetError, match=r"big\.jsonl:2: line longer than 1,000 bytes.*split it"):
        read_conversations(path, max_line_bytes=1000)
    with pytest.raises(DatasetError, match=r"big\.jsonl:2: malformed JSON"):  # under a larger limit it is parsed
        read_conversations(path, max_line_bytes=10**6)


def test_the_default_limit_stops_a_50_mb_line_at_once(tmp_path):
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:  # the file: one 50 MB chat on one line
        f.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "')
        f.write("all work and no play " * 2_500_000)
        f.write('"}]}\n')
    start = time.perf_counter()
    with pytest.raises(DatasetError, match=r"huge\.jsonl:1: line longer than 16,777,216 bytes"):
        read_conversations(path)
    assert time.perf_counter() - start < 5


def test_a_line_of_exactly_the_limit_is_read(tmp_path):
    line = '{"messages": [{"role": "user", "content": "%s"}]}'
    body = line % ("x" * (200 - len(line % "")))
    assert len(body) == 200
    path = tmp_path / "edge.jsonl"
    path.write_text(body + "\n" + body)  # the last line without its newline
    assert len(read_conversations(path, max_line_bytes=200)) == 2


def test_a_huge_conversation_is_rendered_and_tokenized_only_within_the_budget(tokenizer):
    seq_len = 32
    recording = RecordingTokenizer(tokenizer)
    huge = _chat("the cat sat on the mat " * 100_000, turns=3)  # 7 MB of content
    [example] = build_examples(recording, [huge], seq_len=seq_len, progress=False)
    assert len(example.input_ids) == seq_len
    budget = char_budget(seq_len)
    assert max(recording.rendered) <= budget and max(recording.tokenized) <= budget


def test_a_cut_conversation_keeps_the_tokens_and_mask_of_the_full_one(tokenizer):
    seq_len = 40
    long = _chat("the cat sat on the mat and looked at the dog. " * 200, turns=2)
    assert sum(len(m["content"]) for m in long) > char_budget(seq_len)  # the cut path
    full = tokenize_conversation(tokenizer, long)
    [example] = build_examples(tokenizer, [long], seq_len=seq_len, progress=False)
    assert example.input_ids == full.input_ids[:seq_len] and example.loss_mask == full.loss_mask[:seq_len]


def test_a_cut_conversation_is_dropped_without_tokenizing_it(tokenizer, caplog):
    recording = RecordingTokenizer(tokenizer)
    many_turns = _chat("two plus two is four.", turns=100)  # 200 messages, each at least one token
    huge = _chat("the sea and the sky " * 50_000)
    with caplog.at_level(logging.INFO, logger="dflash.data"):
        examples = build_examples(
            recording, [CONVERSATIONS[0], many_turns, huge], seq_len=64, overflow="drop", progress=False
        )
    assert len(examples) == 1 and len(recording.tokenized) == 1
    assert "3 conversations, 2 longer than seq_len=64 (dropped)" in caplog.text


def test_most_conversations_over_seq_len_draw_a_warning_naming_the_flag(tokenizer, caplog):
    long_chats = [_chat("the sea and the sky " * 20), _chat("two plus two is four.", turns=10)]
    with caplog.at_level(logging.INFO, logger="dflash.data"):
        build_examples(tokenizer, [CONVERSATIONS[0], *long_chats], seq_len=48, overflow="truncate", progress=False)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "2 of 3 conversations are longer than --seq-len 48 and were cut" in warned[0].message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.data"):
        build_examples(tokenizer, [*CONVERSATIONS, long_chats[0]], seq_len=96, overflow="truncate", progress=False)
    assert "2 longer than seq_len=96" in caplog.text
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # 2 of 5: no warning


def test_a_template_error_names_the_conversation(tokenizer):
    # A template that rewrites the last message: the turn is located by its content, which
    # "42 42" survives and "the sea" does not.
    fine = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "42 42"}]
    broken = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the sea"}]
    upper_last = tokenizer.chat_template.replace(
        "{{ m['content'] }}", "{% if loop.last %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}"
    )
    with chat_template(tokenizer, upper_last):
        with pytest.raises(DatasetError, match=r"chats\.jsonl: conversation 2: assistant turn 1 not found"):
            build_examples(tokenizer, [fine, broken], seq_len=64, source="chats.jsonl", progress=False)


def test_many_conversations_show_progress(tokenizer, monkeypatch, capsys):
    monkeypatch.setattr("dflash.data.tokenize._PROGRESS_CONVERSATIONS", 4, raising=False)
    build_examples(tokenizer, CONVERSATIONS * 2, seq_len=64, source="/x/chats.jsonl")
    assert "tokenizing chats.jsonl" in capsys.readouterr().err
    build_examples(tokenizer, CONVERSATIONS * 2, seq_len=64, progress=False)
    assert "tokenizing" not in capsys.readouterr().err


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("path", ["build_examples", "prompt_that_fits"])
def test_the_indexing_errors_warning_is_silenced_only_where_ids_are_cut(tmp_path, path):
    from dflash.data.regenerate import prompt_that_fits

    fresh = make_tokenizer(tmp_path / "tok")  # transformers warns once per tokenizer object
    fresh.model_max_length = 16
    capture = _Capture()
    logging.getLogger("transformers").addHandler(capture)
    try:
        if path == "build_examples":
            build_examples(fresh, CONVERSATIONS, seq_len=64, progress=False)
        else:
            for conversation in CONVERSATIONS:
                prompt_that_fits(fresh, conversation, max_prompt_tokens=64)
        assert not [m for m in capture.messages if "indexing errors" in m]
        fresh("the cat sat on the mat and looked at the dog " * 4)  # a caller that feeds the model is warned
        assert [m for m in capture.messages if "indexing errors" in m]
    finally:
        logging.getLogger("transformers").removeHandler(capture)
