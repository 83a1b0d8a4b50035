"""Our DFlash2 drafter against z-lab's reference (``dflash/model.py`` at commit 07ebd93, the inference
contract vLLM PR #52816 and SGLang PR #35371 cite), run side by side on the CPU in float32: the
directory our checkpoint writer produces loads in z-lab's ``DFlash2DraftModel.from_pretrained``
with no weight missing or left over, and on the same block the two give the same drafter hidden
states and logits, the same selector scores at every slot and the same drafted path.

z-lab's file is not part of this repository: point ``DFLASH_ZLAB_MODEL`` at it (e.g. ``git show
07ebd93:dflash/model.py`` of a z-lab/dflash clone, or a fork holding that commit); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from dflash.drafter.model import AnchoredDrafter
from dflash.drafter.modeling_dflash import DFlashDraftConfig
from dflash.run.checkpoint import write_drafter_files

ZLAB = os.environ.get("DFLASH_ZLAB_MODEL")
pytestmark = pytest.mark.skipif(not ZLAB, reason="DFLASH_ZLAB_MODEL: path of z-lab/dflash's model.py at 07ebd93")

HIDDEN, VOCAB, BLOCK, CONTEXT = 64, 300, 8, 13


def _zlab():
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", ZLAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours(layer_types: list[str], transforms: dict | None = None) -> AnchoredDrafter:
    """A random DFlash2 drafter in the published form (every weight random, the conv and the
    selector included, so neither can hide behind its identity initialisation), with ``transforms``
    in its ``dflash_config``."""
    config = DFlashDraftConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_target_layers=8,
        layer_types=layer_types,
        sliding_window=10,
        is_causal=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7},
        dflash_config={
            "block_size": BLOCK,
            "mask_token_id": 3,
            "target_layer_ids": [1, 4, 6],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 32,
            "selector_top_k": 5,
            **(transforms or {}),
        },
    )
    torch.manual_seed(0)
    model = AnchoredDrafter._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return model


SAVED = pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16-export"])
#: z-lab/dflash 07ebd93 ``tests/fixtures/dflash2-config.json``'s transforms (``dflash_config``).
FIXTURE_TRANSFORMS = {"output_multiplier": 0.19611613513818404, "final_logit_softcapping": 20.0}


@SAVED
@pytest.mark.parametrize("layer_types", [["sliding_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_our_dflash2_equals_zlabs_reference(tmp_path, layer_types, saved, monkeypatch):
    """``saved``: the weights' dtype in the files (bf16: what ``dflash export`` writes; both models
    then run the same bf16-rounded weights in float32)."""
    _compare_with_zlab(tmp_path, monkeypatch, _ours(layer_types), saved, head_scale=1.0)


@SAVED
@pytest.mark.parametrize(
    "transforms",
    [FIXTURE_TRANSFORMS, {**FIXTURE_TRANSFORMS, "input_embedding_scale": 2.5}],
    ids=["fixture", "fixture-and-embedding-scale"],
)
def test_our_dflash2_with_zlabs_transforms_equals_zlabs_reference(tmp_path, transforms, saved, monkeypatch):
    """The fixture's logit transforms (and an embedding scale, which z-lab's loop applies to the
    block's embeddings): our config keeps them in the files, z-lab's model reads them from there,
    and the logits, selector scores and path agree. The head is scaled so that the logits reach
    the cap's bend (the order of multiplier and cap matters there)."""
    _compare_with_zlab(tmp_path, monkeypatch, _ours(["sliding_attention", "full_attention"], transforms), saved)


