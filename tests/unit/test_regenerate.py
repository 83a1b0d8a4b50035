"""dflash.regenerate: the target's replies, kept per process in a journal, continued after a
stop, shared out between processes and joined by rank 0."""

import json
import math
import threading

import pytest
from tiny import CONVERSATIONS, make_target

from dflash.regenerate import ReplyJournal, regenerate_replies, regenerated_corpus
from dflash.target import load_target, load_tokenizer

KEY = {"data_sha256": "abc", "seq_len": 96}
# The last one has no prompt before its assistant turn: it gets a null reply.
INDEXED = list(enumerate(CONVERSATIONS * 2 + [[{"role": "assistant", "content": "hi"}]]))
SETTINGS = dict(seq_len=96, max_new_tokens=4)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("regenerate") / "target", num_layers=2)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, num_capture_layers=1, device="cpu")


def test_the_journal_keeps_whole_lines_and_forgets_other_settings(tmp_path):
    journal = ReplyJournal(tmp_path / "journal", KEY)
    assert journal.open() == {}
    journal.add({0: "a", 1: None})
    journal.close()
    with open(journal.path, "a", encoding="utf-8") as f:
        f.write('{"i": 2, "rep')  # the process died while writing this line
    assert ReplyJournal(journal.path, KEY).read() == {0: "a", 1: None}
    again = ReplyJournal(journal.path, KEY)
    assert again.open() == {0: "a", 1: None}
    again.add({2: "c"})
    again.close()
    assert ReplyJournal(journal.path, KEY).read() == {0: "a", 1: None, 2: "c"}
    assert ReplyJournal(journal.path, {**KEY, "seq_len": 128}).read() == {}


def test_a_stopped_regeneration_continues_where_it_stopped(target, target_dir, tmp_path, monkeypatch, caplog):
    tokenizer = load_tokenizer(target_dir)
    reference = regenerate_replies(
        target, tokenizer, INDEXED, ReplyJournal(tmp_path / "ref", KEY), batch_size=2, **SETTINGS
    )
    assert reference[len(INDEXED) - 1] is None and all(isinstance(reference[i], str) for i in range(8))

    generate, calls = target.model.generate, []

    def counted(*args, **kwargs):
        calls.append(1)
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt  # what SIGINT, or SIGTERM during regeneration, raises
        return generate(*args, **kwargs)

    monkeypatch.setattr(target.model, "generate", counted)
    journal, stop_at = ReplyJournal(tmp_path / "journal", KEY), 3
    with pytest.raises(KeyboardInterrupt):
        regenerate_replies(target, tokenizer, INDEXED, journal, batch_size=2, **SETTINGS)
    kept = journal.read()
    assert sum(r is not None for r in kept.values()) == 4  # the two whole batches before the stop
    assert (
        f"regeneration stopped: {len(kept)} of this share's {len(INDEXED)} replies are kept in {journal.path}"
        in caplog.text
    )
    calls.clear()
    stop_at = None
    assert regenerate_replies(target, tokenizer, INDEXED, journal, batch_size=2, **SETTINGS) == reference
    assert len(calls) == math.ceil((8 - 4) / 2)  # only what the first run had not done


def test_processes_share_the_conversations_and_rank_0_joins_them(target, target_dir, tmp_path, monkeypatch):
    conversations = [c for _, c in INDEXED]
    alone = regenerated_corpus(
        [target],
        load_tokenizer(target_dir),
        conversations,
        tmp_path / "alone" / "regenerated.jsonl",
        key=KEY,
        resume=False,
        rank=0,
        world_size=1,
        progress=False,
        **SETTINGS,
    )
    assert len(alone) == 8

    # Two "processes" as threads that meet at the barriers.
    monkeypatch.setattr("dflash.regenerate.barrier", threading.Barrier(2, timeout=120).wait)
    cache, results = tmp_path / "shared" / "regenerated.jsonl", {}

    def process(rank):
        results[rank] = regenerated_corpus(
            [target],
            load_tokenizer(target_dir),
            conversations,
            cache,
            key=KEY,
            resume=False,
            rank=rank,
            world_size=2,
            progress=False,
            **SETTINGS,
        )

    threads = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == alone
    assert json.loads((cache.parent / "regenerated.jsonl.key.json").read_text()) == KEY
    assert sorted(p.name for p in cache.parent.iterdir()) == ["regenerated.jsonl", "regenerated.jsonl.key.json"]


def test_a_cache_is_reused_for_the_same_key_only(target, target_dir, tmp_path, monkeypatch):
    conversations, cache = [c for _, c in INDEXED], tmp_path / "regenerated.jsonl"
    tokenizer = load_tokenizer(target_dir)
    settings = dict(rank=0, world_size=1, progress=False, **SETTINGS)
    first = regenerated_corpus([target], tokenizer, conversations, cache, key=KEY, resume=False, **settings)

    def refuse(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(target.model, "generate", refuse)
    assert regenerated_corpus([target], tokenizer, conversations, cache, key=KEY, resume=False, **settings) == first
    other = {**KEY, "data_sha256": "def"}
    assert regenerated_corpus([target], tokenizer, conversations, cache, key=other, resume=True, **settings) == first
    with pytest.raises(AssertionError, match="generated again"):
        regenerated_corpus([target], tokenizer, conversations, cache, key=other, resume=False, **settings)


def test_every_target_of_a_process_regenerates_a_share(target, target_dir, tmp_path):
    conversations = [c for _, c in INDEXED]
    common = dict(key=KEY, resume=False, rank=0, world_size=1, progress=False, **SETTINGS)
    tokenizer = load_tokenizer(target_dir)
    alone = regenerated_corpus([target], tokenizer, conversations, tmp_path / "one" / "r.jsonl", **common)
    second = load_target(target_dir, num_capture_layers=1, device="cpu")
    cache = tmp_path / "two" / "r.jsonl"
    generate, calls = second.model.generate, []

    def recorded(*args, **kwargs):
        calls.append(threading.current_thread() is not threading.main_thread())
        return generate(*args, **kwargs)

    second.model.generate = recorded
    assert regenerated_corpus([target, second], tokenizer, conversations, cache, **common) == alone
    assert calls and all(calls)  # the second target did its share, in a thread of its own


def test_the_first_sigterm_interrupts_regeneration_and_a_second_one_kills(caplog):
    import os
    import signal
    import time

    from dflash.regenerate import _sigterm_interrupts

    before = signal.getsignal(signal.SIGTERM)
    with _sigterm_interrupts():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            pytest.fail("SIGTERM did not interrupt")
        except KeyboardInterrupt:
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second one ends the process
    assert signal.getsignal(signal.SIGTERM) is before
    assert "SIGTERM received: stopping the regeneration after the batches in flight" in caplog.text
