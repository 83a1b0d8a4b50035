"""Sequence packing (dflash/data/packing.py) and what it needs from data, masks, the drafter and the target:
rows of several conversations (documents), kept apart exactly as if each ran alone.

Fast (CPU, tiny models); the benchmark smoke run is in tests/integration/test_packing_e2e.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import sys
import typing
from itertools import islice
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import (
    assert_same_block_mask,
    capture_packed_and_alone,
    example,
    make_target,
    packed_batch,
    tiny_drafter,
    unfused_flex,
)
from torch.nn.attention.flex_attention import create_block_mask

from dflash import masks
from dflash.commands import train as train_command
from dflash.compile_watch import CountingBackend
from dflash.config import TrainConfig
from dflash.data.batches import Batch, BatchLoader, ShardedSampler, collate
from dflash.data.chats import read_conversations
from dflash.data.packing import pack_rows, row_packer
from dflash.data.tokenize import build_examples
from dflash.target_model.model import load_target

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def _row_fill(batches) -> float:
    """Real tokens / row tokens over ``batches``: the ``row fill`` of the trainer's summary line."""
    batches = list(batches)
    return sum(b.num_tokens for b in batches) / sum(b.input_ids.numel() for b in batches)


@st.composite
def packed_batches(draw, max_batch: int = 3, max_len: int = 40):
    """(loss_mask, document_ids): rows of random documents, a random loss mask, padding at the end."""
    batch = draw(st.integers(1, max_batch))
    seq_len = draw(st.integers(2, max_len))
    rows = []
    for _ in range(batch):
        lengths, room = [], seq_len
        while room and draw(st.booleans()):
            lengths.append(draw(st.integers(1, room)))
            room -= lengths[-1]
        rows.append(lengths)
    packed = packed_batch(rows, seq_len, seed=draw(st.integers(0, 2**16)))
    bits = draw(st.lists(st.booleans(), min_size=batch * seq_len, max_size=batch * seq_len))
    loss_mask = torch.tensor(bits).view(batch, seq_len) & (packed.document_ids >= 0)
    return loss_mask, packed.document_ids


def _candidates(loss_mask: torch.Tensor, document_ids: torch.Tensor, row: int) -> dict[int, list[int]]:
    """Anchor candidates of a row by document id, spelled out position by position."""
    found: dict[int, list[int]] = {}
    for a in range(loss_mask.shape[1] - 1):
        if loss_mask[row, a] and loss_mask[row, a + 1] and document_ids[row, a] == document_ids[row, a + 1]:
            found.setdefault(int(document_ids[row, a]), []).append(a)
    return found


