"""dflash.train.regions: the regional compile (one decoder layer and one loss chunk compiled and
reused) computes the eager step's losses, statistics and gradients, compiles each region once per
kind of call however many layers and chunks there are, and leaves the model eager outside a step."""

import copy
import dataclasses

import pytest
import torch
from tiny import micro_batch, random_heads, step_settings, tiny_drafter

from dflash.compile_watch import StepWatch
from dflash.train.regions import compile_step
from dflash.train.step import drafter_forward_loss, drafter_step

SLIDING_THEN_FULL = ["sliding_attention"] * 4 + ["full_attention"]  # the published Qwen3.5/3.6 drafters'


def _step(step_fn, model, heads, inputs, settings):
    model.zero_grad(set_to_none=True)
    weight = settings.position_weight("cpu")
    stats = drafter_step(step_fn, model, heads, *inputs, settings=settings, position_weight=weight)
    return stats, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch, soft", [("dflash", 0.3), ("dflash2", 0.0)])
def test_the_regional_step_equals_the_eager_step_and_compiles_once_per_kind(arch, soft):
    """Two layer graphs for 5 layers: the first layer, whose input needs no gradient, and the rest
    (SDPA's dense masks of full and sliding layers are tensors of one shape; flex_attention's
    BlockMasks differ in mask_mod, a third graph: CUDA, tests/integration/test_regions_cuda.py).
    Two chunk graphs for 4 chunks: whole chunks and the shorter last one. DFlash2's selector loss:
    one graph, once per micro-batch."""
    eager_model = tiny_drafter(SLIDING_THEN_FULL, sliding_window=12, arch=arch).train()
    regional_model = copy.deepcopy(eager_model)
    heads = random_heads(eager_model.config)
    settings = step_settings(soft)
    step_fn, regions = compile_step("regional", 900 if arch == "dflash" else 901, "aot_eager")
    watch = StepWatch("drafter0 (cpu)", regions)
    for seed in (2, 3):
        inputs = micro_batch(eager_model, seed)
        expected_stats, expected_grads = _step(drafter_forward_loss, eager_model, heads, inputs, settings)
        watch.before()
        stats, grads = _step(step_fn, regional_model, heads, inputs, settings)
        watch.after(seed - 1, 40)
        torch.testing.assert_close(stats, expected_stats, rtol=1e-5, atol=1e-5)
        assert grads.keys() == expected_grads.keys() and len(grads) == len(list(eager_model.parameters()))
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        assert all("forward" not in vars(layer) for layer in regional_model.layers)  # eager outside a step
    layer, chunk, selector = regions
    selecting = int(arch == "dflash2")
    assert (layer.backend.compiles(), chunk.backend.compiles(), selector.backend.compiles()) == (2, 2, selecting)
    assert (layer.calls(), chunk.calls(), selector.calls()) == (10, 8, 2 * selecting)
    assert watch.healthy() and watch.compiles == 4 + selecting


def test_the_whole_step_scope_is_one_region_and_an_unknown_scope_is_refused():
    step_fn, regions = compile_step("step", 990, "aot_eager")
    assert regions == [step_fn] and regions[0].name == "drafter step"
    with pytest.raises(ValueError, match="compile_scope must be one of regional, step; got 'layers'"):
        compile_step("layers", 991, "aot_eager")


def test_a_layer_whose_forward_is_not_the_compiled_one_is_refused():
    drafter = tiny_drafter(["full_attention"])
    drafter.layers[0].forward = lambda *args: None  # e.g. another wrapper already installed
    step_fn, _ = compile_step("regional", 902, "aot_eager")
    settings = step_settings()
    with pytest.raises(TypeError, match="DFlashDecoderLayer is not a plain DFlashDecoderLayer"):
        _step(step_fn, drafter.train(), random_heads(drafter.config), micro_batch(drafter, 2), settings)


@pytest.mark.parametrize("scope", ["step", "regional"])
def test_a_micro_batch_of_one_loss_chunk_keeps_its_gradient_under_inductor(scope):
    """With every block in one loss chunk and no selector, the step's loss and the drafter loss it
    reports are one value: inductor computed them as one buffer, and marking the reported copy
    non-differentiable took the gradient from the loss ("element 0 of tensors does not require
    grad" in backward). Inductor on the CPU: a C++ compile of a 1-layer drafter."""
    model = tiny_drafter().train()
    heads = random_heads(model.config)
    settings = dataclasses.replace(step_settings(), chunk_blocks=16, selector_weight=0.0)  # 14 blocks: one chunk
    step_fn, _ = compile_step(scope, 980 if scope == "step" else 981, "inductor")
    expected_stats, expected_grads = _step(
        drafter_forward_loss, copy.deepcopy(model), heads, micro_batch(model, 2), settings
    )
    stats, grads = _step(step_fn, model, heads, micro_batch(model, 2), settings)
    torch.testing.assert_close(stats, expected_stats, rtol=1e-4, atol=1e-4)
    assert grads.keys() == expected_grads.keys() and grads
