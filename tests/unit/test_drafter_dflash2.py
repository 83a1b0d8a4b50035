"""DFlash2 drafters (dflash/drafter/modeling_dflash.py, dflash/train/selector_loss.py): the published
config and weight names read and written, a new drafter starting as DFlash, the selector's greedy
walk against the score spelled out, its loss, and `dflash eval` equal to greedy decoding in float32.
Equality with z-lab's reference: tests/integration/test_zlab_dflash2.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from tiny import loss_settings, make_target, tiny_target_config, write_chat_data
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.drafter.files import CheckpointError, check_tensors, read_drafter_config
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.drafter.modeling_dflash import DFlashDraftConfig
from dflash.train.loss import chunk_loss, dflash_loss
from dflash.train.selector_loss import selector_loss

#: z-lab/Qwen3.8-27B-DFlash2's config.json, field for field, at a tiny width and vocabulary.
PUBLISHED = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "dtype": "bfloat16",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 248,
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": 270,
        "selector_rank": 16,
        "selector_top_k": 16,
        "target_layer_ids": [5, 19, 33, 47, 61],
    },
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 262144,
    "max_window_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 5,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": True,
    "vocab_size": 300,
}


def _published_dir(tmp_path, **changes):
    raw = {**PUBLISHED, **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = DFlashDraftConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AnchoredDrafter(config).state_dict().items()}
    save_file({k: torch.zeros(shape) for k, shape in shapes.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_the_published_config_and_its_81_tensors_are_read_as_they_ship(tmp_path):
    directory = _published_dir(tmp_path)
    config = read_drafter_config(directory)
    assert config.is_dflash2 and config.block_size == 8 and config.is_causal is False
    check_tensors(directory, config)  # bare codebook names, no `.weight`
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len(keys) == 81
    assert {"candidate_selector.predecessor_codebook", "layers.4.mlp_conv.base_kernel"} <= keys


@pytest.mark.parametrize(
    ("dflash_config", "named"),
    [
        ({"conv_group_size": 7}, "conv_group_size 7 must divide hidden_size 64"),
        ({"conv_kernel_size": 9}, r"conv_kernel_size 9 must be in \[1, block_size=8\]"),
        ({"selector_top_k": None}, "needs the ints dflash_config.selector_top_k"),
        ({"output_multiplier": 0.0}, "output_multiplier must be a finite number > 0, got 0.0"),
        ({"output_multiplier": None}, "output_multiplier must be a finite number > 0, got None"),
        ({"input_embedding_scale": float("inf")}, "input_embedding_scale must be a finite number > 0, got inf"),
        ({"final_logit_softcapping": -30.0}, r"final_logit_softcapping must be .* \(0 or null: no cap\), got -30.0"),
        ({"final_logit_softcapping": "20"}, "final_logit_softcapping must be a finite number > 0"),
    ],
)
def test_a_dflash2_field_out_of_range_is_named(tmp_path, dflash_config, named):
    raw = {**PUBLISHED, "dflash_config": {**PUBLISHED["dflash_config"], **dflash_config}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=named):
        read_drafter_config(tmp_path)


def test_z_labs_fixture_with_its_transforms_is_read(tmp_path):
    """z-lab/dflash 07ebd93 ``tests/fixtures/dflash2-config.json`` sets ``output_multiplier`` 1 / sqrt(26)
    and ``final_logit_softcapping`` 20 in ``dflash_config``: read as the drafter's logit transform."""
    from dflash.drafter.modeling_dflash import LogitTransform

    transforms = {"output_multiplier": 0.19611613513818404, "final_logit_softcapping": 20.0}
    directory = _published_dir(tmp_path, dflash_config={**PUBLISHED["dflash_config"], **transforms})
    config = read_drafter_config(directory)
    check_tensors(directory, config)  # no tensor of its own
    assert config.transforms == transforms and config.noise_embedding_scale == 1.0
    assert config.logit_transform == LogitTransform(0.19611613513818404, 20.0)
    assert read_drafter_config(_published_dir(tmp_path)).logit_transform is None  # the published Qwen drafters'


