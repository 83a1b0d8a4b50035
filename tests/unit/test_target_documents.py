"""dflash.target_model.documents: every conversation of a packed row gets, at every layer of a hybrid
(Qwen3.5 / Qwen3.6: Gated DeltaNet + gated attention) target, the hidden states it gets alone; layer
types packing cannot keep apart are refused before anything loads."""

import json

import pytest
import torch
from tiny import make_target, packed_batch, unfused_flex

from dflash.target_model import documents
from dflash.target_model.files import UnknownLayerType, check_packable, layer_types
from dflash.target_model.model import TargetStates, load_target


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    return load_target(hybrid_dir, layer_ids=list(range(8)), device="cpu")


SIZES = [9, 13, 6, 5]


def _later_documents(batch):
    """(row, start, size) of every document after the first of its row: the ones packing can leak into."""
    for row, sizes in enumerate([SIZES, SIZES[::-1]]):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        yield from ((row, start, size) for start, size in zip(starts[1:], sizes[1:]))


def _worst_later_difference(target, states, batch) -> float:
    worst = 0.0
    for row, start, size in _later_documents(batch):
        alone = target.capture(batch.input_ids[row : row + 1, start : start + size])
        for field in ("context", "last_hidden"):
            got = getattr(states, field)[row : row + 1, start : start + size]
            worst = max(worst, (got - getattr(alone, field)).abs().max().item())
    return worst


def test_packed_rows_equal_each_conversation_alone_at_every_layer(hybrid):
    batch = packed_batch([SIZES, SIZES[::-1]], seq_len=40, seed=3)
    packed = hybrid.capture(batch.input_ids, batch.position_ids, batch.document_ids)
    # Every layer is tapped (context holds all 8 layer outputs), and last_hidden is the final norm's.
    assert packed.context.shape[-1] == 8 * hybrid.hidden_size
    assert _worst_later_difference(hybrid, packed, batch) <= 1e-4


def test_the_document_mask_alone_leaks_through_the_linear_layers(hybrid):
    # What packing did before linear layers were kept apart: the attention layers masked, the Gated
    # DeltaNet conv and recurrence running on across documents.
    batch = packed_batch([SIZES, SIZES[::-1]], seq_len=40, seed=3)
    mask = documents.attention_mask(batch.document_ids, hybrid.config._attn_implementation, hybrid.dtype)
    out = hybrid.decoder_forward(batch.input_ids, position_ids=batch.position_ids, attention_mask=mask)
    leaky = TargetStates(hybrid.select(out.hidden_states), out.hidden_states[-1])
    assert _worst_later_difference(hybrid, leaky, batch) > 1e-3


def test_another_threads_forward_during_a_packed_capture_is_untouched(hybrid):
    # The segmented forward is the packing thread's alone: a target thread's packed capture must
    # not change what another thread (decoding, regeneration, an acceptance check) computes.
    import threading

    from tiny import in_thread

    batch = packed_batch([SIZES], seq_len=40, seed=5)
    hybrid.capture(batch.input_ids, batch.position_ids, batch.document_ids)  # installs the segmented forward
    before = hybrid.capture(batch.input_ids[:, :9])
    inside, release = threading.Event(), threading.Event()
    segments = documents.Segments.of(batch.document_ids, torch.device("cpu"))

    def packed_capture_in_flight():
        with documents.linear_layers_apart(segments, documents.REFERENCE_KERNELS):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=packed_capture_in_flight)
    holder.start()
    try:
        assert inside.wait(30)
        during = in_thread(lambda: hybrid.capture(batch.input_ids[:, :9]))
    finally:
        release.set()
        holder.join()
    torch.testing.assert_close(during.context, before.context, rtol=0, atol=0)


def test_segments_are_every_document_and_each_rows_tail_padding():
    batch = packed_batch([[3, 2], [4]], seq_len=6, seed=0)  # row 0: 3 + 2 + 1 pad; row 1: 4 + 2 pad
    segments = documents.Segments.of(batch.document_ids, torch.device("cpu"), conv_width=3)
    assert segments.cu_seqlens_cpu.tolist() == [0, 3, 5, 6, 10, 12]
    # The first 2 (= W - 1) tokens of each segment that lie inside it: the pad segment at 5 has one.
    assert segments.head_targets.tolist() == [0, 1, 3, 4, 5, 6, 7, 10, 11]


@pytest.mark.parametrize("sizes", [[10], [1, 2, 7], [3, 1, 1, 5], [2, 8]])
def test_segmented_conv_equals_each_segment_convolved_alone(sizes):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, sum(sizes), 6), torch.randn(6, 4), torch.randn(6)
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])[None]
    got = documents.segmented_conv(x, weight, bias, "silu", documents.Segments.of(ids, x.device))
    start = 0
    for n in sizes:
        part = x[:, start : start + n].transpose(1, 2)
        alone = torch.nn.functional.conv1d(part, weight[:, None], bias, padding=3, groups=6)[..., :n]
        torch.testing.assert_close(
            got[:, start : start + n], torch.nn.functional.silu(alone).transpose(1, 2), rtol=0, atol=1e-6
        )
        start += n


def test_layer_types_of_configs_that_do_not_list_them():
    assert (
        layer_types({"num_hidden_layers": 8, "linear_conv_kernel_dim": 4})
        == [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ]
        * 2
    )
    assert layer_types({"num_hidden_layers": 2, "sliding_window": 4096}) == ["sliding_attention"] * 2
    qwen3 = {"num_hidden_layers": 2, "sliding_window": 4096, "use_sliding_window": False}
    assert layer_types(qwen3) == ["full_attention"] * 2