def _compare_with_zlab(tmp_path, monkeypatch, ours, saved, *, head_scale: float = 40.0) -> None:
    zlab = _zlab()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.to(saved).float())
    write_drafter_files(tmp_path, weights=ours.state_dict(), drafter_config=ours.config.to_dict(), dtype=saved)
    theirs, loading = zlab.DFlash2DraftModel.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(loading.values()), loading  # nothing missing, unexpected or mismatched
    theirs.eval()

    gen = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(1, CONTEXT, 3 * HIDDEN, generator=gen)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    anchor = torch.tensor([7])
    block_ids = torch.cat([anchor[:, None], torch.randint(0, VOCAB, (1, BLOCK - 1), generator=gen)], dim=1)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.normal_(generator=gen)
        head.weight.mul_(head_scale)
        # z-lab's loop: the block's embeddings times its config's input_embedding_scale.
        scale = float(zlab._draft_value(theirs.config, "input_embedding_scale", 1.0))
        noise_embedding = zlab._raw_input_embeddings(
            SimpleNamespace(get_input_embeddings=lambda: embed), block_ids, scale
        )
        block_embeds = embed(block_ids)  # ours scales them itself
        hidden = ours.block_hidden(target_hidden, block_embeds)[:, 1:]
        reference = theirs(
            position_ids=torch.arange(CONTEXT + BLOCK)[None],
            noise_embedding=noise_embedding,
            target_hidden=target_hidden,
        )[:, 1:]
        torch.testing.assert_close(hidden, reference, rtol=1e-5, atol=1e-5)
        logits = ours.compute_logits(hidden, head)
        their_logits = theirs.compute_logits(reference, head)
        torch.testing.assert_close(logits, their_logits, rtol=1e-5, atol=1e-5)
        if ours.config.transforms:
            assert (their_logits - head(reference)).abs().max() > 1.0  # the transforms are applied, and bite

        scored = []  # z-lab's selector scores, slot by slot, as its walk takes their argmax
        argmax = torch.argmax
        monkeypatch.setattr(zlab.torch, "argmax", lambda x, *a, **k: scored.append(x) or argmax(x, *a, **k))
        path, candidates, _ = theirs.propose(reference, anchor, head, 0.0)
        monkeypatch.undo()
        assert torch.equal(ours.draft_block(target_hidden, block_embeds, head, anchor), path)
        unary, ours_candidates = torch.topk(logits, ours.candidate_selector.top_k, dim=-1)
        predecessors = torch.cat([anchor[:, None], path[:, :-1]], dim=1)
        for slot, theirs_scores in enumerate(scored):
            # Same candidates (z-lab's top-k is unsorted): compare scores candidate by candidate.
            order = [ours_candidates[0, slot].tolist().index(t) for t in candidates[0, slot].tolist()]
            mine = ours.candidate_selector.scores(
                hidden[:, slot], unary[:, slot], ours_candidates[:, slot], predecessors[:, slot]
            )
            torch.testing.assert_close(mine[:, order], theirs_scores, rtol=1e-5, atol=1e-5)
    assert len(scored) == BLOCK - 1
    differences = {
        "hidden": (hidden - reference).abs().max().item(),
        "logits": (logits - their_logits).abs().max().item(),
    }
    print(
        f"ours vs z-lab 07ebd93, files {saved}, run in float32, {ours.config.layer_types}, transforms "
        f"{ours.config.transforms}: max abs difference {differences}"
    )


def test_an_exported_run_with_projected_codebooks_loads_in_zlabs_reference(tmp_path):
    """A run trained with --selector-codebooks projected exports the published tables: z-lab's
    loader finds every weight it expects and nothing else, and its codebooks are the projections'
    tables (bf16, as dflash export writes them)."""
    from safetensors.torch import load_file
    from tiny import make_target, train_config, write_chat_data

    from dflash.export import export
    from dflash.run.settle import settle
    from dflash.train.trainer import Trainer

    target, data = make_target(tmp_path / "target", num_layers=5), write_chat_data(tmp_path / "chats.jsonl")
    flags = dict(arch="dflash2", selector_codebooks="projected", steps=2, num_target_layers=2)
    trainer = Trainer(settle(train_config(target=target, data=data, out=tmp_path / "run", **flags)))
    trainer.train()
    out = export(tmp_path / "run", tmp_path / "exported-dflash", dtype="bfloat16")
    theirs, loading = _zlab().DFlash2DraftModel.from_pretrained(
        out, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(loading.values()), loading  # nothing missing, unexpected or mismatched
    predecessors, successors = trainer.drafter.candidate_selector.tables()
    saved = load_file(str(out / "model.safetensors"))
    for name, table in (("predecessor_codebook", predecessors), ("successor_codebook", successors)):
        torch.testing.assert_close(saved[f"candidate_selector.{name}"].float(), table.to(torch.bfloat16).float())
        torch.testing.assert_close(getattr(theirs.candidate_selector, name).weight, table.to(torch.bfloat16).float())
