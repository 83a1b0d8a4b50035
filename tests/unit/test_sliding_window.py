"""Sliding-window and causal drafter layers (dflash/masks.py, dflash/drafter/modeling_dflash.py): the masks
against a position-by-position reference, the engines' causality rule, training equal to drafting,
flex equal to SDPA (one compile: test_data_packing.py::test_packed_batches_of_any_layout_compile_once)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import assert_same_block_mask, flex_eager, packed_batch, tiny_drafter
from torch.nn.attention.flex_attention import create_block_mask

from dflash import masks
from dflash.drafter.modeling_dflash import FULL_ATTENTION, SLIDING_ATTENTION

HIDDEN, VOCAB, BLOCK, WINDOW = 32, 64, 4, 6


def _reference_visible(documents, row, anchor, valid, q, kv, context_len, block_size, window, causal=False) -> bool:
    """The rule spelled out by position, independent of masks.py: slot k of the block anchored at a
    is the token at position a + k; it sees context of its own document strictly before the anchor
    and within the ``window`` positions ending at itself, and its own block (slots 0..k of it when
    ``causal``)."""
    if not valid:
        return False
    block, slot = divmod(q, block_size)
    if kv >= context_len:
        own_block, own_slot = divmod(kv - context_len, block_size)
        return own_block == block and (not causal or own_slot <= slot)
    same_document = documents is None or documents[row, kv] == documents[row, anchor]
    in_window = window is None or (anchor + slot) - kv < window
    return kv < anchor and same_document and in_window


@st.composite
def layouts(draw):
    """(loss_mask [B, S], document ids [B, S] or None, block size, window)."""
    block_size = draw(st.sampled_from([2, 3, 4]))
    window = draw(st.one_of(st.none(), st.integers(block_size, 12)))
    rows = draw(st.lists(st.lists(st.integers(1, 10), min_size=1, max_size=3), min_size=1, max_size=2))
    seq_len = max(sum(r) for r in rows) + draw(st.integers(0, 3))
    batch = packed_batch(rows, seq_len, seed=draw(st.integers(0, 99)))
    documents = batch.document_ids if draw(st.booleans()) else None
    return batch.loss_mask & (batch.document_ids >= 0), documents, block_size, window


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), max_anchors=st.integers(1, 6), causal=st.booleans())
def test_dense_mask_matches_the_reference_and_pairs_count_it(layout, max_anchors, causal):
    loss_mask, documents, block_size, window = layout
    anchors, valid = masks.sample_anchors(
        loss_mask, max_anchors, document_ids=documents, generator=torch.Generator().manual_seed(0)
    )
    context_len = loss_mask.shape[1]
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size, documents, window, causal=causal)
    for b in range(loss_mask.shape[0]):
        for q in range(max_anchors * block_size):
            n = q // block_size
            a, ok = int(anchors[b, n]), bool(valid[b, n])
            want = [
                _reference_visible(documents, b, a, ok, q, kv, context_len, block_size, window, causal)
                for kv in range(dense.shape[-1])
            ]
            assert dense[b, 0, q].tolist() == want
    pairs = masks.visible_pairs(anchors, valid, block_size, documents, window, causal=causal)
    assert int(pairs) == int(dense.sum())


def test_the_window_bites_per_slot_and_spares_the_block():
    """Slot k of a block anchored at 10 with a window of 6 sees context 5 + k .. 9, and its block."""
    anchors, valid = torch.tensor([[10]]), torch.tensor([[True]])
    dense = masks.dense_attention_mask(anchors, valid, 12, BLOCK, sliding_window=WINDOW)[0, 0]
    for slot in range(BLOCK):
        context = dense[slot, :12].nonzero().flatten().tolist()
        assert context == list(range(10 + slot - WINDOW + 1, 10))
        assert dense[slot, 12:].all()
    full = masks.dense_attention_mask(anchors, valid, 12, BLOCK)[0, 0]
    assert full[:, :10].all() and int(full.sum()) > int(dense.sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [4, 8, (8, 4), 128])
@pytest.mark.parametrize("block_size", [2, 4])
def test_sliding_block_mask_equals_create_block_mask_tile_for_tile(tile, block_size, causal):
    gen = torch.Generator().manual_seed(block_size)
    for window in (None, block_size, 7, 20):
        context_len = int(torch.randint(10, 80, (1,), generator=gen))
        batch = packed_batch([[context_len // 2, context_len - context_len // 2]] * 2, context_len, seed=window or 0)
        loss_mask = torch.rand(2, context_len, generator=gen) < 0.8
        num = int(torch.randint(1, 9, (1,), generator=gen))
        for documents in (None, batch.document_ids):
            anchors, valid = masks.sample_anchors(loss_mask, num, document_ids=documents, generator=gen)
            ours = masks.build_block_mask(
                anchors, valid, context_len, block_size, documents, window, causal=causal, tile=tile
            )
            mask_mod = masks.dflash_mask_mod(anchors, valid, context_len, block_size, documents, window, causal=causal)
            q_len, kv_len = num * block_size, context_len + num * block_size
            assert_same_block_mask(ours, create_block_mask(mask_mod, 2, None, q_len, kv_len, "cpu", BLOCK_SIZE=tile))


def test_a_window_smaller_than_the_block_is_refused():
    anchors, valid = torch.tensor([[3]]), torch.tensor([[True]])
    with pytest.raises(ValueError, match="sliding_window 3 is smaller than block_size 4"):
        masks.build_block_mask(anchors, valid, 8, BLOCK, sliding_window=3)
    with pytest.raises(ValueError, match="sliding_window must be a window of at least block_size=4"):
        tiny_drafter([SLIDING_ATTENTION], sliding_window=3)


def _inputs(*, seq_len=30, num_anchors=5, seed=1, documents=None):
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(2, seq_len, generator=gen) < 0.9
    anchors, valid = masks.sample_anchors(loss_mask, num_anchors, document_ids=documents, generator=gen)
    draft_embeds = torch.randn(2, num_anchors * BLOCK, HIDDEN, generator=gen)
    return draft_embeds, torch.randn(2, seq_len, 3 * HIDDEN, generator=gen), anchors, valid


MIXED = [SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]


@pytest.mark.parametrize("is_causal", [None, True, False])
def test_training_blocks_equal_drafting_after_the_context_and_the_window_matters(is_causal):
    """Block n of the training forward == drafting it after context[:a_n] (``block_hidden``, the
    inference form that ``dflash eval`` runs): the window and the causality are the same in both."""
    model = tiny_drafter(MIXED, sliding_window=WINDOW, is_causal=is_causal)
    draft_embeds, target_hidden, anchors, valid = _inputs()
    with torch.no_grad():
        batched = model(draft_embeds, target_hidden, anchors, valid)
        for b in range(2):
            for n in range(anchors.shape[1]):
                if valid[b, n]:
                    a, rows = int(anchors[b, n]), slice(n * BLOCK, (n + 1) * BLOCK)
                    single = model.block_hidden(target_hidden[b : b + 1, :a], draft_embeds[b : b + 1, rows])
                    torch.testing.assert_close(batched[b : b + 1, rows], single, rtol=1e-5, atol=1e-5)
        # The same weights with every layer full attention see more context: another function.
        full = tiny_drafter([FULL_ATTENTION] * 3, is_causal=is_causal)
        full.load_state_dict(model.state_dict())
        assert (full(draft_embeds, target_hidden, anchors, valid) - batched).abs().max() > 1e-3


@pytest.mark.parametrize("is_causal", [None, True])
def test_flex_and_sdpa_agree_on_a_sliding_drafter(monkeypatch, is_causal):
    model = tiny_drafter(MIXED, sliding_window=WINDOW, is_causal=is_causal)
    draft_embeds, target_hidden, anchors, valid = _inputs(num_anchors=6)
    valid[:, -1] = False
    with torch.no_grad():
        sdpa = model(draft_embeds, target_hidden, anchors, valid)
        context, block = target_hidden[:1, :20], draft_embeds[:1, :BLOCK]
        sdpa_inference = model.block_hidden(context, block)
    flex = flex_eager(monkeypatch, model, draft_embeds, target_hidden, anchors, valid)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference form builds its own window BlockMask under flex
        torch.testing.assert_close(model.block_hidden(context, block), sdpa_inference, rtol=1e-5, atol=1e-5)


def test_masks_come_per_layer_type_and_a_single_mask_is_refused():
    model = tiny_drafter(MIXED, sliding_window=WINDOW)
    draft_embeds, target_hidden, anchors, valid = _inputs()
    by_type = model.build_attention_mask(anchors, valid, target_hidden.shape[1])
    assert set(by_type) == {FULL_ATTENTION, SLIDING_ATTENTION}
    assert int(by_type[SLIDING_ATTENTION].sum()) < int(by_type[FULL_ATTENTION].sum())
    with pytest.raises(ValueError, match="pass one mask per layer type"):
        model(draft_embeds, target_hidden, anchors, valid, by_type[FULL_ATTENTION])
    with pytest.raises(ValueError, match=r"no mask for the \['sliding_attention'\] layers"):
        model(draft_embeds, target_hidden, anchors, valid, {FULL_ATTENTION: by_type[FULL_ATTENTION]})
    # The FLOP count's pairs are the masks' pairs, layer by layer.
    pairs = sum(int(by_type[kind].sum()) for kind in model.config.layer_types)
    assert int(model.attention_pairs(anchors, valid)) == pairs


def _slot_zero_moves(model, forward: str) -> float:
    """How far slot 0's output moves when only slot 3's input changes, drafting one block after a
    context (``block_hidden``, as ``dflash eval``) or through the training forward (its masks)."""
    gen = torch.Generator().manual_seed(4)
    context, block = torch.randn(1, 10, 3 * HIDDEN, generator=gen), torch.randn(1, BLOCK, HIDDEN, generator=gen)
    moved = block.clone()
    moved[:, 3] += 1.0
    anchors, valid = torch.tensor([[10]]), torch.tensor([[True]])
    with torch.no_grad():
        if forward == "drafting":
            a, b = model.block_hidden(context, block), model.block_hidden(context, moved)
        else:
            context = torch.cat([context, torch.randn(1, 4, 3 * HIDDEN, generator=gen)], dim=1)
            a, b = model(block, context, anchors, valid), model(moved, context, anchors, valid)
    return float((a[:, 0] - b[:, 0]).abs().max())


@pytest.mark.parametrize("forward", ["drafting", "training"])
def test_a_config_without_is_causal_runs_sliding_layers_causally_and_full_layers_bidirectionally(forward):
    """The engines' rule (vLLM ``_dflash_layer_causal``, z-lab's newer loader): without
    ``is_causal`` a sliding layer's slot 0 never sees slot 3, a full layer's does; ``is_causal``
    true / false makes every layer causal / bidirectional."""
    sliding = [SLIDING_ATTENTION] * 2
    assert tiny_drafter(sliding, sliding_window=WINDOW).config.is_causal is None
    assert _slot_zero_moves(tiny_drafter(sliding, sliding_window=WINDOW), forward) == 0.0
    assert _slot_zero_moves(tiny_drafter(sliding, sliding_window=WINDOW, is_causal=False), forward) > 1e-4
    assert _slot_zero_moves(tiny_drafter([FULL_ATTENTION] * 2), forward) > 1e-4
    assert _slot_zero_moves(tiny_drafter([FULL_ATTENTION] * 2, is_causal=True), forward) == 0.0
    # Mixed: the sliding layer's mask hides slot 3 from slot 0, the full layer's shows it.
    model = tiny_drafter(MIXED, sliding_window=WINDOW)
    assert [model.config.layer_is_causal(kind) for kind in MIXED] == [True, True, False]
    by_type = model.build_attention_mask(torch.tensor([[10]]), torch.tensor([[True]]), 14)
    assert not by_type[SLIDING_ATTENTION][0, 0, 0, 14 + 3] and by_type[FULL_ATTENTION][0, 0, 0, 14 + 3]
    assert _slot_zero_moves(model, forward) > 1e-4


def test_causality_is_read_from_is_causal_or_dflash_config_and_a_contradiction_is_refused():
    from dflash.drafter.modeling_dflash import DFlashDraftConfig

    base = tiny_drafter(MIXED, sliding_window=WINDOW).config.to_dict()
    base.pop("is_causal")
    dflash = {k: v for k, v in base.pop("dflash_config").items() if k != "causal"}
    assert DFlashDraftConfig(**base, dflash_config=dflash).is_causal is None
    only_dflash = DFlashDraftConfig(**base, dflash_config={**dflash, "causal": False})
    assert only_dflash.is_causal is False and not only_dflash.layer_is_causal(SLIDING_ATTENTION)
    both = DFlashDraftConfig(**base, dflash_config={**dflash, "causal": True}, is_causal=True)
    assert both.dflash_config["causal"] is True and both.layer_is_causal(FULL_ATTENTION)
    with pytest.raises(ValueError, match="is_causal False and dflash_config.causal True disagree"):
        DFlashDraftConfig(**base, dflash_config={**dflash, "causal": True}, is_causal=False)
    with pytest.raises(ValueError, match="is_causal must be true, false or absent, got 'no'"):
        DFlashDraftConfig(**base, dflash_config=dflash, is_causal="no")
