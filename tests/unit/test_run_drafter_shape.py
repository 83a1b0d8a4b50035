"""The drafter's shape (dflash/run/drafter_shape.py) and RoPE (dflash/drafter/hf_config.py): a Qwen3.5/3.6 target
gets the published drafter's config field by field, with only the RoPE the drafter uses; other
targets keep their own geometry; flags win and contradictions are named."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from tiny import HYBRID_ARCHS, MOE_ARCH, make_target, write_chat_data

from dflash.config import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION, TrainConfig, parse_layer_types
from dflash.drafter import modeling_dflash
from dflash.drafter.hf_config import portable_config
from dflash.drafter.model import drafter_config
from dflash.run.drafter_shape import resolve_drafter_shape
from dflash.target_model.taps import check_taps

needs_qwen3_5 = pytest.mark.skipif(
    not hasattr(__import__("transformers"), "Qwen3_5Config"), reason="Qwen3.5 needs transformers 5"
)

#: z-lab/Qwen3.6-27B-DFlash as SpecForge ships its config (docs: the published drafter's fields).
PUBLISHED_QWEN3_6_27B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 5,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "use_sliding_window": True,
    "max_window_layers": 5,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1e7,
    "rope_scaling": None,
    "max_position_embeddings": 262144,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "num_target_layers": 64,
    "vocab_size": 248320,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}


def _qwen3_6_27b_config() -> dict:
    """Qwen3.6-27B's config.json (the multimodal checkpoint), from its public values: config only."""
    text = {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 64,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "vocab_size": 248320,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 5120,
        },
        "tie_word_embeddings": False,
    }


def _keys(value) -> set[str]:
    """Every key of a nested JSON value."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _config_json_of(train: TrainConfig, target_dir, mask_token_id: int) -> dict:
    """The drafter config.json ``dflash train`` writes for this target (bf16 weights), no weights loaded."""
    from transformers import AutoConfig

    cfg = resolve_drafter_shape(train)
    target = AutoConfig.from_pretrained(target_dir)
    layers = target.get_text_config().num_hidden_layers
    ids = check_taps(layers, layer_ids=cfg.target_layer_ids, num_captured=cfg.num_target_layers)
    config = drafter_config(cfg, target, target_layer_ids=ids, mask_token_id=mask_token_id)
    return json.loads(json.dumps(portable_config(config.to_diff_dict(), dtype=torch.bfloat16)))


@needs_qwen3_5
def test_a_qwen3_6_27b_target_gets_the_published_drafter_config(tmp_path, capsys):
    target_dir = tmp_path / "Qwen3.6-27B"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(_qwen3_6_27b_config()))
    written = _config_json_of(TrainConfig(target=str(target_dir)), target_dir, 248070)
    diff = {k: (v, written.get(k, "<absent>")) for k, v in PUBLISHED_QWEN3_6_27B.items() if written.get(k) != v}
    extra = sorted(set(written) - set(PUBLISHED_QWEN3_6_27B))
    with capsys.disabled():  # the field-by-field comparison, for the record
        print(f"\npublished field: (published, ours) differing: {diff or 'none'}; fields we add: {extra}")
    assert not diff
    # No is_causal, as published: every engine (and our drafter) runs the 4 sliding layers causally.
    assert "is_causal" not in written and written["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert not _keys(written) & {"partial_rotary_factor", "mrope_section", "mrope_interleaved"}
    from dflash.drafter.modeling_dflash import DFlashDraftConfig, DFlashDraftModel

    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDraftModel(DFlashDraftConfig.from_dict(written)).parameters())
    assert 1.65e9 < params < 1.8e9  # about 1.7B, as published


#: z-lab/Qwen3.8-27B-DFlash2's config.json (Qwen3.8-27B has Qwen3.6-27B's shape), the fields a loader reads.
PUBLISHED_QWEN3_8_27B_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": 248070,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [5, 19, 33, 47, 61],
    },
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 262144,
    "max_window_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 5,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "use_sliding_window": True,
    "vocab_size": 248320,
}


@needs_qwen3_5
def test_a_dflash2_drafter_of_a_qwen3_6_27b_target_gets_the_published_dflash2_config(tmp_path, capsys):
    target_dir = tmp_path / "Qwen3.8-27B"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(_qwen3_6_27b_config()))
    written = _config_json_of(TrainConfig(target=str(target_dir), arch="dflash2"), target_dir, 248070)
    theirs = PUBLISHED_QWEN3_8_27B_DFLASH2
    diff = {
        k: (v, written.get(k, "<absent>")) for k, v in theirs.items() if k != "dflash_config" and written.get(k) != v
    }
    nested = {k: (v, written["dflash_config"].get(k)) for k, v in theirs["dflash_config"].items()}
    diff |= {f"dflash_config.{k}": pair for k, pair in nested.items() if pair[0] != pair[1]}
    with capsys.disabled():
        print(f"\npublished DFlash2 field: (published, ours) differing: {diff or 'none'}")
    assert not diff
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7} and written["block_size"] == 8
    from dflash.drafter.modeling_dflash import DFlashDraftConfig, DFlashDraftModel

    with torch.device("meta"):
        model = DFlashDraftModel(DFlashDraftConfig.from_dict(written))
    assert len(model.state_dict()) == 81
    assert 1.9e9 < sum(p.numel() for p in model.parameters()) < 1.95e9  # about 1.92B


def _qwen3_5_35b_a3b_config() -> dict:
    """Qwen3.5-35B-A3B's config.json (multimodal, mixture of experts): config only, the fields
    the drafter reads from its public values (hidden 2048, 40 layers, 256 experts of width 512)."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 40,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "hidden_size": 2048,
        "vocab_size": 248320,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": _qwen3_6_27b_config()["text_config"]["rope_parameters"],
    }
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text}


