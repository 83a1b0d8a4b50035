"""dflash.target_model.rollback: greedy speculative decoding against a hybrid (Qwen3.5 / Qwen3.6) target
equals target-only greedy decoding, its linear-attention states rolled back after every rejection."""

import pytest
import torch
from tiny import ScriptedDrafter

from dflash.evaluation.sampling import GREEDY_DECODER
from dflash.target_model.model import load_target


@pytest.mark.parametrize("strategy", ["mixers", "forward"])
def test_speculative_decoding_equals_greedy_decoding(hybrid_dir, strategy):
    from types import SimpleNamespace

    from dflash.evaluation.decoding import speculative_generate, target_generate

    target = load_target(hybrid_dir, layer_ids=[1, 6], device="cpu")
    config = SimpleNamespace(block_size=5, mask_token_id=3, target_layer_ids=[1, 6])
    lengths = []
    for seed in range(3):
        prompt = torch.randint(5, 200, (1, 7 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        greedy = target_generate(target, prompt, max_new_tokens=24, eos_ids=set(), decoder=GREEDY_DECODER)
        drafter = ScriptedDrafter(config, greedy.tokens, prompt.shape[1], seed=seed)
        spec = speculative_generate(
            target,
            drafter,
            prompt,
            max_new_tokens=24,
            eos_ids=set(),
            rollback_strategy=strategy,
            decoder=GREEDY_DECODER,
        )
        assert spec.tokens == greedy.tokens
        lengths += spec.accept_lengths
    assert set(lengths) == set(range(1, config.block_size + 1))  # every rejection point, and whole blocks


def test_an_unknown_rollback_strategy_is_named(hybrid_dir):
    from dflash.target_model.rollback import StateRollback, new_cache

    target = load_target(hybrid_dir, layer_ids=[1], device="cpu")
    with pytest.raises(ValueError, match=r"'undo'.*mixers"):
        StateRollback(target, new_cache(target), "undo")


def test_a_sliding_window_target_decodes_past_its_window(tmp_path):
    # A standard target keeps the bare cache whose crop works on every layer kind: built from the
    # config, a sliding-window target's cache refused to crop once the prompt passed the window.
    from types import SimpleNamespace

    from tiny import make_tokenizer
    from transformers import MistralConfig, MistralForCausalLM

    from dflash.evaluation.decoding import speculative_generate, target_generate

    tokenizer = make_tokenizer(tmp_path)
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=8,
        max_position_embeddings=512,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path)
    target = load_target(tmp_path, layer_ids=[1, 2], device="cpu")
    prompt = torch.randint(5, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    greedy = target_generate(target, prompt, max_new_tokens=30, eos_ids=set(), decoder=GREEDY_DECODER)
    drafter = ScriptedDrafter(
        SimpleNamespace(block_size=4, mask_token_id=3, target_layer_ids=[1, 2]), greedy.tokens, prompt.shape[1], seed=0
    )
    assert (
        speculative_generate(target, drafter, prompt, max_new_tokens=30, eos_ids=set(), decoder=GREEDY_DECODER).tokens
        == greedy.tokens
    )
