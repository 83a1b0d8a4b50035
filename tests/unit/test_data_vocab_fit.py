"""A tokenizer that emits ids past the target's embedding (``len(tokenizer) > vocab_size``, e.g. added
tokens the model was never resized for) is refused with the id and the fix before training, instead of
an IndexError from the embedding some steps in. In-process; builds a tiny target (a few seconds)."""

import pytest
from tiny import make_target, train_config, write_chat_data

from dflash.data.chats import DatasetError
from dflash.data.tokenize import Example, check_token_ids
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


def test_ids_inside_the_vocabulary_pass():
    check_token_ids([Example([0, 5, 9], [0, 1, 1])], vocab_size=10, source="d.jsonl")


def test_an_id_past_the_vocabulary_names_id_rows_and_fix():
    examples = [Example([0, 5], [0, 1]), Example([3, 12, 10], [0, 1, 1])]
    with pytest.raises(
        DatasetError, match=r"d\.jsonl: token id 12 is past the target.s embedding of 10 rows .*1 of 2 tokenized"
    ):
        check_token_ids(examples, vocab_size=10, source="d.jsonl")


def test_the_trainer_refuses_a_target_smaller_than_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = make_target(tmp_path / "target", num_layers=5)
    vocab = len(AutoTokenizer.from_pretrained(target))
    model = AutoModelForCausalLM.from_pretrained(target)
    model.resize_token_embeddings(vocab - 40)  # the BPE merges learned last are the ones cut off
    model.save_pretrained(target)
    config = train_config(target=target, data=write_chat_data(tmp_path / "d.jsonl"), out=tmp_path / "run")
    with pytest.raises(
        DatasetError, match=rf"token id \d+ is past the target.s embedding of {vocab - 40} rows.*use the tokenizer"
    ):
        Trainer(settle(config))