def test_transforms_outside_a_dflash2_dflash_config_are_refused():
    """vLLM 0.34 and SGLang 0.5.19 read them in a DFlash2 ``dflash_config`` only: a DFlash drafter or a
    top-level field would serve without them."""
    config = create_drafter_config(tiny_target_config(), 1, block_size=4, num_captured_layers=3, mask_token_id=63)
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    with pytest.raises(ValueError, match="logit and embedding transforms are DFlash2 fields"):
        DFlashDraftConfig(**{**fields, "dflash_config": {**config.dflash_config, "input_embedding_scale": 2.0}})
    with pytest.raises(ValueError, match="at the top level of the drafter config: .* move them into dflash_config"):
        DFlashDraftConfig(**{k: v for k, v in PUBLISHED.items() if k != "model_type"}, final_logit_softcapping=30.0)
    # Identity values change nothing, wherever they are.
    DFlashDraftConfig(**{**fields, "dflash_config": {**config.dflash_config, "output_multiplier": 1.0}})
    DFlashDraftConfig(**{k: v for k, v in PUBLISHED.items() if k != "model_type"}, final_logit_softcapping=None)


def test_a_block_size_given_twice_must_agree():
    fields = {k: v for k, v in PUBLISHED.items() if k != "model_type"}
    with pytest.raises(ValueError, match="block_size 16 and dflash_config.block_size 8 disagree"):
        DFlashDraftConfig(**fields, block_size=16)


def _pair(seed: int = 0):
    """A new DFlash drafter and a new DFlash2 drafter with the same backbone weights."""
    models = []
    for arch in ("dflash", "dflash2"):
        config = create_drafter_config(
            tiny_target_config(), 2, block_size=4, num_captured_layers=3, mask_token_id=63, arch=arch
        )
        torch.manual_seed(seed)
        models.append(AnchoredDrafter._from_config(config, attn_implementation="sdpa").eval())
    dflash, dflash2 = models
    dflash2.load_state_dict(dflash.state_dict(), strict=False)
    return dflash, dflash2


def test_a_new_dflash2_drafter_drafts_as_dflash():
    """Identity convolutions and zero successors (SpecForge's initialisation): the same hidden
    states and the argmax path, so training starts from DFlash."""
    dflash, dflash2 = _pair()
    assert dflash2.config.is_causal is False and dflash2.config.architectures == ["DFlash2DraftModel"]
    dflash2.config.is_causal = dflash.config.is_causal = False
    gen = torch.Generator().manual_seed(1)
    context, block = torch.randn(1, 9, 3 * 32, generator=gen), torch.randn(1, 4, 32, generator=gen)
    head = torch.nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        torch.testing.assert_close(dflash2.block_hidden(context, block), dflash.block_hidden(context, block))
    anchor = torch.tensor([5])
    assert torch.equal(
        dflash2.draft_block(context, block, head, anchor), dflash.draft_block(context, block, head, anchor)
    )


def test_the_walk_takes_the_best_candidate_after_the_token_it_chose_before():
    selector = create_and_randomize_selector()
    gen = torch.Generator().manual_seed(2)
    hidden, logits = torch.randn(2, 5, 32, generator=gen), torch.randn(2, 5, 64, generator=gen)
    anchors = torch.tensor([3, 9])
    path = selector.walk(hidden, logits, anchors)
    A, B, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    with torch.no_grad():
        for row in range(2):
            previous = int(anchors[row])
            for slot in range(5):
                candidates = logits[row, slot].topk(selector.top_k).indices.tolist()
                transition = A[previous] * (P @ hidden[row, slot])
                score = {b: float(logits[row, slot, b] + (transition * B[b]).sum()) for b in candidates}
                previous = max(score, key=score.get)
                assert int(path[row, slot]) == previous


def create_and_randomize_selector():
    from dflash.drafter.modeling_dflash import CandidateSelector

    torch.manual_seed(0)
    selector = CandidateSelector(32, 64, rank=8, top_k=6)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_()
    return selector


def _loss_inputs(top_k: int = 6):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 4, 32, generator=gen, requires_grad=True)
    head = torch.randn(64, 32, generator=gen)
    logits = hidden.detach() @ head.t()
    candidates = logits.topk(top_k).indices
    labels = logits.argmin(-1)  # the least likely token: outside the top 6 of 64
    labels[0, 1] = candidates[0, 1, 2]  # one slot whose true token is a candidate
    predecessors = torch.randint(0, 64, (2, 4), generator=gen)
    weights = torch.ones(4)
    return hidden, head, labels, predecessors, weights


