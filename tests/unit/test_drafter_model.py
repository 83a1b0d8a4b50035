"""The DFlash drafter model (dflash/drafter/model.py): config, layout, attention paths, train/infer agreement."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import flex_eager, tiny_target_config
from transformers import LlamaConfig, Qwen3Config

from dflash import masks
from dflash.drafter.hf_config import rope_parameters_of
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.drafter.modeling_dflash import DFlashDraftConfig
from dflash.target_model.taps import default_target_layer_ids

HIDDEN, VOCAB, BLOCK = 32, 64, 4
MASK_ID = VOCAB - 1


def _drafter(attn: str = "sdpa", *, layers: int = 2, seed: int = 0, arch: str = "dflash") -> AnchoredDrafter:
    config = create_drafter_config(
        tiny_target_config(), layers, block_size=BLOCK, num_captured_layers=3, mask_token_id=MASK_ID, arch=arch
    )
    torch.manual_seed(seed)
    model = AnchoredDrafter._from_config(config, attn_implementation=attn).eval()
    # Non-trivial norms (and DFlash2 convolutions), so a bug in where one applies cannot hide behind
    # an identity.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "_conv." in name:
                p.normal_(0.0, 0.3)
    return model


def _batch(model: AnchoredDrafter, *, batch=2, seq_len=19, num_anchors=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (batch, seq_len), generator=gen)
    loss_mask = torch.rand(batch, seq_len, generator=gen) < 0.8
    anchors, valid = masks.sample_anchors(loss_mask, num_anchors, generator=gen)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    torch.nn.init.normal_(embed.weight, generator=gen)
    width = len(model.config.target_layer_ids) * HIDDEN
    target_hidden = torch.randn(batch, seq_len, width, generator=gen)
    draft_embeds = embed(masks.draft_input_ids(input_ids, anchors, valid, BLOCK, MASK_ID)).detach()
    return draft_embeds, target_hidden, anchors, valid


def test_default_target_layer_ids_public_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(5, 2) == [1, 2]
    with pytest.raises(ValueError, match="--num-target-layers 3: .* at most 2 .* pass --num-target-layers 2"):
        default_target_layer_ids(5, 3)


@pytest.mark.parametrize("config_cls", [Qwen3Config, LlamaConfig])
def test_create_drafter_config_copies_target_geometry(config_cls):
    target = config_cls(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_theta=5e5,  # the spelling transformers 4.x and 5.x both accept
    )
    config = create_drafter_config(target, 3, mask_token_id=MASK_ID)
    for field in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert getattr(config, field) == getattr(target, field), field
    assert rope_parameters_of(config.to_dict())["rope_theta"] == 5e5
    assert config.num_hidden_layers == 3 and config.num_target_layers == 36 and config.block_size == 16
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.architectures == ["DFlashDraftModel"] and config.model_type == "qwen3"


def test_create_drafter_config_clips_taps_for_a_small_target():
    config = create_drafter_config(tiny_target_config(num_hidden_layers=4), 1, mask_token_id=MASK_ID)
    assert config.target_layer_ids == [2]  # 4 layers allow 1 default tap: L // 2
    explicit = create_drafter_config(tiny_target_config(), 1, target_layer_ids=[0, 7], mask_token_id=MASK_ID)
    assert explicit.target_layer_ids == [0, 7]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=1), "block_size"),
        (dict(dflash_config={"mask_token_id": VOCAB, "target_layer_ids": [1]}), "mask_token_id"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [8]}), "target_layer_ids"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 1]}), "target_layer_ids"),
        (dict(dflash_config={"mask_token_id": 1}), "target_layer_ids"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DFlashDraftConfig(vocab_size=VOCAB, num_target_layers=8, **kwargs)


def test_save_load_round_trip_uses_the_z_lab_layout(tmp_path):
    model = _drafter()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in per_layer
    }
    assert names == expected
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [HIDDEN, 3 * HIDDEN]

    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == BLOCK and raw["num_target_layers"] == 8
    assert raw["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5]}
    assert raw["num_hidden_layers"] == 2

    loaded = AnchoredDrafter.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    batch = _batch(model)
    with torch.no_grad():
        assert torch.equal(model(*batch), loaded(*batch))


def test_flex_and_sdpa_paths_agree(monkeypatch):
    model = _drafter("sdpa")
    batch = _batch(model, num_anchors=8)
    batch[3][:, -1] = False  # with a padding block
    with torch.no_grad():
        sdpa = model(*batch)
    flex = flex_eager(monkeypatch, model, *batch)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    # The comparison can fail: the off-by-one mask (kv <= anchor) gives a different result.
    anchors, valid = batch[2], batch[3]
    leaky = masks.build_block_mask(anchors + 1, valid, batch[1].shape[1], BLOCK)
    wrong = flex_eager(monkeypatch, model, *batch, attention_mask=leaky)
    assert (wrong - sdpa).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_training_blocks_equal_inference_with_truncated_context(arch):
    """Block b of the batched training forward == drafting that block after context[:a_b].

    Pins strict context visibility, RoPE positions (context j at j, slot k at a + k) and block
    isolation at once (for DFlash2, its convolutions' too), and shows that training and
    ``draft_block`` compute the same function.
    """
    model = _drafter("sdpa", layers=2, arch=arch)
    draft_embeds, target_hidden, anchors, valid = _batch(model, batch=2, seq_len=23, num_anchors=6)
    valid[0, -1] = False  # make sure one padding block is present
    with torch.no_grad():
        batched = model(draft_embeds, target_hidden, anchors, valid)
        for b in range(anchors.shape[0]):
            for n in range(anchors.shape[1]):
                if not valid[b, n]:
                    continue
                a = int(anchors[b, n])
                rows = slice(n * BLOCK, (n + 1) * BLOCK)
                single = model.block_hidden(target_hidden[b : b + 1, :a], draft_embeds[b : b + 1, rows])
                torch.testing.assert_close(batched[b : b + 1, rows], single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_block_output_ignores_future_context_and_other_blocks(arch):
    model = _drafter("sdpa", arch=arch)
    draft_embeds, target_hidden, anchors, valid = _batch(model, batch=1, seq_len=19, num_anchors=3)
    valid[:] = True
    anchors[0] = torch.tensor([4, 9, 15])
    with torch.no_grad():
        base = model(draft_embeds, target_hidden, anchors, valid)
        poked_hidden = target_hidden.clone()
        poked_hidden[:, 9] += 10.0  # context at the anchor of block 1: visible to block 2 only
        poked_embeds = draft_embeds.clone()
        poked_embeds[:, 0] += 10.0  # a token of block 0
        out = model(poked_embeds, poked_hidden, anchors, valid)
    changed = (out - base).abs().amax(-1)[0].view(3, BLOCK).amax(-1)
    assert changed[0] > 1e-3 and changed[1] < 1e-6 and changed[2] > 1e-3


def test_draft_block_returns_argmax_tokens():
    model = _drafter()
    target_hidden = torch.randn(1, 7, 3 * HIDDEN)
    block = torch.randn(1, BLOCK, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    tokens = model.draft_block(target_hidden, block, head, torch.tensor([5]))
    assert tokens.shape == (1, BLOCK - 1) and tokens.dtype == torch.long
    with torch.no_grad():
        assert torch.equal(tokens, head(model.block_hidden(target_hidden, block)[:, 1:]).argmax(-1))


def test_padding_blocks_are_finite_and_get_no_attention_gradient():
    model = _drafter("sdpa")
    model.train()
    draft_embeds, target_hidden, anchors, valid = _batch(model, num_anchors=6)
    valid[:, -2:] = False
    target_hidden.requires_grad_(True)
    out = model(draft_embeds, target_hidden, anchors, valid)
    assert torch.isfinite(out).all()
    # Loss on padding rows only: they attend to nothing, so no gradient reaches the context.
    pad_rows = out.view(out.shape[0], -1, BLOCK, HIDDEN)[:, -2:]
    pad_rows.sum().backward()
    assert torch.isfinite(target_hidden.grad).all() and target_hidden.grad.abs().max() == 0


def test_bad_inputs_raise_clear_errors():
    model = _drafter()
    draft_embeds, target_hidden, anchors, valid = _batch(model)
    with pytest.raises(ValueError, match="K\\*H"):
        model(draft_embeds, target_hidden[..., :-1], anchors, valid)
    with pytest.raises(ValueError, match="does not match anchors"):
        model(draft_embeds[:, :-1], target_hidden, anchors, valid)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="not supported"):
        model(draft_embeds, target_hidden, anchors, valid)


def test_the_portable_file_taps_the_same_layers_as_the_trainer():
    """modeling_dflash.py carries its own copy of the tap formula (it imports nothing of dflash)."""
    from dflash.drafter import modeling_dflash
    from dflash.target_model import taps

    for num_layers in range(1, 81):
        for captured in range(1, min(8, modeling_dflash.max_captured_layers(num_layers)) + 1):
            assert modeling_dflash.default_target_layer_ids(num_layers, captured) == (
                taps.default_target_layer_ids(num_layers, captured)
            ), (num_layers, captured)
        assert modeling_dflash.max_captured_layers(num_layers) == taps.max_captured_layers(num_layers)
