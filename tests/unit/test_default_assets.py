"""The embedded default target and chat corpus load offline and are what they claim to be."""

from __future__ import annotations

import json
import os

import pytest

from dflash.assets import default_data_dir, default_target_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _read_jsonl(name):
    with open(default_data_dir() / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer():
    os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder must never reach for a hub
    return transformers.AutoTokenizer.from_pretrained(default_target_dir())


@pytest.fixture(scope="module")
def model():
    os.environ["HF_HUB_OFFLINE"] = "1"
    return transformers.AutoModelForCausalLM.from_pretrained(default_target_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout():
    return _read_jsonl("heldout.jsonl")


def test_model_is_a_small_qwen3(model):
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.model_type == "qwen3"
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_chat_template_renders_qwen3_turns(tokenizer):
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hey\nhow are you?"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nhey\nhow are you?<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # Each special marker is one token, so a trainer can find turn boundaries by id.
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tokenizer.eos_token_id) == 2


def test_mask_token_is_a_dedicated_special_row(tokenizer, model, heldout):
    mask_id = tokenizer.mask_token_id
    assert tokenizer.mask_token == "<|mask|>"
    assert model.config.dflash_mask_token_id == mask_id
    assert 0 <= mask_id < model.get_input_embeddings().num_embeddings
    others = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")}
    assert mask_id not in others and len(others) == 3
    assert mask_id in tokenizer.all_special_ids
    text = "\n".join(m["content"] for conv in heldout for m in conv["messages"])
    assert mask_id not in tokenizer(text).input_ids
    assert tokenizer.decode([mask_id, *tokenizer("ok").input_ids], skip_special_tokens=True) == "ok"


def test_chat_files_are_disjoint_alternating_conversations(heldout):
    train = _read_jsonl("train.jsonl")
    assert len(train) >= 500 and len(heldout) >= 100
    for conv in train + heldout:
        roles = [m["role"] for m in conv["messages"]]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m["content"].strip() for m in conv["messages"])
    key = lambda conv: json.dumps(conv["messages"])
    assert not {key(c) for c in train} & {key(c) for c in heldout}
    assert (default_data_dir() / "SOURCE.md").read_text().count("MIT License") == 1


def _heldout_batch(tokenizer, heldout, n=16, length=128):
    rows = [tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=False) for c in heldout]
    rows = [r[:length] for r in rows if len(r) >= length][:n]
    assert len(rows) == n, "too few long held-out conversations"
    return torch.tensor(rows)


def test_shipped_weights_are_trained(tokenizer, model, heldout):
    batch = _heldout_batch(tokenizer, heldout)
    torch.manual_seed(0)
    untrained = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    with torch.no_grad():
        trained_loss = model(input_ids=batch, labels=batch).loss.item()
        untrained_loss = untrained(input_ids=batch, labels=batch).loss.item()
    # An untrained model sits near ln(vocab) = 8.3 nats; the shipped one must be far below it.
    assert untrained_loss > 7.5
    assert trained_loss < untrained_loss - 3.0, (trained_loss, untrained_loss)


def test_greedy_reply_ends_its_turn(tokenizer, model, heldout):
    """The target learned the chat format: greedy replies to held-out openers close with <|im_end|>."""
    ended = 0
    for conv in heldout[:4]:
        prompt = tokenizer.apply_chat_template(
            conv["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=48, do_sample=False)
        ended += tokenizer.eos_token_id in out[0, prompt.shape[1] :].tolist()
    assert ended >= 3