# ---------------------------------------------------------------------------------------
# Packing conversations into rows
# ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60),
    window=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_pack_rows_places_each_example_once_within_its_window(lengths, window, seed):
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    pack = lambda: pack_rows(lengths, order, torch.Generator().manual_seed(seed), seq_len=50, window=window)
    rows = pack()
    assert rows == pack(), "deterministic for the same order and generator state"
    assert sorted(i for row in rows for i in row) == sorted(order)
    assert all(sum(lengths[i] for i in row) <= 50 for row in rows)
    window_of = {i: position // window for position, i in enumerate(order)}
    assert all(len({window_of[i] for i in row}) == 1 for row in rows), "a row mixes only one window"
    # A row is opened only when no open row has room for its (largest) first example, and rows only
    # fill up later, so no two rows of one window fit together in one row.
    for first in range(len(rows)):
        for second in range(first + 1, len(rows)):
            if window_of[rows[first][0]] == window_of[rows[second][0]]:
                assert sum(lengths[i] for i in rows[first] + rows[second]) > 50


def test_pack_rows_rejects_an_example_longer_than_the_row():
    with pytest.raises(ValueError, match=r"example 1 has 9 tokens, more than seq_len=8; apply --overflow"):
        pack_rows([3, 9], [0, 1], seq_len=8)
    with pytest.raises(ValueError, match=r"1 examples are longer than seq_len=8 \(e.g. example 1, 9 tokens\)"):
        row_packer([example(3, 0), example(9, 1)], seq_len=8)


def test_embedded_chat_corpus_fills_rows_at_seq_2048():
    """The issue's goal `row fill >= 90%` on the embedded chat corpus at seq 2048 (CPU: it is a property
    of the data and the packer, not of the device). Unpacked, those rows are ~12% full."""
    from transformers import AutoTokenizer

    from dflash.assets import default_data_dir, default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    examples = build_examples(tokenizer, read_conversations(default_data_dir() / "train.jsonl"), seq_len=2048)
    sampler = ShardedSampler(len(examples), batch_size=4, seed=0, packer=row_packer(examples, seq_len=2048))
    loader = BatchLoader(examples, sampler, seq_len=2048, pad_token_id=0)
    packed = _row_fill(islice(loader, sampler.batches_per_epoch))
    unpacked_loader = BatchLoader(examples, ShardedSampler(len(examples), batch_size=4), seq_len=2048, pad_token_id=0)
    unpacked = _row_fill(islice(unpacked_loader, 50))
    assert packed >= 0.95 and unpacked < 0.2, (packed, unpacked)


# ---------------------------------------------------------------------------------------
# Sampler and loader: resumable, sharded, one epoch = each conversation once
# ---------------------------------------------------------------------------------------


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 40) for _ in range(n)]


def test_packed_sampler_resumes_exactly_and_covers_each_example_once_per_epoch():
    examples = [example(n, i) for i, n in enumerate(_lengths(100))]
    make = lambda **kw: ShardedSampler(100, batch_size=3, seed=5, packer=row_packer(examples, seq_len=64), **kw)
    full = make()
    per_epoch = full.batches_per_epoch
    reference = list(islice(full, 3 * per_epoch))
    for epoch in range(3):
        rows = [row for batch in reference[epoch * per_epoch : (epoch + 1) * per_epoch] for row in batch]
        indices = [i for row in rows for i in row]
        assert len(indices) == len(set(indices)), "an example appears twice in one epoch"
        # Only the trimmed tail (fewer rows than one global batch) waits for another epoch.
        assert len(indices) >= 100 - 2 * max(len(row) for row in rows)
        assert all(sum(len(examples[i].input_ids) for i in row) <= 64 for row in rows)
    assert reference[:per_epoch] != reference[per_epoch : 2 * per_epoch], "each epoch packs new rows"

    first = make()
    head = list(islice(first, per_epoch + 2))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert first.state_dict() == {"epoch": 1, "position": 2}
    assert head + list(islice(resumed, 2 * per_epoch - 2)) == reference

    shards = [make(rank=r, world_size=2) for r in range(2)]
    epoch = [[i for batch in islice(s, s.batches_per_epoch) for row in batch for i in row] for s in shards]
    assert not set(epoch[0]) & set(epoch[1])
    assert shards[0].batches_per_epoch == shards[1].batches_per_epoch


def test_packed_loader_resumes_with_identical_batches():
    examples = [example(n, i) for i, n in enumerate(_lengths(60, seed=1))]
    make = lambda: BatchLoader(
        examples,
        ShardedSampler(60, batch_size=2, seed=1, packer=row_packer(examples, seq_len=48)),
        seq_len=48,
        pad_token_id=0,
    )
    reference = list(islice(make(), 12))
    first = make()
    list(islice(first, 5))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for expected, got in zip(reference[5:], islice(resumed, 7)):
        for field in ("input_ids", "loss_mask", "lengths", "position_ids", "document_ids"):
            assert torch.equal(getattr(expected, field), getattr(got, field)), field


