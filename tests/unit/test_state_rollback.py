"""dflash.state_rollback: greedy speculative decoding against a hybrid (Qwen3.5 / Qwen3.6) target
equals target-only greedy decoding, its linear-attention states rolled back after every rejection."""

import random

import pytest
import torch

from dflash.target import load_target


class _OracleWithErrors:
    """Drafts the target's greedy continuation with a random number of correct slots per block
    (0 to all), so every rollback length and the whole-block case occur."""

    def __init__(self, config, reference: list[int], prompt_len: int, seed: int):
        self.config, self.reference, self.prompt_len = config, reference, prompt_len
        self.rng = random.Random(seed)

    def draft_block(self, target_hidden, block_embeds, lm_head):
        start = target_hidden.shape[1] - self.prompt_len + 1
        n = self.config.block_size - 1
        truth = (self.reference + [0] * (start + n))[start : start + n]
        correct = self.rng.randint(0, n)
        return torch.tensor([truth[:correct] + [(t + 1) % 200 for t in truth[correct:]]])


@pytest.mark.parametrize("strategy", ["mixers", "forward"])
def test_speculative_decoding_equals_greedy_decoding(hybrid_dir, strategy):
    from types import SimpleNamespace

    from dflash.evaluate import greedy_generate, speculative_generate

    target = load_target(hybrid_dir, layer_ids=[1, 6], device="cpu")
    config = SimpleNamespace(block_size=5, mask_token_id=3, target_layer_ids=[1, 6])
    lengths = []
    for seed in range(3):
        prompt = torch.randint(5, 200, (1, 7 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        greedy = greedy_generate(target, prompt, max_new_tokens=40, eos_ids=set())
        drafter = _OracleWithErrors(config, greedy.tokens, prompt.shape[1], seed)
        spec = speculative_generate(
            target, drafter, prompt, max_new_tokens=40, eos_ids=set(), rollback_strategy=strategy
        )
        assert spec.tokens == greedy.tokens
        lengths += spec.full_accept_lengths
    assert set(lengths) == set(range(1, config.block_size + 1))  # every rejection point, and whole blocks


def test_an_unknown_rollback_strategy_is_named(hybrid_dir):
    from dflash.state_rollback import StateRollback, new_cache

    target = load_target(hybrid_dir, layer_ids=[1], device="cpu")
    with pytest.raises(ValueError, match=r"'undo'.*mixers"):
        StateRollback(target, new_cache(target), "undo")