@needs_qwen3_5
def test_a_qwen3_5_moe_target_gets_the_published_moe_drafter_shape(tmp_path):
    """z-lab/Qwen3.5-35B-A3B-DFlash's shape: 8 full layers, 32 / 4 heads of 128, MLP width 6144
    (the experts have no one width to copy), block 16, taps [1, 10, 19, 28, 37]."""
    target_dir = tmp_path / "Qwen3.5-35B-A3B"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(_qwen3_5_35b_a3b_config()))
    written = _config_json_of(TrainConfig(target=str(target_dir)), target_dir, 248070)
    shape = {k: written[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}
    assert shape == {"num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
    assert written["intermediate_size"] == 6144 and written["hidden_size"] == 2048 and written["block_size"] == 16
    assert written["layer_types"] == [FULL_ATTENTION] * 8 and written["dflash_config"]["target_layer_ids"] == [
        1,
        10,
        19,
        28,
        37,
    ]


@needs_qwen3_5
def test_a_qwen3_5_moe_target_trains(tmp_path):
    """A tiny qwen3_5_moe target passes preflight, loads and trains with the published MoE shape (it
    crashed after loading: the standard rule copies the target's intermediate_size, which MoE lacks)."""
    from dflash.cli import main

    target = make_target(tmp_path / "moe", arch=MOE_ARCH, num_layers=8)
    data = write_chat_data(tmp_path / "chats.jsonl")
    flags = ["--target", str(target), "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu"]
    flags += ["--steps", "1", "--seq-len", "48", "--batch-size", "2", "--num-target-layers", "2", "--max-anchors", "4"]
    assert main(["train", *flags, "--cpu-threads", "1", "--no-progress"]) == 0
    raw = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "config.json").read_text())
    assert raw["num_hidden_layers"] == 8 and raw["layer_types"] == [FULL_ATTENTION] * 8 and raw["block_size"] == 16


@needs_qwen3_5
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_drafter_of_a_qwen3_5_target_carries_only_the_rope_it_uses(tmp_path, arch):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash.drafter.model import AnchoredDrafter
    from dflash.run.checkpoint import save_checkpoint

    target_dir = make_target(tmp_path / "target", arch=arch)
    train = TrainConfig(target=str(target_dir), num_target_layers=1, draft_heads=4, draft_kv_heads=2, draft_head_dim=8)
    raw = _config_json_of(train, target_dir, 3)
    assert not _keys(raw) & {"partial_rotary_factor", "mrope_section", "mrope_interleaved"}
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert raw["rope_theta"] == 1e7 and raw["rope_scaling"] is None
    # The drafter rotates all of head_dim, and so does every loader of its checkpoint.
    drafter = AnchoredDrafter._from_config(modeling_dflash.DFlashDraftConfig.from_dict(raw))
    full = 1.0 / 1e7 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, full)
    step_dir = save_checkpoint(
        tmp_path / "run", 1, weights=drafter.state_dict(), drafter_config=raw, training_state=None
    )
    torch.testing.assert_close(Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(step_dir)).inv_freq, full)