def test_too_few_rows_for_one_global_batch_is_named():
    examples = [example(4, i) for i in range(6)]
    with pytest.raises(ValueError, match=r"6 examples pack into 1 rows, which are fewer than one global batch"):
        ShardedSampler(6, batch_size=2, packer=row_packer(examples, seq_len=64))


# ---------------------------------------------------------------------------------------
# Batch layout
# ---------------------------------------------------------------------------------------


def test_collate_lays_documents_back_to_back_with_restarting_positions():
    a, b, c = example(3, 1), example(4, 2), example(5, 3)
    batch = collate([[a, b], [c]], seq_len=10, pad_token_id=0)
    assert batch.input_ids[0].tolist() == a.input_ids + b.input_ids + [0] * 3
    assert batch.loss_mask[0].tolist() == [bool(m) for m in a.loss_mask + b.loss_mask] + [False] * 3
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, -1, -1, -1], [0] * 5 + [-1] * 5]
    # Padding continues the last document's count, so a one-document row is 0..S-1 throughout.
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6], list(range(10))]
    assert batch.lengths.tolist() == [7, 5] and batch.num_tokens == 12
    assert _row_fill([batch]) == pytest.approx(12 / 20)
    assert batch.position_ids.dtype == batch.document_ids.dtype == torch.long
    with pytest.raises(ValueError, match=r"row 0 holds 2 examples of \[3, 5\] tokens, 8 > seq_len=7"):
        collate([[a, c]], seq_len=7, pad_token_id=0)


def test_unpacked_rows_match_the_batch_defaults():
    """One example per row (--no-pack) gives what a Batch built from ids, mask and lengths derives."""
    examples = [example(n, n) for n in (4, 9, 1)]
    collated = collate([[e] for e in examples], seq_len=9, pad_token_id=0)
    plain = Batch(collated.input_ids, collated.loss_mask, collated.lengths)
    assert torch.equal(plain.position_ids, collated.position_ids)
    assert torch.equal(plain.document_ids, collated.document_ids)
    moved = collated.to("cpu")
    assert torch.equal(moved.document_ids, collated.document_ids) and torch.equal(
        moved.position_ids, collated.position_ids
    )


# ---------------------------------------------------------------------------------------
# Anchors: per document, the row budget shared max-min fairly
# ---------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(data=packed_batches(), max_anchors=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_anchors_stay_in_their_document_and_share_the_budget_fairly(data, max_anchors, seed):
    loss_mask, document_ids = data
    anchors, valid = masks.sample_anchors(
        loss_mask, max_anchors, document_ids=document_ids, generator=torch.Generator().manual_seed(seed)
    )
    assert anchors.shape == valid.shape == (loss_mask.shape[0], max_anchors)
    for row in range(loss_mask.shape[0]):
        n = int(valid[row].sum())
        assert valid[row, :n].all() and not valid[row, n:].any(), "valid entries must come first"
        chosen = anchors[row, :n].tolist()
        assert chosen == sorted(set(chosen)), "anchors must be sorted and unique"
        candidates = _candidates(loss_mask, document_ids, row)
        taken = {doc: sum(a in positions for a in chosen) for doc, positions in candidates.items()}
        assert sum(taken.values()) == n, "every anchor is a candidate of some document"
        assert n == min(max_anchors, sum(len(p) for p in candidates.values()))
        # Max-min fairness: a document that did not get all its candidates got at least as many
        # anchors as any other document, less one.
        most = max(taken.values(), default=0)
        for doc, positions in candidates.items():
            if taken[doc] < len(positions):
                assert taken[doc] >= most - 1, (taken, {d: len(p) for d, p in candidates.items()})