def _selected(selector, hidden, head, labels, predecessors, weights, *, insert_gold: bool):
    """The selector's loss on the candidates a loss chunk picks for it."""
    mask = torch.ones_like(labels, dtype=torch.bool)
    settings = _settings(selector_missing_gold="insert" if insert_gold else "exclude")
    *_, candidates, logits, slot_weights = chunk_loss(
        hidden, head, labels, mask, weights, None, settings, top_k=selector.top_k
    )
    return candidates, selector_loss(selector, hidden, candidates, logits, slot_weights, labels, predecessors, None)


def _settings(**flags):
    """The loss settings of a run with block size 4 (the inputs here), gamma 2 and ``flags``."""
    return loss_settings(block_size=4, gamma=2.0, **flags)


def test_the_selector_loss_counts_only_slots_it_can_select_unless_the_true_token_is_inserted():
    selector = create_and_randomize_selector()
    hidden, head, labels, predecessors, weights = _loss_inputs()
    candidates, excluded = _selected(selector, hidden, head, labels, predecessors, weights, insert_gold=False)
    found = (candidates == labels[..., None]).any(-1)
    assert found.sum() == 1
    only = torch.where(found, labels, candidates[..., 0])  # the other slots' true tokens made candidates...
    _, alone = _selected(selector, hidden, head, only, predecessors, weights, insert_gold=False)
    assert alone > excluded > 0  # ...count, where the missing ones counted nothing
    inserted_candidates, inserted = _selected(selector, hidden, head, labels, predecessors, weights, insert_gold=True)
    assert (inserted_candidates == labels[..., None]).any(-1).all()
    assert torch.equal(inserted_candidates[..., :-1], candidates[..., :-1])
    assert inserted > excluded
    inserted.backward()
    assert hidden.grad.abs().sum() > 0 and selector.successor_codebook.grad[labels.flatten()].abs().sum() > 0


def test_the_soft_selector_target_is_the_targets_distribution_over_the_candidates():
    selector = create_and_randomize_selector()
    hidden, head, labels, predecessors, weights = _loss_inputs()
    gen = torch.Generator().manual_seed(9)
    teacher = torch.randn(2, 6, 32, generator=gen)  # the target's last hidden state of 6 positions
    anchors = torch.tensor([[0], [2]])  # slot k of the block anchored at a reads position a + k - 1
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[1, 2] = False  # an unsupervised slot: no part of the selector's loss
    settings = _settings(selector_target="soft", selector_missing_gold="exclude")
    out = dflash_loss(
        hidden.reshape(2, 4, 32),
        head,
        labels[:, None],
        mask[:, None],
        weights,
        settings,
        teacher_hidden=teacher,
        anchors=anchors,
        selector=selector,
        predecessors=predecessors[:, None],
    )
    # Spelled out: every slot, the candidates' scores against the target's softmax over them.
    expected = 0.0
    for row in range(2):
        for slot in range(4):
            if not mask[row, slot]:
                continue
            logits = hidden[row, slot].detach() @ head.t()
            candidates = logits.topk(selector.top_k).indices
            position = max(int(anchors[row, 0]) + slot - 1, 0)
            target = (teacher[row, position] @ head[candidates].t()).softmax(-1)
            scores = selector.scores(hidden[row, slot], logits[candidates], candidates, predecessors[row, slot])
            expected = expected + weights[slot] * -(target * scores.log_softmax(-1)).sum()
    torch.testing.assert_close(out.selector_sum, expected.detach())
    out.loss_sum.backward()
    assert hidden.grad.abs().sum() > 0 and selector.successor_codebook.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="the soft selector target need teacher_hidden"):
        dflash_loss(
            hidden,
            head,
            labels[:, None],
            mask[:, None],
            weights,
            settings,
            selector=selector,
            predecessors=predecessors[:, None],
        )