@needs_qwen3_5
def test_real_scaling_is_kept_and_partial_rotary_dropped():
    """A YaRN-scaled hybrid target: the drafter keeps YaRN (as the target's other loaders build it)
    and drops the target's partial rotary factor and M-RoPE sections."""
    from transformers import Qwen3_5TextConfig, Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash.drafter.model import create_drafter_config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    target = Qwen3_5TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        rope_parameters={**yarn, "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    )
    config = create_drafter_config(target, 1, block_size=4, num_captured_layers=1, mask_token_id=3)
    raw = portable_config(config.to_diff_dict(), dtype=None)
    assert raw["rope_parameters"] == {**yarn, "rope_theta": 1e7} and raw["rope_scaling"] == yarn
    native = Qwen3Config(hidden_size=32, num_attention_heads=4, head_dim=8, max_position_embeddings=4096)
    native.rope_parameters = {**yarn, "rope_theta": 1e7}
    ours = Qwen3RotaryEmbedding(Qwen3Config.from_dict(raw))
    torch.testing.assert_close(ours.inv_freq, Qwen3RotaryEmbedding(native).inv_freq)
    assert ours.inv_freq.numel() == 4 and ours.attention_scaling != 1.0  # all of head_dim, scaled


def test_a_standard_target_keeps_its_geometry_and_flags_win(tmp_path):
    target_dir = make_target(tmp_path / "target", num_layers=6)
    rule = resolve_drafter_shape(TrainConfig(target=str(target_dir)))
    assert (rule.block_size, rule.num_draft_layers, rule.num_target_layers) == (8, 1, 3)
    assert rule.draft_heads is None and rule.draft_layer_types is None  # the drafter config copies the target's
    raw = _config_json_of(TrainConfig(target=str(target_dir)), target_dir, 3)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (4, 2, 8)
    assert raw["layer_types"] == [FULL_ATTENTION] and raw["use_sliding_window"] is False
    flags = TrainConfig(
        target=str(target_dir), draft_layer_types="sliding,full", draft_heads=8, draft_kv_heads=4, draft_head_dim=4
    )
    raw = _config_json_of(flags, target_dir, 3)
    assert raw["layer_types"] == [SLIDING_ATTENTION, FULL_ATTENTION] and raw["sliding_window"] == 2048
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"], raw["num_hidden_layers"]) == (
        8,
        4,
        4,
        2,
    )
    assert resolve_drafter_shape(resolve_drafter_shape(flags)) == resolve_drafter_shape(flags)


@needs_qwen3_5
def test_a_qwen3_5_target_gets_the_published_rule_for_any_layer_count(tmp_path):
    target_dir = make_target(tmp_path / "target", arch="qwen3_5", num_layers=8)
    rule = resolve_drafter_shape(TrainConfig(target=str(target_dir), num_draft_layers=3))
    assert rule.draft_layer_types == "sliding_attention,sliding_attention,full_attention"
    assert (rule.block_size, rule.num_target_layers, rule.draft_sliding_window) == (16, 5, 2048)
    assert (rule.draft_heads, rule.draft_kv_heads, rule.draft_head_dim) == (32, 8, 128)
    full = resolve_drafter_shape(TrainConfig(target=str(target_dir), draft_layer_types="full,full"))
    assert full.draft_sliding_window is None and full.num_draft_layers == 2


@needs_qwen3_5
def test_a_shallow_target_taps_what_fits_unless_the_flag_asks_for_more(tmp_path, caplog):
    from dflash.run.preflight import validate_inputs

    target_dir = make_target(tmp_path / "target", arch="qwen3_5", num_layers=6)
    run = dict(target=str(target_dir), data=str(write_chat_data(tmp_path / "chats.jsonl")), out=str(tmp_path / "r"))
    with caplog.at_level("INFO", logger="dflash.run.drafter_shape"):
        rule = resolve_drafter_shape(TrainConfig(**run))
    assert rule.num_target_layers == 3 and "the rule's 5 need 8" in caplog.text  # 6 layers spread 3 taps
    validate_inputs(rule)
    with pytest.raises(ValueError, match="--num-target-layers 5: the default spread taps at most 3"):
        validate_inputs(resolve_drafter_shape(TrainConfig(**run, num_target_layers=5)))