def test_fair_share_keeps_short_documents_whole_and_splits_the_rest():
    # Documents with 3, 40 and 40 candidates and a budget of 33: the short one keeps its 3, the
    # others split 30 evenly; with 34 one of the long ones gets the leftover, at random.
    batch = packed_batch([[4, 41, 41]], seq_len=90)
    loss_mask = batch.document_ids >= 0
    counts = []
    for budget, seed in [(33, 0)] + [(34, s) for s in range(40)]:
        anchors, valid = masks.sample_anchors(
            loss_mask, budget, document_ids=batch.document_ids, generator=torch.Generator().manual_seed(seed)
        )
        docs = batch.document_ids[0, anchors[0][valid[0]]]
        counts.append(tuple(int((docs == d).sum()) for d in range(3)))
    assert counts[0] == (3, 15, 15)
    assert set(counts[1:]) == {(3, 16, 15), (3, 15, 16)}


def test_anchors_are_uniform_within_a_document():
    batch = packed_batch([[30, 30]], seq_len=60)
    loss_mask = batch.document_ids >= 0
    seen = torch.zeros(60, dtype=torch.long)
    for seed in range(300):
        anchors, valid = masks.sample_anchors(
            loss_mask, 4, document_ids=batch.document_ids, generator=torch.Generator().manual_seed(seed)
        )
        seen.index_add_(0, anchors[0][valid[0]], torch.ones(int(valid.sum()), dtype=torch.long))
    # 29 candidates per document, 2 anchors each per draw: 600 draws / 29 ~ 20.7 expected per position.
    per_position = torch.cat([seen[:29], seen[30:59]])
    assert seen[29] == 0 and seen[59] == 0, "the last token of a document is never an anchor"
    assert per_position.min() >= 5 and per_position.max() <= 45, per_position.tolist()


def test_one_document_rows_draw_the_same_anchors_as_without_documents():
    batch = packed_batch([[20], [7], [25]], seq_len=25, seed=3)
    loss_mask = batch.loss_mask
    plain = masks.sample_anchors(loss_mask, 6, generator=torch.Generator().manual_seed(9))
    with_docs = masks.sample_anchors(
        loss_mask, 6, document_ids=batch.document_ids, generator=torch.Generator().manual_seed(9)
    )
    assert all(torch.equal(x, y) for x, y in zip(plain, with_docs))


