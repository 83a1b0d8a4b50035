"""dflash.drafter.mask_token: the mask id is resolved in the public trainers' order, never past the embedding."""

from __future__ import annotations

import logging

import pytest
from tiny import make_tokenizer

from dflash.drafter import mask_token
from dflash.drafter.mask_token import resolve_mask_token_id


@pytest.fixture
def tokenizer(tmp_path):
    tok = make_tokenizer(tmp_path)  # 300 tokens: pad 0, eos 2, mask 3, no unk
    assert (len(tok), tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (300, 0, 2, 3)
    return tok


def _resolve(tokenizer, explicit=None, drafter_config=None, vocab_size=512):
    return resolve_mask_token_id(
        explicit=explicit, drafter_config=drafter_config, tokenizer=tokenizer, vocab_size=vocab_size
    )


def test_each_source_in_order(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="dflash.drafter.mask_token")
    assert _resolve(tokenizer, explicit=7, drafter_config={"mask_token_id": 9}) == (7, mask_token.EXPLICIT)
    assert _resolve(tokenizer, drafter_config={"mask_token_id": 9}) == (9, mask_token.DRAFTER_CONFIG)
    assert _resolve(tokenizer) == (3, mask_token.TOKENIZER_MASK)
    assert "mask token id 3 (from the tokenizer mask token)" in caplog.text
    tokenizer.mask_token = None
    # Qwen3's case: no mask token, len(tokenizer) 151669 < vocab 151936 -> row 151669.
    assert _resolve(tokenizer) == (300, mask_token.UNUSED_ROW)
    assert _resolve(tokenizer, vocab_size=300) == (0, "tokenizer pad token")
    assert "a real token also fills the draft slots" in caplog.text
    tokenizer.pad_token = None
    assert _resolve(tokenizer, vocab_size=300) == (2, "tokenizer eos token")


def test_ids_outside_the_embedding_are_refused_or_skipped(tokenizer):
    not_a_row = r"512 from the --mask-token-id is not a row of the target embedding \[0, 512\)"
    with pytest.raises(ValueError, match=not_a_row):
        _resolve(tokenizer, explicit=512)
    with pytest.raises(ValueError, match="-1 from the --mask-token-id"):
        _resolve(tokenizer, explicit=-1)
    with pytest.raises(ValueError, match="from the drafter config dflash_config.mask_token_id"):
        _resolve(tokenizer, drafter_config={"mask_token_id": 600})
    # A tokenizer whose mask token lies past a smaller embedding is skipped, not used.
    assert _resolve(tokenizer, vocab_size=3) == (0, "tokenizer pad token")
    tokenizer.mask_token = tokenizer.pad_token = tokenizer.eos_token = None
    with pytest.raises(ValueError, match="pass --mask-token-id"):
        _resolve(tokenizer, vocab_size=300)