def test_a_default_block_longer_than_a_row_names_the_flags_and_says_it_is_the_default(tmp_path):
    """`--seq-len 4` alone said `block_size 8 is longer than --seq-len 4`: no flag the user gave, or could find."""
    target_dir = make_target(tmp_path / "target")
    with pytest.raises(
        ValueError,
        match=r"^--block-size 8 \(the default for this target: not given\) is longer than --seq-len 4: "
        r".*pass --block-size 4 or less, or --seq-len 8 or more$",
    ):
        resolve_drafter_shape(TrainConfig(target=str(target_dir), seq_len=4))
    assert resolve_drafter_shape(TrainConfig(target=str(target_dir), seq_len=8)).block_size == 8


def test_contradicting_flags_are_named(tmp_path):
    target_dir = make_target(tmp_path / "target")
    with pytest.raises(ValueError, match="--draft-layer-types names 2 layers, --num-draft-layers is 3"):
        resolve_drafter_shape(TrainConfig(target=str(target_dir), draft_layer_types="full,sliding", num_draft_layers=3))
    with pytest.raises(ValueError, match="--draft-sliding-window 512: no drafter layer is sliding"):
        resolve_drafter_shape(TrainConfig(target=str(target_dir), draft_sliding_window=512))
    with pytest.raises(ValueError, match="give one of full / sliding per drafter layer"):
        TrainConfig(draft_layer_types="full,local")
    assert parse_layer_types("sliding sliding_attention,full") == [SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]
    # This module spells the layer types as the served modeling file does (it must not import it).
    assert LAYER_TYPES == modeling_dflash.LAYER_TYPES


@needs_qwen3_5
def test_a_drafter_far_wider_than_its_small_target_is_warned_about(tmp_path, caplog):
    """The published 32 x 128 shape on a hidden-32 target: 128x wider, and nothing said."""
    target_dir = make_target(tmp_path / "target", arch="qwen3_5", num_layers=8)
    with caplog.at_level(logging.WARNING, logger="dflash"):
        resolve_drafter_shape(TrainConfig(target=str(target_dir)))
    assert "32 heads of 128 (8 KV heads), is 4096 wide, 128x this target's hidden size 32" in caplog.text
    assert "pass --draft-heads, --draft-kv-heads and --draft-head-dim (e.g. the target's " in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash"):
        resolve_drafter_shape(TrainConfig(target=str(target_dir), draft_heads=4, draft_kv_heads=2, draft_head_dim=8))
    assert "wide" not in caplog.text


def test_the_start_line_names_the_drafters_heads_and_width(tmp_path, caplog):
    from tiny import train_config

    from dflash.run.settle import settle
    from dflash.train.trainer import Trainer

    config = train_config(
        target=make_target(tmp_path / "target", num_layers=5),
        data=write_chat_data(tmp_path / "d.jsonl"),
        out=tmp_path / "run",
    )
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        Trainer(settle(config))
    assert re.search(r"drafter: DFlash, 1 layer\(s\) of \d+ heads x \d+ \(\d+ KV heads\), hidden 32, ", caplog.text)


def test_train_help_names_what_the_rule_resolves_for_each_kind_of_target(tmp_path):
    """``dflash train --help`` says, per kind of target, what an empty shape flag becomes: the values
    :func:`resolve_drafter_shape` gives a real target of each kind (the help is computed, not copied)."""
    from dflash.assets import default_target_dir
    from dflash.run.drafter_shape import SHAPE_FIELDS, rule_help

    dense, moe = tmp_path / "dense", tmp_path / "moe"
    for directory, config in ((dense, _qwen3_6_27b_config()), (moe, _qwen3_5_35b_a3b_config())):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    kinds = {
        "other targets": TrainConfig(target=str(default_target_dir())),
        "Qwen3.5/3.6": TrainConfig(target=str(dense)),
        "Qwen3.5/3.6 with --arch dflash2": TrainConfig(target=str(dense), arch="dflash2"),
        "Qwen3.5/3.6 MoE": TrainConfig(target=str(moe)),
    }
    checked = 0
    for field in SHAPE_FIELDS:
        text = rule_help(field)
        if text is None:
            continue
        for kind, config in kinds.items():
            value = getattr(resolve_drafter_shape(config), field)
            if field == "draft_layer_types" and value is not None:
                value = value.replace("_attention", "").split(",")
                value = value[0] if len(set(value)) == 1 else None  # the runs are named: only all-alike is checked here
            if value is not None:
                assert f"{kind} {value}" in text or f"{kind} {value} x" in text, (field, kind, value, text)
                checked += 1
    assert checked >= 20
    from dflash.cli import build_parser

    train = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    assert "Qwen3.5/3.6 with --arch dflash2 8" in " ".join(train.format_help().split())  # --block-size's
