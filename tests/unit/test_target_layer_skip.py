"""dflash.target_model.layer_skip: a capture without the final hidden state stops at the deepest tapped layer,
with the same tapped states, and only in the capturing thread."""

import pytest
import torch
from tiny import in_thread, make_target, packed_batch

from dflash.target_model.layer_skip import LayerSkip
from dflash.target_model.model import Target, load_target


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def dense_dir(request, tmp_path_factory):
    return make_target(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=6)


def _calls_of_last_layer(target) -> list[int]:
    """A list that grows by one each time the last decoder layer's MLP runs."""
    calls = []
    target.model.get_decoder().layers[-1].mlp.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _capture_skips_the_layers_past_the_deepest_tap(target, *args):
    calls = _calls_of_last_layer(target)
    full = target.capture(*args)
    assert len(calls) == 1
    shallow = target.capture(*args, last_hidden=False)
    assert len(calls) == 1, "the last layer ran although no tap reads it"
    assert shallow.last_hidden is None
    assert torch.equal(shallow.context, full.context)
    return full


def test_dense_target_stops_at_its_deepest_tap(dense_dir):
    # Deepest tap L - 2: the stack's last hidden state (a skipped layer's) is the one transformers
    # replaces by the final norm's output, next to the deepest tapped one.
    target = load_target(dense_dir, layer_ids=[0, 2, 4], device="cpu")
    _capture_skips_the_layers_past_the_deepest_tap(target, torch.randint(5, 200, (2, 11)))


def test_hybrid_packed_rows_stop_at_the_deepest_tap(hybrid_dir):
    # Layers 6 and 7 (a Gated DeltaNet and a gated attention layer) are skipped; the packed states of
    # the tapped layers stay those of the full forward, bit for bit.
    target = load_target(hybrid_dir, layer_ids=[1, 3, 5], device="cpu")
    batch = packed_batch([[9, 13, 6], [5, 9]], seq_len=32, seed=2)
    _capture_skips_the_layers_past_the_deepest_tap(target, batch.input_ids, batch.position_ids, batch.document_ids)


def test_a_tap_on_the_last_layer_runs_every_layer(dense_dir):
    # Id L - 1 is the final-norm output: nothing can be skipped, and the states do not change.
    target = load_target(dense_dir, layer_ids=[1, 5], device="cpu")
    calls = _calls_of_last_layer(target)
    ids = torch.randint(5, 200, (1, 7))
    assert torch.equal(target.capture(ids, last_hidden=False).context, target.capture(ids).context)
    assert len(calls) == 2


def test_another_thread_runs_every_layer_while_a_capture_skips(dense_dir):
    # The other thread runs in the middle of a skipping capture, when the deepest tapped layer's
    # output is kept and the layers after it are about to be skipped.
    target = load_target(dense_dir, layer_ids=[0, 2], device="cpu")
    ids = torch.randint(5, 200, (1, 9))
    reference = target.capture(ids)
    during = []

    def capture_in_another_thread(*_):
        if not during:  # once, from the main thread's capture (the other thread passes here too)
            during.append(None)
            during.append(in_thread(lambda: target.capture(ids)))

    hook = target.model.get_decoder().layers[2].register_forward_hook(capture_in_another_thread)
    try:
        shallow = target.capture(ids, last_hidden=False)
    finally:
        hook.remove()
    torch.testing.assert_close(during[1].last_hidden, reference.last_hidden, rtol=0, atol=0)
    assert torch.equal(shallow.context, reference.context)
    torch.testing.assert_close(target.capture(ids).last_hidden, reference.last_hidden, rtol=0, atol=0)


def test_two_targets_on_one_model_skip_their_own_layers(dense_dir):
    shallow = load_target(dense_dir, layer_ids=[0, 2], device="cpu")
    deeper = Target(shallow.model, [1, 4])
    ids = torch.randint(5, 200, (2, 8))
    for target in (deeper, shallow):
        assert torch.equal(target.capture(ids, last_hidden=False).context, target.capture(ids).context)


class _TupleLayer(torch.nn.Module):
    """A decoder layer of the older convention: returns ``(hidden_states,)``."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, hidden_states):
        return (hidden_states * self.scale + 1,)


def _tuple_stack(layers, hidden):
    for layer in layers:
        hidden = layer(hidden)[0]
    return hidden


def test_a_skipped_layer_returns_the_deepest_output_in_its_convention():
    layers = torch.nn.ModuleList(_TupleLayer(s) for s in (2.0, 3.0, 5.0, 7.0))
    x = torch.ones(2, 3)
    deepest = layers[1](layers[0](x)[0])[0]
    skip = LayerSkip.past(layers, 1)
    with skip.skipping():
        assert torch.equal(_tuple_stack(layers, x), deepest)
    assert torch.equal(_tuple_stack(layers, x), ((deepest * 5 + 1) * 7 + 1))
    assert LayerSkip.past(layers, 3) is None
    with pytest.raises(ValueError, match="no layer after it to skip"):
        LayerSkip(layers, 3)


def test_an_exception_inside_a_skipping_forward_leaves_no_skipping_behind():
    layers = torch.nn.ModuleList(_TupleLayer(s) for s in (2.0, 3.0, 5.0))
    skip = LayerSkip.past(layers, 0)
    x = torch.ones(1, 2)
    with pytest.raises(RuntimeError, match="boom"), skip.skipping():
        _tuple_stack(layers, x)
        raise RuntimeError("boom")
    assert torch.equal(_tuple_stack(layers, x), ((x * 2 + 1) * 3 + 1) * 5 + 1)
