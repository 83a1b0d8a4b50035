"""The regional compile on CUDA (skipped without it): flex_attention with sliding and full layers,
bf16 autocast, inductor. The regional step's statistics are the eager step's within bf16 rounding,
and its gradients are within twice as far from the float32 step's as the farther of the eager and
the one-graph steps' (bf16 rounding: each fusion rounds in other places),
the regions compile once per kind of call, and no region runs eagerly.

    python -m pytest tests/integration/test_regions_cuda.py -q -s
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tiny import micro_batch, random_heads, step_settings, tiny_target_config

from dflash.compile_watch import StepWatch
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.target_model.model import TargetStates
from dflash.train.regions import GRAPHS_PER_SHAPE, compile_step
from dflash.train.replica import Heads
from dflash.train.step import drafter_forward_loss, drafter_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA")


#: The micro-batches each step runs (gradients zeroed before each: the last one's are compared).
SEEDS = (2, 3)


def _flex_drafter(arch: str) -> AnchoredDrafter:
    """5 layers (4 sliding, 1 full) at head_dim 16, flex_attention's smallest tile width."""
    target = tiny_target_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = create_drafter_config(
        target,
        5,
        block_size=4,
        num_captured_layers=3,
        mask_token_id=63,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=12,
        arch=arch,
    )
    torch.manual_seed(0)
    return AnchoredDrafter._from_config(config, attn_implementation="flex_attention").cuda().train()


def _fp32_gradients(model: AnchoredDrafter, heads, batch, settings, monkeypatch) -> dict[str, torch.Tensor]:
    """The eager step's gradients with bf16 autocast off, on the bf16 inputs the other steps read
    (upcast): the reference each compiled form's rounding is measured from."""
    import contextlib

    target_batch, anchors, valid = batch
    states = TargetStates(*(t.float() for t in (target_batch.states.context, target_batch.states.last_hidden)))
    fp32_heads = Heads(*(copy.deepcopy(m).float() for m in (heads.embed_tokens, heads.lm_head)))
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())
        drafter_step(
            drafter_forward_loss,
            model,
            fp32_heads,
            dataclasses.replace(target_batch, states=states),
            anchors,
            valid,
            settings=settings,
            position_weight=settings.position_weight("cuda"),
        )
    return {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_regional_and_whole_step_compiles_agree_on_cuda(arch, monkeypatch):
    models = {scope: _flex_drafter(arch) for scope in ("regional", "step", "eager")}
    for scope in ("step", "eager"):
        models[scope].load_state_dict(models["regional"].state_dict())
    heads = random_heads(models["step"].config, "cuda", torch.bfloat16)
    settings = step_settings()
    results = {}
    for index, (scope, model) in enumerate(models.items()):
        if scope == "eager":
            step_fn, regions = drafter_forward_loss, []
        else:
            step_fn, regions = compile_step(scope, 800 + index + (10 if arch == "dflash2" else 0), "inductor")
        watch = StepWatch(scope, regions)
        for seed in SEEDS:
            model.zero_grad(set_to_none=True)
            watch.before()
            stats = drafter_step(
                step_fn,
                model,
                heads,
                *micro_batch(model, seed, "cuda", torch.bfloat16),
                settings=settings,
                position_weight=settings.position_weight("cuda"),
            )
            watch.after(SEEDS.index(seed) + 1, 40)
        assert watch.healthy(), (scope, watch.summary())
        results[scope] = (stats, {n: p.grad.float() for n, p in model.named_parameters()}, regions)
    last_batch = micro_batch(models["eager"], SEEDS[-1], "cuda", torch.bfloat16)  # what the grads above are of
    truth = _fp32_gradients(models["eager"], heads, last_batch, settings, monkeypatch)
    stats, _, regions = results["regional"]
    torch.testing.assert_close(stats, results["eager"][0], rtol=2e-2, atol=2e-2)
    for name, want in truth.items():  # some start at 0 (DFlash2's zero-initialised selector factor)
        error = {scope: float((grads[name] - want).norm()) for scope, (_, grads, _) in results.items()}
        scale = float(want.norm())
        assert error["regional"] <= 2 * max(error["step"], error["eager"]) + 1e-4 * scale + 1e-6, (name, error, scale)
    layer, chunk = regions[:2]  # the selector loss region is third (DFlash2 only calls it)
    print(arch, "layer graphs", layer.backend.compiles(), "chunk graphs", chunk.backend.compiles())
    # The first layer (its input needs no gradient), sliding and full layers (their BlockMasks'
    # mask_mods differ); whole chunks and the shorter last one.
    assert (layer.backend.compiles(), chunk.backend.compiles()) == (GRAPHS_PER_SHAPE, 2)
