"""The drafter shapes at a public model's width on one GPU (skipped without CUDA): random targets
built from the public configs of Qwen3-8B (dense) and Qwen3.6-27B (hybrid qwen3_5), cut to 8 decoder
layers, trained a few compiled bf16 steps with the drafter each rule gives them (the published
Qwen3.6 drafter: 5 layers, 4 sliding and causal within the block, 32 / 8 / 128, block 16); one
compile, finite loss.

    python -m pytest tests/integration/test_drafter_shapes_gpu.py -q -s
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_tokenizer, train_config, write_chat_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a public model's width needs a GPU")

LAYERS = 8  # enough for 5 distinct default taps


def _cut(shape: str):
    """The first LAYERS layers of a public shape of benchmarks/shapes.py: (model class, config)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from shapes import SHAPES, dense_text_config, hybrid_text_config
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    if SHAPES[shape]["arch"] == "qwen3_5":
        return Qwen3_5ForCausalLM, hybrid_text_config(shape, LAYERS)
    return Qwen3ForCausalLM, dense_text_config(shape, LAYERS)


@pytest.mark.parametrize(
    ("shape", "flags", "expected"),
    [
        ("qwen3-8b", dict(block_size=16, num_draft_layers=5, num_target_layers=5), (5, 32, 8, 128, None)),
        ("qwen3.6-27b", dict(pack=False), (5, 32, 8, 128, 2048)),
    ],
    ids=["qwen3-8b-width", "qwen3.6-27b-width"],
)
def test_a_public_width_target_trains_its_drafter_compiled_once(tmp_path, shape, flags, expected):
    from dflash.run.settle import settle
    from dflash.train.trainer import Trainer

    model_cls, config = _cut(shape)
    tokenizer = make_tokenizer(tmp_path / "target")
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.device("cuda"):
        model_cls(config).to(torch.bfloat16).save_pretrained(tmp_path / "target")
    torch.cuda.empty_cache()
    # Shape fields empty (the rule), then the test's flags.
    run = dict(block_size=None, num_target_layers=None, gamma=None, seq_len=512, batch_size=2, max_anchors=64)
    run |= dict(steps=6, log_every=1, save=False, compile="on", responses="data", warmup_steps=1, lr=1e-4)
    data = write_chat_data(tmp_path / "d.jsonl", 16)
    config = train_config(target=tmp_path / "target", data=data, out=tmp_path / "r", device="cuda", **run | flags)
    trainer = Trainer(settle(config))
    drafter = trainer.drafter.config
    layers, heads, kv_heads, head_dim, window = expected
    geometry = (drafter.num_hidden_layers, drafter.num_attention_heads, drafter.num_key_value_heads, drafter.head_dim)
    assert geometry == (layers, heads, kv_heads, head_dim) and drafter.sliding_window == window
    # The engines' rule (no is_causal): the sliding layers see their block causally, the full one whole.
    assert [drafter.layer_is_causal(kind) for kind in drafter.layer_types] == [
        kind == "sliding_attention" for kind in drafter.layer_types
    ]
    assert drafter.block_size == 16 and not {"partial_rotary_factor", "mrope_section"} & set(drafter.rope_parameters)
    metrics = trainer.train()
    assert math.isfinite(metrics["loss"])
    for name, counts in trainer.engine.compile_summary().items():
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(name, counts, f"{metrics['tokens_per_s']:.0f} tok/s, peak {peak:.1f} GiB")
        assert counts["compiles"] == 1 and not counts["unexpected_recompiles"] and not counts["graph_breaks"], counts