def test_document_ids_are_checked():
    loss_mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"document_ids must be an integer tensor"):
        masks.sample_anchors(loss_mask, 2, document_ids=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"document_ids has shape \(2, 4\), expected \[B, S\] = \(2, 5\)"):
        masks.sample_anchors(loss_mask, 2, document_ids=torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------------------------------
# Labels, positions and the DFlash mask with documents
# ---------------------------------------------------------------------------------------


def test_labels_stop_at_the_end_of_the_anchor_document():
    batch = packed_batch([[6, 6]], seq_len=12)
    loss_mask = torch.ones(1, 12, dtype=torch.bool)
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    labels, label_mask = masks.build_labels(
        batch.input_ids, loss_mask, anchors, valid, 4, document_ids=batch.document_ids
    )
    assert label_mask[0, 0].tolist() == [False, True, True, False]  # position 6 starts document 1
    assert label_mask[0, 1].tolist() == [False, True, True, True]
    assert labels[0, 0, 1:3].tolist() == batch.input_ids[0, 4:6].tolist()


def test_draft_positions_continue_the_anchor_position_in_its_document():
    batch = packed_batch([[5, 7]], seq_len=14)
    anchors = torch.tensor([[2, 8]])
    assert masks.draft_position_ids(anchors, 3, batch.position_ids).tolist() == [[2, 3, 4, 3, 4, 5]]
    assert masks.draft_position_ids(anchors, 3).tolist() == [[2, 3, 4, 8, 9, 10]]


def _reference_visible(document_ids, row, anchor, valid, block, kv, context_len, block_size) -> bool:
    """The packed DFlash visibility rule, scalar by scalar: own document, strictly before the anchor."""
    if not valid:
        return False
    if kv < context_len:
        return kv < anchor and document_ids[row, kv] == document_ids[row, anchor]
    return (kv - context_len) // block_size == block


@settings(max_examples=40, deadline=None)
@given(data=packed_batches(max_batch=2, max_len=24), max_anchors=st.integers(1, 6), block_size=st.sampled_from([2, 3]))
def test_dense_mask_with_documents_matches_the_scalar_rule(data, max_anchors, block_size):
    loss_mask, document_ids = data
    anchors, valid = masks.sample_anchors(
        loss_mask, max_anchors, document_ids=document_ids, generator=torch.Generator().manual_seed(0)
    )
    context_len = loss_mask.shape[1]
    dense = masks.dense_attention_mask(anchors, valid, context_len, block_size, document_ids)
    for b in range(loss_mask.shape[0]):
        for q in range(max_anchors * block_size):
            blk = q // block_size
            a, ok = int(anchors[b, blk]), bool(valid[b, blk])
            want = [
                _reference_visible(document_ids, b, a, ok, blk, kv, context_len, block_size)
                for kv in range(dense.shape[-1])
            ]
            assert dense[b, 0, q].tolist() == want
    pairs = masks.visible_pairs(anchors, valid, block_size, document_ids)
    assert int(pairs) == int(dense.sum()), "the FLOP count's visible pairs are the mask's"


def _randompacked_batch(gen: torch.Generator, batch: int, seq_len: int) -> Batch:
    rows = []
    for _ in range(batch):
        lengths, room = [], seq_len - int(torch.randint(0, 6, (1,), generator=gen))
        while room > 1:
            lengths.append(int(torch.randint(1, room + 1, (1,), generator=gen)))
            room -= lengths[-1]
        rows.append(lengths)
    return packed_batch(rows, seq_len, seed=int(torch.randint(0, 1000, (1,), generator=gen)))


@pytest.mark.parametrize("tile", [4, 8, (8, 4), (4, 16), 128])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_block_mask_with_documents_equals_create_block_mask_tile_for_tile(tile, block_size):
    gen = torch.Generator().manual_seed(block_size)
    for _ in range(4):
        context_len = int(torch.randint(3, 80, (1,), generator=gen))
        batch = _randompacked_batch(gen, 2, context_len)
        loss_mask = (torch.rand(2, context_len, generator=gen) < 0.8) & (batch.document_ids >= 0)
        num = int(torch.randint(1, 9, (1,), generator=gen))
        anchors, valid = masks.sample_anchors(loss_mask, num, document_ids=batch.document_ids, generator=gen)
        ours = masks.build_block_mask(anchors, valid, context_len, block_size, batch.document_ids, tile=tile)
        mask_mod = masks.dflash_mask_mod(anchors, valid, context_len, block_size, batch.document_ids)
        q_len, kv_len = num * block_size, context_len + num * block_size
        ref = create_block_mask(mask_mod, 2, None, q_len, kv_len, device="cpu", BLOCK_SIZE=tile)
        assert_same_block_mask(ours, ref)


@pytest.mark.parametrize("tile", [4, 8, (8, 4), 128])
def test_document_causal_block_mask_equals_create_block_mask(tile):
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        seq_len = int(torch.randint(2, 90, (1,), generator=gen))
        batch = _randompacked_batch(gen, 3, seq_len)
        ours = masks.document_causal_block_mask(batch.document_ids, tile=tile)
        ids, last = batch.document_ids, seq_len - 1  # the rule by document id, independent of masks.py

        def mask_mod(b, h, q, kv, ids=ids, last=last):
            return (kv <= q) & (ids[b, torch.clamp(q, max=last)] == ids[b, torch.clamp(kv, max=last)])

        ref = create_block_mask(mask_mod, 3, None, seq_len, seq_len, device="cpu", BLOCK_SIZE=tile)
        assert_same_block_mask(ours, ref)
        dense = masks.document_causal_mask(batch.document_ids)[:, 0]
        same_doc = ids[:, :, None] == ids[:, None, :]
        assert torch.equal(dense, same_doc & torch.ones(seq_len, seq_len, dtype=torch.bool).tril())


# ---------------------------------------------------------------------------------------
# The drafter and the target keep documents apart
# ---------------------------------------------------------------------------------------


def test_drafter_on_a_packed_row_equals_each_conversation_alone():
    drafter = tiny_drafter()
    width, bs = 3 * 32, 4
    gen = torch.Generator().manual_seed(0)
    sizes, seq_len = [9, 12], 24  # two documents, then 3 padding tokens
    batch = packed_batch([sizes], seq_len)
    target_hidden = torch.randn(1, seq_len, width, generator=gen)
    embeds = torch.randn(1, 4 * bs, 32, generator=gen)
    anchors, valid = torch.tensor([[2, 6, 10, 16]]), torch.ones(1, 4, dtype=torch.bool)
    with torch.no_grad():
        packed = drafter(
            embeds, target_hidden, anchors, valid, position_ids=batch.position_ids, document_ids=batch.document_ids
        ).view(4, bs, -1)
        for first, (start, size) in [(0, (0, 9)), (2, (9, 12))]:
            alone = drafter(
                embeds[:, first * bs : (first + 2) * bs],
                target_hidden[:, start : start + size],
                anchors[:, first : first + 2] - start,
            ).view(2, bs, -1)
            torch.testing.assert_close(packed[first : first + 2], alone, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_dir(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=3)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
def test_target_states_of_a_packed_row_equal_each_conversation_alone(target_dir, backend, monkeypatch):
    target = load_target(target_dir, layer_ids=[0, 2], device="cpu")
    if backend == "flex_attention":
        # Unfused: torch 2.13's compiled CPU flex_attention returns NaN for some processes' compiles of
        # these shapes, plain torch too (docs/results.md); CUDA compiles the Triton kernel instead.
        unfused_flex(monkeypatch, target.model)
    else:
        target.model.set_attn_implementation(backend)
    batch, packed = capture_packed_and_alone(target, [7, 11, 4], seq_len=26)
    # Plain causal attention over the row would let the later conversations see the earlier ones.
    leaky = target.capture(batch.input_ids)
    assert not torch.allclose(leaky.context[0, 7:18], packed.context[0, 7:18], atol=1e-3)


def test_unsupported_target_backend_is_named(target_dir):
    target = load_target(target_dir, layer_ids=[0], device="cpu")
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"backend 'flash_attention_2'.*--no-pack"):
        target.capture(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.tensor([[0, 0, 1, 1]]))


# ---------------------------------------------------------------------------------------
# Fixed shapes and the switch
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "sliding_attention", "full_attention"]])
def test_packed_batches_of_any_layout_compile_once(layer_types):
    """Rows with 1, 2 or 5 documents and any anchor count reach the drafter with the same shapes and
    the same mask_mod structure (one per layer type, built outside the step), so dynamo compiles
    the step once, full-attention and sliding-window drafters alike."""
    drafter = tiny_drafter(layer_types, sliding_window=6 if layer_types else None)
    backend = CountingBackend("eager")
    step = torch.compile(drafter, backend=backend, dynamic=False)
    gen = torch.Generator().manual_seed(3)
    block_masks = []
    for layout in ([[40]], [[20, 20]], [[8, 8, 8, 8, 7]]):
        batch = packed_batch(layout * 2, 40)
        loss_mask = (torch.rand(2, 40, generator=gen) < 0.9) & (batch.document_ids >= 0)
        anchors, valid = masks.sample_anchors(loss_mask, 6, document_ids=batch.document_ids, generator=gen)
        mask = drafter.build_attention_mask(anchors, valid, 40, batch.document_ids)
        with torch.no_grad():
            step(
                torch.randn(2, 6 * 4, 32, generator=gen),
                torch.randn(2, 40, 3 * 32, generator=gen),
                anchors,
                valid,
                mask,
                position_ids=batch.position_ids,
            )
        block_masks.append(masks.build_block_mask(anchors, valid, 40, 4, batch.document_ids, tile=8))
    assert backend.compiles() == 1
    shapes = {tuple(t.shape for t in bm.as_tuple() if isinstance(t, torch.Tensor)) for bm in block_masks}
    assert len(shapes) == 1


