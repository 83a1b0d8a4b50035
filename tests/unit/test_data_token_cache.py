"""The tokenized-data cache in ``--out``: a resume (or a new run on the same data and settings) reads
the tokens instead of reading and tokenizing the chats again; the key changes with the data, the
tokenizer and chat template, ``--seq-len`` and ``--overflow``; a signal while tokenizing keeps the
finished parts, says so, and the next start tokenizes only the rest (worker processes:
tests/integration/test_token_cache_workers.py)."""

import json
import logging
import os
import shutil
import signal

import pytest
from tiny import CONVERSATIONS, inputs_config, training_inputs, write_jsonl

import dflash.data.token_cache
import dflash.train.corpus
from dflash.data.chats import read_conversations
from dflash.data.token_cache import TokenCache, cache_key
from dflash.data.tokenize import build_examples, tokenize_conversations
from dflash.run.layout import TOKENS_DIR
from dflash.run.settle import settle
from dflash.signals import Stopped
from dflash.target_model.files import load_tokenizer
from dflash.train.trainer import Trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return training_inputs(tmp_path_factory.mktemp("token-cache"))


_config = inputs_config


def _examples(trainer):
    return [(e.input_ids, e.loss_mask) for e in trainer.loader.examples]


def test_a_resume_reads_the_tokens_instead_of_the_chats(assets, tmp_path, monkeypatch, caplog):
    first = Trainer(settle(_config(assets, tmp_path, steps=2, save_every=2)))
    first.train()
    (cache,) = (tmp_path / TOKENS_DIR).iterdir()
    assert json.loads((cache / "key.json").read_text())["seq_len"] == 48

    def fail(*args, **kwargs):
        raise AssertionError("read or tokenized again")

    monkeypatch.setattr(dflash.train.corpus, "read_conversations", fail)
    monkeypatch.setattr(dflash.data.token_cache, "tokenize_conversations", fail)
    with caplog.at_level(logging.INFO):
        resumed = Trainer(settle(_config(assets, tmp_path, steps=3, save_every=2, resume=True)))
    assert _examples(resumed) == _examples(first)
    assert f"tokens read from {cache} (tokenized before with the same data and settings)" in caplog.text
    assert "16 conversations, 8 longer than seq_len=48 (truncated)" in caplog.text  # as on the first start


def test_an_unreadable_part_is_reported_once(tmp_path, caplog):
    """A resume read the damaged part three times before tokenizing it again, and warned three times."""
    cache = TokenCache(tmp_path, {"seq_len": 48})
    cache.dir.mkdir()
    (cache.dir / "complete.json").write_text(json.dumps({"parts": 1}))
    (cache.dir / "part_00000.safetensors").write_text("garbage\n")
    with caplog.at_level(logging.WARNING, logger="dflash.data.token_cache"):
        assert cache.complete() is None and cache.complete() is None
    assert caplog.text.count("part_00000.safetensors: unreadable (") == 1, caplog.text
    assert "tokenizing its conversations again" in caplog.text


def test_the_key_follows_the_data_tokenizer_and_settings(assets, tmp_path):
    target = shutil.copytree(assets["target"], tmp_path / "target")
    base = dict(data_sha256="a" * 64, tokenizer_dir=target, seq_len=48, overflow="truncate")
    key = cache_key(**base)
    assert cache_key(**base) == key
    changed = [
        cache_key(**{**base, "data_sha256": "b" * 64}),
        cache_key(**{**base, "seq_len": 64}),
        cache_key(**{**base, "overflow": "drop"}),
    ]
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    changed.append(cache_key(**base))
    dirs = {TokenCache(tmp_path / "tokenized", k).dir for k in [key, *changed]}
    assert len(dirs) == 5


def test_a_signal_while_tokenizing_keeps_the_finished_parts_and_says_so(assets, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(dflash.data.token_cache, "PART_SIZE", 4)
    tokenizer = load_tokenizer(assets["target"])
    conversations = read_conversations(assets["data"])
    calls, killed = [], []

    def tokenize_then_sigterm(*args, **kwargs):
        calls.append(kwargs["first"])
        if len(calls) == 2 and not killed:
            killed.append(os.kill(os.getpid(), signal.SIGTERM))  # arrives while the second part is tokenized
        return tokenize_conversations(*args, **kwargs)

    monkeypatch.setattr(dflash.data.token_cache, "tokenize_conversations", tokenize_then_sigterm)
    cache = TokenCache(tmp_path / "tokenized", {"k": 1})
    settings = dict(seq_len=48, overflow="truncate", source="chats.jsonl", progress=False, write=True, workers=1)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped:
        cache.tokenize(tokenizer, conversations, **settings)
    assert stopped.value.signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == handler
    assert (
        f"chats.jsonl: stopped by SIGTERM while tokenizing: the tokens of 8 of 16 conversations are kept in "
        f"{cache.dir}; start the same run again to tokenize the rest"
    ) in caplog.text
    assert cache.complete() is None
    calls.clear()
    tokens = cache.tokenize(tokenizer, conversations, **settings)
    assert calls == [9, 13]  # only the parts not kept
    assert tokens.examples == build_examples(tokenizer, conversations, seq_len=48, source="c", progress=False)


def test_dflash_train_stopped_while_tokenizing_exits_with_the_signal(assets, tmp_path, monkeypatch, caplog):
    from dflash.cli import main

    def stop(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return tokenize_conversations(*args, **kwargs)

    monkeypatch.setattr(dflash.data.token_cache, "tokenize_conversations", stop)
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS * 4])
    argv = ["train", "--target", str(assets["target"]), "--data", str(data), "--out", str(tmp_path / "out")]
    assert main([*argv, "--num-target-layers", "2", "--device", "cpu", "--no-progress"]) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM while tokenizing: the tokens of 16 of 16 conversations are kept" in caplog.text
    assert "nothing to --resume" not in caplog.text  # it said what it kept
