"""The tokenized-data cache's worker processes give the tokens one process gives, part by part
(dflash/data/token_cache.py; the rest of the cache: tests/unit/test_data_token_cache.py)."""

from tiny import training_inputs

import dflash.data.token_cache
from dflash.data.chats import read_conversations
from dflash.data.token_cache import TokenCache
from dflash.data.tokenize import build_examples
from dflash.target_model.files import load_tokenizer


def test_worker_processes_give_the_tokens_of_one_process(tmp_path, monkeypatch):
    assets = training_inputs(tmp_path / "inputs")
    monkeypatch.setattr(dflash.data.token_cache, "PART_SIZE", 3)  # 16 conversations: 6 parts
    tokenizer = load_tokenizer(assets["target"])
    conversations = read_conversations(assets["data"])
    alone = build_examples(tokenizer, conversations, seq_len=48, source="chats", progress=False)
    cache = TokenCache(tmp_path / "tokenized", {"k": 1})
    settings = dict(seq_len=48, overflow="truncate", source="chats", progress=False, write=True)
    tokens = cache.tokenize(tokenizer, conversations, workers=2, **settings)
    assert tokens.examples == alone and tokens.conversations == 16
    assert cache.complete().examples == alone
    assert sorted(p.name for p in cache.dir.glob("part_*")) == [f"part_{i:05d}.safetensors" for i in range(6)]
