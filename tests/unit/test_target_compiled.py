"""dflash.target_model.compiled: the target's per-token work (norms, MLPs, the Gated DeltaNet projections
around its kernels) as compiled regions: the same states as the eager forward, packed documents
still equal to each run alone, every region compiled once whatever the depth, and another thread's
forward untouched."""

import pytest
import torch
from tiny import in_thread, make_target, packed_batch

from dflash.target_model.model import load_target

SIZES = [9, 13, 6, 5]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("dense"), num_layers=4)


def _target(path, backend=None):
    target = load_target(path, layer_ids=[0, 1, 2], device="cpu")
    regions = target.compile_regions(index=0, backend=backend) if backend else []
    return target, regions


def _packed(target):
    batch = packed_batch([SIZES, SIZES[::-1]], seq_len=40, seed=3)
    return batch, target.capture(batch.input_ids, batch.position_ids, batch.document_ids)


def test_a_dense_targets_compiled_regions_give_the_eager_states_and_compile_once(dense_dir):
    _check_against_eager(dense_dir, {"target Qwen3RMSNorm", "target Qwen3MLP"})


def test_a_hybrid_targets_compiled_regions_give_the_eager_states_and_compile_once(hybrid_dir):
    regions = {
        "target Qwen3_5RMSNorm",
        "target Qwen3_5MLP",
        "target Gated DeltaNet inputs",
        "target Gated DeltaNet output",
    }
    _check_against_eager(hybrid_dir, regions)


def _check_against_eager(path, expected: set) -> None:
    eager, _ = _target(path)
    compiled, regions = _target(path, backend="aot_eager")  # traced through FX, eager kernels: exact
    _, want = _packed(eager)
    _, got = _packed(compiled)
    torch.testing.assert_close(got.context, want.context, rtol=0, atol=0)
    torch.testing.assert_close(got.last_hidden, want.last_hidden, rtol=0, atol=0)
    counts = {region.name: region.counts() for region in regions}
    ran = {name for name, (compiles, runs, calls) in counts.items() if runs}
    assert ran == expected
    for name in ran:
        compiles, runs, calls = counts[name]
        assert compiles == 1 and runs == calls > 1, (name, counts[name])  # one graph for every layer


def test_inductor_regions_keep_packed_documents_equal_to_each_alone(hybrid_dir):
    target, _ = _target(hybrid_dir, backend="inductor")
    batch, packed = _packed(target)
    for row, sizes in enumerate([SIZES, SIZES[::-1]]):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for start, size in zip(starts[1:], sizes[1:]):
            alone = target.capture(batch.input_ids[row : row + 1, start : start + size])
            got = packed.context[row : row + 1, start : start + size]
            torch.testing.assert_close(got, alone.context, rtol=1e-4, atol=1e-4)


def test_another_thread_runs_the_layers_eagerly_meanwhile(hybrid_dir):
    target, regions = _target(hybrid_dir, backend="aot_eager")
    _packed(target)
    assert any(runs for _, runs, _ in (region.counts() for region in regions))

    def decode():  # a decoding thread: its own shapes, no regions entered
        target.decoder_forward(torch.arange(1, 12)[None])
        return [region.counts() for region in regions]  # counted per thread

    with target._regions.active():  # while this thread runs the compiled regions
        assert in_thread(decode) == [(0, 0, 0)] * len(regions)


def test_a_region_dynamo_gives_up_on_is_logged_once(dense_dir, caplog, monkeypatch):
    import torch._dynamo.config

    import dflash.target_model.compiled

    monkeypatch.setattr(dflash.target_model.compiled, "RECOMPILE_LIMIT", 1)
    target, _ = _target(dense_dir, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING"):
        target.capture(torch.arange(1, 9)[None])
        assert "ran eagerly" not in caplog.text
        target.capture(torch.arange(1, 12)[None])  # another shape: a recompile past the limit
        target.capture(torch.arange(1, 14)[None])
    assert caplog.text.count("target Qwen3MLP: ") == 1
    assert "target Qwen3MLP: 4 of its 8 calls in this thread ran eagerly" in caplog.text
    assert "the recompile limit 1" in caplog.text


def test_a_region_in_pieces_is_logged(dense_dir, caplog):
    target = load_target(dense_dir, layer_ids=[0, 1, 2], device="cpu")
    layers = target.model.get_decoder().layers

    class BreakingMLP(type(layers[0].mlp)):  # a graph break inside, as an MoE router's hook makes
        def forward(self, x):
            gate = self.gate_proj(x)
            torch._dynamo.graph_break()
            return self.down_proj(self.act_fn(gate) * self.up_proj(x))

    for layer in layers:
        layer.mlp.__class__ = BreakingMLP
    target.compile_regions(index=0, backend="aot_eager")
    with caplog.at_level("WARNING"):
        target.capture(torch.arange(1, 9)[None])
    assert "target BreakingMLP: it ran as 2.0 graphs a call, eager code between them (graph breaks" in caplog.text
