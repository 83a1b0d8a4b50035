"""Where dflash.data.tokenize's fallback search for an assistant turn starts when the generation prompt is not
in the full rendering (DeepSeek-R1-style templates open the reply with ``<think>\\n`` and drop the
reasoning of every assistant turn). Fast, in-process (tiny tokenizer, no model)."""

import pytest
from tiny import make_tokenizer, supervised_text

from dflash.data.tokenize import tokenize_conversation

# DeepSeek-R1's rules in ChatML tokens: every assistant turn is rendered without the reasoning that
# ends at its ``</think>``, and the generation prompt opens the reply with ``<think>\n``.
R1_STYLE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = R1_STYLE
    return tok


def test_an_answer_the_user_quoted_is_supervised_in_the_assistant_turn(tokenizer):
    conversation = [
        {"role": "user", "content": "repeat after me: the cat sat"},
        {"role": "assistant", "content": "<think>\nan echo\n</think>\n\nthe cat sat"},
    ]
    example = tokenize_conversation(tokenizer, conversation)
    text = tokenizer.decode(example.input_ids)
    assert text.endswith("<|im_start|>assistant\nthe cat sat<|im_end|>\n"), text
    # The user's quote is context; the assistant's answer and its end are the supervised tokens.
    supervised_ids = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    answer_ids = tokenizer("the cat sat<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert supervised_text(tokenizer, example) == "the cat sat<|im_end|>\n"
    assert example.input_ids[-len(answer_ids) :] == answer_ids
    assert example.loss_mask[-len(answer_ids) :] == [1] * len(answer_ids), (
        f"the assistant's answer is not supervised (supervised: {tokenizer.decode(supervised_ids)!r})"
    )