def test_a_layer_type_packing_cannot_keep_apart_is_named_with_no_pack():
    config = {"num_hidden_layers": 2, "layer_types": ["chunked_attention", "full_attention"]}
    with pytest.raises(UnknownLayerType, match=r"'chunked_attention'.*--no-pack"):
        check_packable(config, "t/config.json")
    check_packable({**config, "layer_types": ["sliding_attention", "full_attention"]}, "c")
    check_packable({"num_hidden_layers": 4, "linear_conv_kernel_dim": 4}, "t/config.json")


def test_a_linear_layer_of_another_design_is_refused_for_packing(hybrid, monkeypatch):
    mixer = next(iter(documents.linear_layers(hybrid.model).values()))
    monkeypatch.delattr(mixer, "in_proj_qkv")
    with pytest.raises(UnknownLayerType, match=r"no in_proj_qkv.*--no-pack"):
        documents.linear_layers(hybrid.model)


def test_packing_a_target_with_a_layer_type_it_cannot_keep_apart_is_refused_before_it_loads(tmp_path):
    from tiny import write_chat_data

    from dflash.config import TrainConfig
    from dflash.run.drafter_shape import resolve_drafter_shape
    from dflash.run.preflight import validate_inputs

    target = make_target(tmp_path / "target", num_layers=2)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "layer_types": ["chunked_attention", "full_attention"]}))
    run = dict(target=str(target), data=str(write_chat_data(tmp_path / "chats.jsonl")), out=str(tmp_path / "run"))
    run.update(num_target_layers=1)
    with pytest.raises(UnknownLayerType, match=r"'chunked_attention'.*--no-pack"):
        validate_inputs(resolve_drafter_shape(TrainConfig(**run)))
    validate_inputs(resolve_drafter_shape(TrainConfig(**run, pack=False)))


def test_one_document_rows_take_the_segmented_route_too(hybrid, monkeypatch):
    # One set of linear-attention kernels for every batch: transformers' own Gated DeltaNet
    # forward (another kernel path to compile and autotune on CUDA) is never called in training.
    from dflash.train.step import produce_target_states

    segmented = []
    original = documents._gated_deltanet_forward
    monkeypatch.setattr(documents, "_gated_deltanet_forward", lambda *a, **k: segmented.append(1) or original(*a, **k))
    produce_target_states(hybrid, packed_batch([[9], [13]], seq_len=16, seed=1), last_hidden=True)
    assert len(segmented) == len(documents.linear_layers(hybrid.model))


def test_the_segmented_conv_indexes_without_a_host_sync():
    # Boolean indexing (aten::nonzero) waits for the GPU; the layers index with what Segments.of
    # computed on the host once per batch. The profiler sees the same ops on CPU.
    from torch.profiler import profile

    ids = torch.cat([torch.full((n,), d) for d, n in enumerate([5, 1, 9])])[None]
    segments = documents.Segments.of(ids, torch.device("cpu"))
    x, weight = torch.randn(1, ids.shape[1], 8), torch.randn(8, 4)
    with profile() as prof:
        documents.segmented_conv(x, weight, None, "silu", segments)
    assert not [e.key for e in prof.key_averages() if "nonzero" in e.key]


WINDOW = 4  # shorter than most of SIZES' documents, so the window decides what a later token sees


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def sliding_dir(request, tmp_path_factory):
    """A target whose attention slides over WINDOW tokens: Mistral's every layer, Qwen3's second half."""
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, sliding_window=WINDOW)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
def test_packed_rows_of_a_sliding_window_target_equal_each_conversation_alone(sliding_dir, backend, monkeypatch):
    target = load_target(sliding_dir, layer_ids=[0, 1, 2, 3], device="cpu")
    if backend == "flex_attention":
        unfused_flex(monkeypatch, target.model)
    else:
        target.model.set_attn_implementation(backend)
    batch = packed_batch([SIZES, SIZES[::-1]], seq_len=40, seed=3)
    packed = target.capture(batch.input_ids, batch.position_ids, batch.document_ids)
    assert _worst_later_difference(target, packed, batch) <= 1e-4


def test_a_document_mask_without_the_window_changes_the_later_documents(sliding_dir):
    # Teeth: the window matters here, so a packed mask that forgot it would be caught above.
    target = load_target(sliding_dir, layer_ids=[0, 1, 2, 3], device="cpu")
    batch = packed_batch([SIZES, SIZES[::-1]], seq_len=40, seed=3)
    mask = documents.attention_mask(batch.document_ids, "sdpa", target.dtype)
    out = target.decoder_forward(batch.input_ids, position_ids=batch.position_ids, attention_mask=mask)
    windowless = TargetStates(target.select(out.hidden_states), out.hidden_states[-1])
    assert _worst_later_difference(target, windowless, batch) > 1e-3


def test_cuda_takes_flash_linear_attentions_varlen_conv_and_the_cpu_the_reference(monkeypatch):
    """The trainer's kernels: the set measured to keep the packing bar at the user's layout and run
    fastest of those that do (docs/results.md); the CPU, or CUDA without the package, the reference."""
    monkeypatch.setattr(documents, "fla_available", lambda: True)
    assert documents.kernels_for(torch.device("cuda", 0)) is documents.FLA_CONV_KERNELS
    assert documents.kernels_for(torch.device("cpu")) is documents.REFERENCE_KERNELS
    monkeypatch.setattr(documents, "fla_available", lambda: False)
    assert documents.kernels_for(torch.device("cuda", 0)) is documents.REFERENCE_KERNELS