def test_the_selectors_codebooks_get_one_gradient_per_micro_batch_not_one_per_loss_chunk():
    """Each codebook's gradient is a dense [V, r] tensor (an embedding's): formed per loss chunk it
    cost 64 writes of 254 MB per micro-batch at the user's shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DenseCodebookGradients(TorchDispatchMode):
        formed = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding_dense_backward.default:
                self.formed += 1
            return out

    selector = create_and_randomize_selector()
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 6 * 4, 32, generator=gen, requires_grad=True)
    head = torch.randn(64, 32, generator=gen)
    labels = torch.randint(0, 64, (1, 6, 4), generator=gen)
    mask = torch.ones_like(labels, dtype=torch.bool)
    out = dflash_loss(
        hidden,
        head,
        labels,
        mask,
        torch.ones(4),
        _settings(loss_chunk_blocks=1, selector_missing_gold="insert"),
        selector=selector,
        predecessors=labels,
    )
    with DenseCodebookGradients() as counter:
        out.loss_sum.backward()
    assert counter.formed == 2  # one per codebook for the 6 chunks
    assert selector.predecessor_codebook.grad.abs().sum() > 0 and selector.successor_codebook.grad.abs().sum() > 0


def test_the_selector_loss_does_not_depend_on_the_chunking():
    selector = create_and_randomize_selector()
    gen = torch.Generator().manual_seed(5)
    hidden0 = torch.randn(2, 5 * 4, 32, generator=gen)
    head = torch.randn(64, 32, generator=gen)
    labels = torch.randint(0, 64, (2, 5, 4), generator=gen)

    def run(chunk_blocks):
        hidden = hidden0.clone().requires_grad_(True)
        selector.zero_grad()
        out = dflash_loss(
            hidden,
            head,
            labels,
            torch.ones_like(labels, dtype=torch.bool),
            torch.ones(4),
            _settings(loss_chunk_blocks=chunk_blocks, selector_missing_gold="exclude"),
            selector=selector,
            predecessors=labels,
        )
        out.loss_sum.backward()
        return out.loss_sum.detach(), out.selector_sum, hidden.grad, selector.successor_codebook.grad.clone()

    for ours, whole in zip(run(3), run(10)):
        torch.testing.assert_close(ours, whole)


def test_dflash_eval_of_a_dflash2_run_equals_greedy_decoding(tmp_path, capsys):
    from dflash.cli import main

    target, data = make_target(tmp_path / "target", num_layers=5), write_chat_data(tmp_path / "chats.jsonl")
    run = tmp_path / "run"
    flags = ["--target", str(target), "--data", str(data), "--out", str(run), "--arch", "dflash2", "--steps", "2"]
    flags += ["--seq-len", "48", "--batch-size", "2", "--max-anchors", "4", "--num-target-layers", "2"]
    assert main(["train", *flags, "--cpu-threads", "1", "--no-progress"]) == 0
    capsys.readouterr()
    saved = json.loads((run / "checkpoints" / "step_00000002" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["dflash_config"]["block_size"] == 8
    argv = ["eval", "--drafter", str(run), "--data", str(data), "--device", "cpu", "--cpu-threads", "1"]
    assert main([*argv, "--num-prompts", "3", "--max-new-tokens", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mismatches"] == 0 and report["dtype"] == "float32" and report["num_prompts"] == 3
    exported = tmp_path / "tiny-dflash2"
    assert main(["export", str(run), "--out", str(exported)]) == 0
    _check_what_serving_engines_read(json.loads((exported / "config.json").read_text()))
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve" in (exported / "README.md").read_text()


#: What vLLM's DFlash2 loader (vllm@030da62 ``qwen3_dflash2.py``, PR #52816, over ``qwen3_dflash.py``) and
#: SGLang's parser (sglang@00731f0 ``dflash_utils.parse_dflash_draft_config``, PR #35371) read from
#: ``dflash_config`` as required ints (SGLang: both of a pair or neither; vLLM: all four).
ENGINE_INTS = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id")


def _check_what_serving_engines_read(config: dict) -> None:
    nested = config["dflash_config"]
    assert config["architectures"] == ["DFlash2DraftModel"]  # selects the DFlash2 model in vLLM and z-lab
    assert all(isinstance(nested[name], int) and nested[name] > 0 for name in ENGINE_INTS), nested
    assert nested["block_size"] == config["block_size"]  # SGLang: nested first; older readers: top level
    assert isinstance(nested["target_layer_ids"], list) and config["num_target_layers"] > max(
        nested["target_layer_ids"]
    )
    # Optional transforms: absent means identity in both engines (vLLM output_multiplier 1.0, SGLang > 0 required).
    assert not {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"} & set(nested)
    assert config["is_causal"] is False and nested.get("causal") is False  # vLLM reads is_causal, then causal
    assert len(config["layer_types"]) == config["num_hidden_layers"]


def test_init_from_a_published_dflash2_directory_keeps_its_architecture(tmp_path):
    """A DFlash2 drafter directory as z-lab ships one (block size only in dflash_config, no
    auto_map) fine-tunes as DFlash2: its fields kept, every weight loaded strictly."""
    from transformers import AutoConfig

    from dflash.cli import main
    from dflash.run.layout import read_saved_config

    target, data = make_target(tmp_path / "target", num_layers=5), write_chat_data(tmp_path / "chats.jsonl")
    config = create_drafter_config(
        AutoConfig.from_pretrained(target),
        2,
        block_size=8,
        target_layer_ids=[1, 3],
        mask_token_id=3,
        intermediate_size=48,
        arch="dflash2",
    )
    raw = {k: v for k, v in config.to_dict().items() if k not in ("block_size", "auto_map")}
    published = tmp_path / "Tiny-DFlash2"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(4)
    weights = AnchoredDrafter._from_config(config).state_dict()
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(published / "model.safetensors"))

    run = tmp_path / "run"
    flags = ["--target", str(target), "--data", str(data), "--out", str(run), "--init-from", str(published)]
    flags += ["--steps", "1", "--seq-len", "48", "--batch-size", "2", "--max-anchors", "4", "--save-every", "1"]
    flags += ["--eval-prompts", "1", "--eval-max-new-tokens", "4", "--cpu-threads", "1", "--no-progress"]
    assert main(["train", *flags]) == 0
    assert read_saved_config(run)["arch"] == "dflash2"
    saved = json.loads((run / "checkpoints" / "step_00000001" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert {k: saved["dflash_config"][k] for k in raw["dflash_config"]} == raw["dflash_config"]


def test_a_dflash2_drafter_trains_threaded_on_a_hybrid_target_with_sliding_layers(tmp_path, monkeypatch):
    """The layout of the seed (target and drafter replicas in threads), a Qwen3.6-layout target,
    packed rows and sliding drafter layers, as for DFlash: the replicas stay equal and every DFlash2
    weight trains."""
    pytest.importorskip("transformers.models.qwen3_5", reason="qwen3_5 needs transformers >= 5.2")
    from tiny import record_losses, train_config

    from dflash.run.settle import settle
    from dflash.train.trainer import Trainer

    monkeypatch.setattr("dflash.devices.usable_cores", lambda: 4)  # two drafter replicas on any host
    target = make_target(tmp_path / "hybrid", arch="qwen3_5", num_layers=8)
    config = train_config(
        target=target,
        data=write_chat_data(tmp_path / "chats.jsonl"),
        out=tmp_path / "run",
        arch="dflash2",
        block_size=8,
        gamma=4.0,
        draft_layer_types="sliding,full",
        draft_sliding_window=16,
        target_devices="cpu",
        drafter_devices="cpu:0-1",
        steps=3,
    )
    trainer = record_losses(Trainer(settle(config)))
    start = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    metrics = trainer.train()
    # The drafter's own loss and the selector's are logged apart (comparable with a DFlash run).
    assert metrics["selector_loss"] > 0 and math.isfinite(metrics["loss"])
    assert all(map(math.isfinite, trainer.losses))
    first, second = (replica.model.state_dict() for replica in trainer.engine.replicas)
    assert all(torch.equal(first[name], second[name]) for name in first)
    for name in ("layers.0.attention_conv.kernel_projection.weight", "candidate_selector.successor_codebook"):
        assert not torch.equal(first[name], start[name]), name


def test_a_dflash2_drafter_saved_by_transformers_stays_dflash2(tmp_path):
    """transformers' ``save_pretrained`` writes the class name; the served one is written, and the
    DFlash2 fields decide which."""
    _, dflash2 = _pair()
    dflash2.save_pretrained(tmp_path)
    assert read_drafter_config(tmp_path).is_dflash2
    loaded = AnchoredDrafter.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["DFlash2DraftModel"] and hasattr(loaded, "candidate_selector")


def test_a_shorter_block_drafts_as_the_head_of_a_whole_one():
    """A verify width below the block size (z-lab near the token budget, MLX served at 5): the
    convolutions see one shorter block; with causal attention its slots equal the first slots of
    a whole block (so nothing but the block's own start is read)."""
    _, dflash2 = _pair()
    dflash2.config.is_causal = True
    with torch.no_grad():
        for name, p in dflash2.named_parameters():
            if "_conv." in name:
                p.normal_(0.0, 0.3)
    gen = torch.Generator().manual_seed(5)
    context, block = torch.randn(1, 6, 3 * 32, generator=gen), torch.randn(1, 4, 32, generator=gen)
    with torch.no_grad():
        whole = dflash2._run(block, context, torch.arange(6, 10)[None], None, None)
        short = dflash2._run(block[:, :3], context, torch.arange(6, 9)[None], None, None)
    torch.testing.assert_close(short, whole[:, :3])
    with pytest.raises(ValueError, match="neither whole blocks of 4 nor one shorter block"):
        dflash2._run(torch.randn(1, 6, 32), context, torch.arange(6, 12)[None], None, None)


def test_the_candidates_logits_keep_nothing_larger_than_the_hidden_states_for_backward():
    """At the user's shape the candidates' head rows are 16 x the hidden states (gigabytes at 512
    anchors): gathered again in backward, never saved; the gradient is the plain expression's."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, 4, 16, generator=gen, requires_grad=True)
    weight, labels = torch.randn(50, 16, generator=gen), torch.randint(0, 50, (3, 4), generator=gen)
    grad = torch.randn(3, 4, 5, generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        *_, candidates, logits, _ = _chunk(hidden, weight, labels, _settings(selector_missing_gold="insert"), top_k=5)
    assert max(saved) <= hidden.numel()
    (logits * grad).sum().backward()
    ours, hidden.grad = hidden.grad, None
    ((hidden[..., None, :] * weight[candidates]).sum(-1) * grad).sum().backward()
    torch.testing.assert_close(ours, hidden.grad)


def _chunk(hidden, weight, labels, settings, *, top_k):
    mask = torch.ones_like(labels, dtype=torch.bool)
    return chunk_loss(hidden, weight, labels, mask, torch.ones(labels.shape[-1]), None, settings, top_k=top_k)


def test_the_candidates_logits_compiled_in_float32_give_eagers_gradient():
    """torch 2.11's dynamo routed the gradient of an autograd.Function output that aliases an
    intermediate (a no-op ``.float()`` of float32 logits) to the wrong slot (pytorch/pytorch#180642):
    a float32 compiled DFlash2 step trained on a wrong selector gradient."""
    gen = torch.Generator().manual_seed(7)
    hidden0 = torch.randn(3, 4, 16, generator=gen)
    weight, labels = torch.randn(40, 16, generator=gen), torch.randint(0, 40, (3, 4), generator=gen)

    settings = _settings(selector_missing_gold="insert")

    def gradient(fn):
        hidden = hidden0.clone().requires_grad_(True)
        loss, _, _, _, logits, _ = fn(hidden, weight, labels, settings, top_k=3)
        (loss + logits.square().sum()).backward()
        return hidden.grad

    compiled = torch.compile(_chunk, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(gradient(compiled), gradient(_chunk))


def test_an_arch_that_contradicts_the_init_from_drafter_is_refused(tmp_path):
    from tiny import save_random_drafter

    from dflash.config import TrainConfig
    from dflash.run.drafter_shape import resolve_drafter_shape

    target = make_target(tmp_path / "target", num_layers=5)
    step_dir = save_random_drafter(target, tmp_path / "run")
    disagree = r"--arch dflash2 disagrees with the --init-from drafter .* \(a dflash drafter\)"
    with pytest.raises(ValueError, match=disagree):
        resolve_drafter_shape(TrainConfig(target=str(target), init_from=str(step_dir), arch="dflash2", gamma=2.0))
    assert resolve_drafter_shape(TrainConfig(target=str(target), init_from=str(step_dir), gamma=2.0)).arch == "dflash"
    assert resolve_drafter_shape(TrainConfig(target=str(target))).arch == "dflash"


def test_selector_flags_on_a_dflash_drafter_are_refused(tmp_path):
    from dflash.config import TrainConfig
    from dflash.run.drafter_shape import resolve_drafter_shape

    target = make_target(tmp_path / "target", num_layers=5)
    with pytest.raises(ValueError, match="--selector-loss-weight 0.5: the candidate selector is DFlash2's"):
        resolve_drafter_shape(TrainConfig(target=str(target), selector_loss_weight=0.5))
    with pytest.raises(ValueError, match="--selector-target soft: the candidate selector is DFlash2's"):
        resolve_drafter_shape(TrainConfig(target=str(target), selector_target="soft"))
    assert resolve_drafter_shape(TrainConfig(target=str(target), arch="dflash2", selector_loss_weight=0.5))


def test_the_logged_drafter_loss_does_not_move_with_the_selectors_weight():
    """The drafter's own loss is summed apart: subtracting weight x selector from the objective
    would cancel at a large weight (a negative cross-entropy in the log)."""
    selector = create_and_randomize_selector()
    gen = torch.Generator().manual_seed(7)
    hidden, head = torch.randn(1, 8, 32, generator=gen), torch.randn(64, 32, generator=gen)
    labels = torch.randint(0, 64, (1, 2, 4), generator=gen)
    mask = torch.ones(1, 2, 4, dtype=torch.bool)
    mask[..., 0] = False
    settings = [_settings(selector_loss_weight=weight, selector_missing_gold="insert") for weight in (1.0, 1e9)]
    outs = [
        dflash_loss(hidden, head, labels, mask, s.position_weight("cpu"), s, selector=selector, predecessors=labels)
        for s in settings
    ]
    assert torch.equal(outs[0].drafter_sum, outs[1].drafter_sum) and outs[0].selector_sum > 0


@pytest.mark.parametrize("q_len", [12, 3])  # three blocks of 4, or one block shorter than 4
def test_the_block_convolution_is_the_taps_spelled_out_and_its_gradient_autograds(q_len):
    from dflash.drafter.modeling_dflash import GroupedDynamicConv

    conv = GroupedDynamicConv(hidden_size=8, kernel_size=2, group_size=4, block_size=4).double()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=gen)
    z = torch.randn(2, q_len, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dynamic = torch.randn(2, q_len, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    base = conv.base_kernel[0]
    length = min(q_len, 4)
    spelled = torch.zeros_like(z)
    for t in range(q_len):
        for j in range(2):
            if t % length >= j:  # j slots back, within t's block
                coefficient = base[j] + dynamic[:, t, j].repeat_interleave(4, dim=-1)
                spelled[:, t] = spelled[:, t] + coefficient * z[:, t - j]
    torch.testing.assert_close(conv._convolve(z, dynamic, base), spelled)
    assert torch.autograd.gradcheck(lambda *a: conv._convolve(*a), (z, dynamic, base))


def test_taps_past_a_shorter_block_read_nothing():
    """k may be up to ``block_size`` while a shorter block (a verify width near the token budget) has
    fewer slots: its extra taps read before the block's start, so they add nothing and get zero
    gradients (they raised a shape error)."""
    from dflash.drafter.modeling_dflash import GroupedDynamicConv

    conv = GroupedDynamicConv(hidden_size=8, kernel_size=4, group_size=4, block_size=4).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=gen)
    z = torch.randn(1, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dynamic = torch.randn(1, 2, 4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    base = conv.base_kernel[0]
    out = conv._convolve(z, dynamic, base)
    torch.testing.assert_close(out, conv._convolve(z, dynamic[:, :, :2], base[:2]))
    out.sum().backward()
    assert not dynamic.grad[:, :, 2:].any() and not conv.base_kernel.grad[0, 2:].any()
    assert torch.autograd.gradcheck(lambda *a: conv._convolve(*a), (z, dynamic, base.detach().requires_grad_()))


def test_the_block_convolution_keeps_only_its_inputs_for_backward():
    from dflash.drafter.modeling_dflash import GroupedDynamicConv

    conv = GroupedDynamicConv(hidden_size=8, kernel_size=2, group_size=4, block_size=4)
    z = torch.randn(2, 8, 8, requires_grad=True)
    dynamic = torch.randn(2, 8, 2, 2, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv._convolve(z, dynamic, conv.base_kernel[0])
    assert len(saved) == 3 and saved[0] is z and saved[1] is dynamic


def _compiled_layer(arch: str, q_len: int, *, compiled: bool = True):
    """One decoder layer of ``arch``, compiled by inductor as the trainer's regional compile compiles
    it (or eager), and its inputs: a bf16 ``[1, q_len, H]`` hidden state that needs a gradient."""
    from dflash.drafter.modeling_dflash import DFlashDecoderLayer

    config = create_drafter_config(tiny_target_config(), 1, block_size=4, mask_token_id=63, arch=arch)
    drafter = AnchoredDrafter._from_config(config, attn_implementation="sdpa")

    def layer_forward(*args):  # a code object of its own: the trainer's compiled layer keeps its cache
        return DFlashDecoderLayer.forward(*args)

    hidden_size, context_len = config.hidden_size, 8
    hidden = torch.randn(1, q_len, hidden_size, dtype=torch.bfloat16, requires_grad=True)
    context = torch.randn(1, context_len, hidden_size, requires_grad=True)
    cos, sin = drafter.rotary_emb(hidden, torch.arange(context_len + q_len)[None])
    mask = torch.ones(1, 1, q_len, context_len + q_len, dtype=torch.bool)
    layer = torch.compile(layer_forward, fullgraph=True) if compiled else layer_forward
    args = (drafter.layers[0], hidden, context, (cos[:, context_len:], sin[:, context_len:]), (cos, sin), mask, None)
    return layer, args


def _saved_for_backward_bytes(arch: str, q_len: int) -> int:
    """Bytes one compiled decoder layer of ``arch`` keeps for backward, under CPU bf16 autocast."""
    layer, args = _compiled_layer(arch, q_len)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(*args)
    return sum(saved)


class _MatmulFlops(TorchDispatchMode):
    """The FLOPs of the matmuls run under it."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]  # addmm's bias first
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
        return func(*args, **(kwargs or {}))


def _backward_matmul_flops(compiled: bool) -> int:
    layer, args = _compiled_layer("dflash2", 256, compiled=compiled)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(*args)
    with _MatmulFlops() as count:
        out.float().sum().backward()
    return count.flops


def test_a_compiled_dflash2_layer_recomputes_no_matmul_in_backward():
    """The convolutions' checkpoints keep their coefficients' matmuls, so compiled backward runs
    the matmuls eager autograd runs, no more (each recomputed projection: 2 Q H k G FLOPs, G = H /
    g; recomputing them all, with the normed inputs, cost 8.3 ms a step at the user's shape on an
    H100)."""
    assert _backward_matmul_flops(compiled=True) == _backward_matmul_flops(compiled=False)


def test_a_compiled_dflash2_layer_keeps_no_more_for_backward_than_dflash():
    """Compiled, each side of DFlash2's convolutions computes its coefficients inside its
    checkpoint, so backward recomputes the taps and the normed input: the layer keeps the
    coefficients (its matmuls' outputs, 0.5 [Q, H]) but neither the normed input's bf16 copy nor
    side 0's output, 0.3 [Q, H] less than DFlash's layer (2.6 more when the coefficients came from
    outside the checkpoints)."""
    q_len = 256
    extra = _saved_for_backward_bytes("dflash2", q_len) - _saved_for_backward_bytes("dflash", q_len)
    activation = q_len * tiny_target_config().hidden_size * 2  # one [Q, H] in bf16
    assert extra <= 0, extra / activation


def test_compiled_both_sides_run_as_plain_taps_not_the_autograd_function(monkeypatch):
    """torch 2.11's partitioner keeps the output of an autograd.Function inside a checkpoint (one
    [Q, H] more per layer), so compiled, both sides must reach their checkpoints as plain taps;
    CI's torch recomputes either form, so the bound above cannot see it. The code path under
    compilation, run eagerly on random weights in float64: eager's output, and its gradients as far
    as the autograd.Function's float32 sums give them."""
    from dflash.drafter import modeling_dflash

    drafter = AnchoredDrafter._from_config(
        create_drafter_config(tiny_target_config(), 1, block_size=4, mask_token_id=63, arch="dflash2"),
        attn_implementation="sdpa",
    ).double()
    conv = drafter.layers[0].mlp_conv
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    calls = []
    apply = modeling_dflash._BlockConvolution.apply
    monkeypatch.setattr(modeling_dflash._BlockConvolution, "apply", lambda *a: calls.append(1) or apply(*a))
    x = torch.randn(1, 8, drafter.config.hidden_size, dtype=torch.float64, requires_grad=True)
    params = (x, conv.base_kernel, conv.kernel_projection.weight)

    def output_and_gradients():
        y = conv(x, torch.tanh)
        return y, torch.autograd.grad((y * y.detach().cos()).sum(), params)

    eager = output_and_gradients()
    assert len(calls) == 2  # both sides
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    output, gradients = output_and_gradients()
    torch.testing.assert_close(output, eager[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gradients, eager[1], rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # neither side