def test_pack_is_on_by_default_and_switched_off_with_no_pack():
    assert TrainConfig().pack is True
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    train_command.register(subparsers)
    assert parser.parse_args(["train", "--no-pack"]).pack is False
    assert parser.parse_args(["train", "--pack"]).pack is True
    text = subparsers.choices["train"].format_help()
    assert "Several conversations per row" in text
    # A % in a field's docstring is text, not one of argparse's format directives.
    hints, seq_len = (
        typing.get_type_hints(TrainConfig),
        next(f for f in dataclasses.fields(TrainConfig) if f.name == "seq_len"),
    )
    percent = argparse.ArgumentParser()
    train_command._add_field(percent, seq_len, hints, {"seq_len": "rows 97% full"})
    assert "rows 97% full" in percent.format_help()


# ---------------------------------------------------------------------------------------
# The end-to-end benchmark
# ---------------------------------------------------------------------------------------

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "packing_e2e.py"


def _benchmark_module():
    if str(BENCHMARK.parent) not in sys.path:  # as when run as a script: its folder (shapes.py) importable
        sys.path.insert(0, str(BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("packing_e2e", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_specforge_recipe_gives_packed_rows_its_anchors_per_conversation():
    module = _benchmark_module()
    assert module.conversations_per_row([4096] * 10, 8192) == 2.0
    assert module.conversations_per_row([3000] * 9, 8192) == 1.8  # 5 rows: three would not fit
    assert module.conversations_per_row([8192] * 3, 8192) == 1.0
    assert module.packed_anchors(2.0, 512) == 1024
    assert module.packed_anchors(1.8, 512) == 896  # 921.6, to a multiple of 64
    assert module.packed_anchors(1.5, 16) == 64  # at least 64 (24 rounds to 0 blocks of 64)


def test_benchmark_parses_the_agreed_summary_line():
    parse = _benchmark_module().parse_summary
    line = (
        "2026-01-01 00:00:00,000 INFO dflash.train.trainer: steady state over 39 steps: 11769 tok/s end to end, "
        "98304 draft tok/s, target forward 9312 tok/s, drafter step 13446 tok/s, 467 TFLOP/s, "
        "drafter MFU 47.2% of 989 TFLOP/s, row fill 93.1%, "
        "target share 28.4%, supervised draft positions 80120/s end to end, 95012/s per drafter busy second, "
        "peak memory cuda:0 61.2 GiB, cuda:1 40.3 GiB"
    )
    fields = parse("earlier lines\n" + line + "\nsaved checkpoint\n")
    assert fields == {
        "steps": 39,
        "e2e_tok_s": 11769,
        "draft_tok_s": 98304,
        "target_tok_s": 9312,
        "drafter_tok_s": 13446,
        "tflops": 467,
        "mfu_pct": 47.2,
        "row_fill_pct": 93.1,
        "target_share_pct": 28.4,
        "supervised_s": 80120,
        "drafter_supervised_s": 95012,
        "peak_memory": {"cuda:0": 61.2, "cuda:1": 40.3},
    }
    # Today's line (no MFU without --peak-tflops, no fill/share/memory) parses to what it has.
    older = parse(
        "steady state over 5 steps: 1896 tok/s end to end, drafter step 3002 tok/s, 0.0123 TFLOP/s "
        "(pass --peak-tflops for MFU)"
    )
    assert older == {"steps": 5, "e2e_tok_s": 1896, "drafter_tok_s": 3002, "tflops": 0.0123, "peak_memory": {}}
    with pytest.raises(ValueError, match="no 'steady state over' line"):
        parse("Traceback: boom")
