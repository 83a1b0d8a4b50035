"""Anchors, labels, draft inputs and the DFlash attention mask (dflash/masks.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import assert_same_block_mask
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from dflash import masks


def _reference_visible(anchor: int, valid: bool, block: int, kv: int, context_len: int, block_size: int) -> bool:
    """The DFlash visibility rule spelled out scalar by scalar (independent of masks.py)."""
    if not valid:
        return False
    if kv < context_len:
        return kv < anchor
    return (kv - context_len) // block_size == block


@st.composite
def loss_masks(draw, max_batch: int = 3, max_len: int = 40):
    batch = draw(st.integers(1, max_batch))
    seq_len = draw(st.integers(1, max_len))
    bits = draw(st.lists(st.booleans(), min_size=batch * seq_len, max_size=batch * seq_len))
    return torch.tensor(bits, dtype=torch.bool).view(batch, seq_len)


@settings(max_examples=60, deadline=None)
@given(loss_mask=loss_masks(), max_anchors=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_sample_anchors_respects_loss_mask_sorted_unique(loss_mask, max_anchors, seed):
    anchors, valid = masks.sample_anchors(loss_mask, max_anchors, generator=torch.Generator().manual_seed(seed))
    assert anchors.shape == valid.shape == (loss_mask.shape[0], max_anchors)
    assert anchors.dtype == torch.long and valid.dtype == torch.bool
    seq_len = loss_mask.shape[1]
    for row in range(loss_mask.shape[0]):
        n = int(valid[row].sum())
        assert valid[row, :n].all() and not valid[row, n:].any(), "valid entries must come first"
        chosen = anchors[row, :n].tolist()
        assert chosen == sorted(set(chosen)), "anchors must be sorted and unique"
        for a in chosen:
            assert a + 1 < seq_len and loss_mask[row, a] and loss_mask[row, a + 1]
        candidates = [a for a in range(seq_len - 1) if loss_mask[row, a] and loss_mask[row, a + 1]]
        assert n == min(max_anchors, len(candidates)), "takes every candidate when there are few"
        assert (anchors[row, n:] == 0).all()


def test_sample_anchors_is_reproducible_and_covers_candidates():
    loss_mask = torch.ones(1, 200, dtype=torch.bool)
    draw = lambda seed: masks.sample_anchors(loss_mask, 8, generator=torch.Generator().manual_seed(seed))[0]
    assert torch.equal(draw(3), draw(3))
    seen = torch.cat([draw(seed) for seed in range(200)]).flatten()
    # 200 draws of 8 among 199 candidates: a uniform sampler misses a given candidate with
    # probability (191/199)**200 ~ 3e-4. A sampler favouring some region (e.g. first-k) would not.
    assert seen.unique().numel() > 190


def test_sample_anchors_rejects_bad_input():
    with pytest.raises(ValueError, match="bool"):
        masks.sample_anchors(torch.ones(2, 5), 3)
    with pytest.raises(ValueError, match="max_anchors"):
        masks.sample_anchors(torch.ones(2, 5, dtype=torch.bool), 0)


def test_context_visibility_is_strictly_before_anchor():
    """Pins the public bug: a block anchored at a must not see context position a (kv <= a)."""
    context_len, block_size = 10, 4
    anchors = torch.tensor([[0, 3, 7]])
    valid = torch.tensor([[True, True, True]])
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size)[0, 0]
    for b, a in enumerate(anchors[0].tolist()):
        for slot in range(block_size):
            row = dense[b * block_size + slot]
            assert row[:a].all(), "every context position before the anchor is visible"
            assert not row[a:context_len].any(), "the anchor's own position and later are hidden"


def test_each_block_sees_only_itself_bidirectionally_and_padding_sees_nothing():
    context_len, block_size = 6, 3
    anchors = torch.tensor([[2, 4, 0]])
    valid = torch.tensor([[True, True, False]])
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size)[0, 0]
    draft = dense[:, context_len:]  # [Q, Q] part of the grid
    expected = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool)] * 3)
    expected[2 * block_size :] = False
    assert torch.equal(draft, expected)
    assert not dense[2 * block_size :].any()


@settings(max_examples=40, deadline=None)
@given(
    loss_mask=loss_masks(max_batch=2, max_len=24),
    max_anchors=st.integers(1, 6),
    block_size=st.sampled_from([2, 3, 4]),
)
def test_dense_mask_matches_scalar_reference(loss_mask, max_anchors, block_size):
    anchors, valid = masks.sample_anchors(loss_mask, max_anchors, generator=torch.Generator().manual_seed(0))
    context_len = loss_mask.shape[1]
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size)
    q_len = max_anchors * block_size
    assert dense.shape == (loss_mask.shape[0], 1, q_len, context_len + q_len)
    for b in range(loss_mask.shape[0]):
        for q in range(q_len):
            blk = q // block_size
            a, ok = int(anchors[b, blk]), bool(valid[b, blk])
            want = [_reference_visible(a, ok, blk, kv, context_len, block_size) for kv in range(dense.shape[-1])]
            assert dense[b, 0, q].tolist() == want


@pytest.mark.parametrize("tile", [4, 8, (8, 4), (4, 16), 128])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_block_mask_equals_create_block_mask_tile_for_tile(tile, block_size):
    gen = torch.Generator().manual_seed(block_size)
    for _ in range(4):
        context_len = int(torch.randint(3, 80, (1,), generator=gen))
        loss_mask = torch.rand(2, context_len, generator=gen) < 0.7
        num = int(torch.randint(1, 9, (1,), generator=gen))
        anchors, valid = masks.sample_anchors(loss_mask, num, generator=gen)
        ours = masks.build_block_mask(anchors, valid, context_len, block_size, tile=tile)
        q_len, kv_len = num * block_size, context_len + num * block_size
        mask_mod = masks.dflash_mask_mod(anchors, valid, context_len, block_size)
        ref = create_block_mask(mask_mod, 2, None, q_len, kv_len, device="cpu", BLOCK_SIZE=tile)
        assert_same_block_mask(ours, ref)


def test_block_mask_tiles_cover_exactly_the_dense_mask():
    """Every visible pair lies in a partial/full tile; every pair in a full tile is visible."""
    context_len, block_size, tile = 37, 4, 8
    loss_mask = torch.rand(2, context_len, generator=torch.Generator().manual_seed(1)) < 0.8
    anchors, valid = masks.sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(2))
    bm = masks.build_block_mask(anchors, valid, context_len, block_size, tile=tile)
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size)[:, 0]
    q_len, kv_len = dense.shape[-2:]

    def expand(tiles):  # [B, 1, Tq, Tk] tile table -> element grid
        grid = tiles[:, 0].repeat_interleave(tile, 1).repeat_interleave(tile, 2)
        return grid[:, :q_len, :kv_len].bool()

    full_only = BlockMask.from_kv_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, BLOCK_SIZE=tile)
    any_tile, full_tile = expand(bm.to_dense()), expand(full_only.to_dense())
    assert not (dense & ~any_tile).any(), "a visible pair lies outside every tile"
    assert not (full_tile & ~dense).any(), "a full tile contains a hidden pair"


def test_labels_are_same_position_not_shifted():
    """Pins the public bug: slot k of the block anchored at a predicts x[a + k], not x[a + k + 1]."""
    seq_len, block_size = 12, 4
    input_ids = torch.arange(100, 100 + seq_len)[None]  # token value encodes its position
    loss_mask = torch.ones(1, seq_len, dtype=torch.bool)
    anchors, valid = torch.tensor([[2, 9]]), torch.tensor([[True, True]])
    labels, label_mask = masks.build_labels(input_ids, loss_mask, anchors, valid, block_size)
    assert labels[0, 0].tolist() == [0, 103, 104, 105]
    assert label_mask[0, 0].tolist() == [False, True, True, True]
    # Block at 9: positions 10, 11 exist; 12 is past the end.
    assert labels[0, 1].tolist() == [0, 110, 111, 0]
    assert label_mask[0, 1].tolist() == [False, True, True, False]


def test_labels_respect_loss_mask_and_padding_blocks():
    input_ids = torch.arange(10)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[2, 7, 0]]), torch.tensor([[True, True, False]])
    labels, label_mask = masks.build_labels(input_ids, loss_mask, anchors, valid, 4)
    assert label_mask[0, 0].tolist() == [False, True, True, False]  # position 5 is a user token
    assert label_mask[0, 1].tolist() == [False, True, True, False]  # position 10 is past the end
    assert not label_mask[0, 2].any()
    assert (labels[~label_mask] == 0).all()


def test_draft_input_ids_and_positions():
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    anchors, valid = torch.tensor([[1, 3, 0]]), torch.tensor([[True, True, False]])
    ids = masks.draft_input_ids(input_ids, anchors, valid, 3, mask_token_id=99)
    assert ids.tolist() == [[6, 99, 99, 8, 99, 99, 99, 99, 99]]
    assert masks.draft_position_ids(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5, 0, 1, 2]]


def test_anchor_checks_name_the_problem():
    with pytest.raises(ValueError, match="anchors must be int64"):
        masks.build_labels(
            torch.zeros(1, 4, dtype=torch.long),
            torch.ones(1, 4, dtype=torch.bool),
            torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, 2, dtype=torch.bool),
            2,
        )
