"""The target's forward in FP8 (``dflash train --target-dtype fp8``): the frozen target's linear
layers run as float8 (e4m3) matmuls with a scale per weight row and per token (dynamic), through
torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``, which calls
``torch._scaled_mm``; everything else (embedding, norms, attention, Gated DeltaNet's recurrence,
the LM head) stays bf16, so the tapped hidden states the drafter reads are bf16 tensors.

Why: the target's forward is about half of a step at the user's shape, and its linear layers are
most of that forward; Hopper's FP8 tensor cores run them at twice bf16's peak. Peers train against
FP8 targets (SpecForge's Qwen3.8-27B recipe serves the target in FP8 through SGLang), and
speculators measured eagle3 / DFlash drafters trained on FP8 hidden states of Qwen3-8B to accept as
many tokens as on bf16 ones. ``benchmarks/fp8_target.py`` measures the tapped states' deviation,
FP8 against bf16 next to bf16 against fp32 on the same rows, and the forward's speed. The matmuls
take half bf16's time, but eagerly each activation is quantized in several kernels before its
matmul, once per layer that reads it, so the eager FP8 forward is slower than bf16's (0.88-0.91x at a
16-layer cut of Qwen3.6-27B on an H100); with the target's per-token work compiled
(:mod:`dflash.target_model.compiled`, on under ``--compile``) the quantization fuses into the op before
and the FP8 forward ran 1.57-1.71x the eager bf16 one, 1.31x the compiled bf16 one inside training
(``docs/results.md``, 2026-12-06). It also halves the target's weight memory (22.6 GiB less peak
at the user's full shape).

FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) and
torchao (``pip install -e '.[fp8]'``); :func:`fp8_problem` says what is missing before anything
loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

#: Ada (8.9) and newer have FP8 tensor cores (torchao's own check).
FP8_MIN_CAPABILITY = (8, 9)
#: ``torch._scaled_mm`` needs both matmul dimensions to be multiples of 16.
FP8_ALIGNMENT = 16
INSTALL = "pip install -e '.[fp8]' (or pip install torchao)"
#: The least amax a token's row-wise activation scale is computed from (torchao's float8 training
#: uses the same floor), so an all-zero row quantizes to zeros. A floor sends torchao's activation
#: quantization to its PyTorch ops even where its fused MSLK row-quantize kernel is installed (that
#: kernel takes no floor); the PyTorch ops are what every measurement here ran.
ACTIVATION_AMAX_FLOOR = 1e-12


def fp8_problem(device: torch.device) -> str | None:
    """Why the target cannot run FP8 linear layers on ``device``; None when it can.

    Asks torch about the device (no CUDA context beyond the device query) and looks for torchao
    without importing it.
    """
    if device.type != "cuda":
        major, minor = FP8_MIN_CAPABILITY
        return f"FP8 matmuls need an NVIDIA GPU of compute capability {major}.{minor}+, the target is on {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{device} ({name}) has compute capability {capability[0]}.{capability[1]}; FP8 matmuls need "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ (Ada, Hopper or newer)"
        )
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8 matmul (torch._scaled_mm)"
    if importlib.util.find_spec("torchao") is None:
        return f"torchao, which quantizes the linear layers, is not installed: {INSTALL}"
    return None


def quantizable(module: torch.nn.Module, name: str) -> bool:
    """Whether the linear layer ``name`` of a target runs in FP8: every ``nn.Linear`` whose
    dimensions ``torch._scaled_mm`` takes, except the LM head (the drafter's loss and the
    soft labels read its logits; a multimodal checkpoint's vision tower is never loaded) and a
    layer with an all-zero weight row (a pruned output: its row-wise scale would be 0, and 0 / 0
    makes that output NaN for every token)."""
    return (
        isinstance(module, torch.nn.Linear)
        and not name.split(".")[-1] == "lm_head"
        and module.in_features % FP8_ALIGNMENT == 0
        and module.out_features % FP8_ALIGNMENT == 0
        and bool(torch.linalg.vector_norm(module.weight.detach(), float("inf"), dim=1).min() > 0)
    )


@dataclass(frozen=True)
class Fp8Report:
    """What :func:`quantize_target` turned to FP8.

    Args:
        layers (int): linear layers now FP8.
        bf16_layers (int): linear layers left bf16 (the LM head, unaligned ones, any with an all-zero weight row).
        weight_share (float): the FP8 layers' share of the decoder's weight elements (what is left
            runs bf16: norms, convolutions, and weights outside ``nn.Linear`` such as MoE experts).
    """

    layers: int
    bf16_layers: int
    weight_share: float


def quantize_target(model: torch.nn.Module) -> Fp8Report:
    """Turn the linear layers :func:`quantizable` picks to FP8 in place (row-wise dynamic scales).

    Args:
        model: the target (a ``PreTrainedModel``), bf16, on a device :func:`fp8_problem` accepts.

    Returns:
        Fp8Report

    Raises:
        RuntimeError: :func:`fp8_problem`'s reason, for a device or install it refuses; or torchao
            left a chosen layer unconverted (named).
    """
    device = next(model.parameters()).device
    if problem := fp8_problem(device):
        raise RuntimeError(f"--target-dtype fp8: {problem}")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8Tensor, PerRow, quantize_

    linear = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    chosen = {name for name, m in linear.items() if quantizable(m, name)}
    decoder_weights = (
        sum(p.numel() for p in model.get_decoder().parameters()) - model.get_input_embeddings().weight.numel()
    )
    fp8_weights = sum(linear[name].weight.numel() for name in chosen)
    # set_inductor_config=False: torchao would otherwise change inductor's process-wide settings,
    # which the drafter's compiled step reads too. activation_value_lb: a token's scale is its
    # row's amax / 448, so an all-zero row (a padding token whose embedding is zero, as
    # transformers initialises a pad row) would be divided by a zero scale into NaN, which
    # attention (the target's, then the drafter's) spreads to every token through masked keys
    # (0 * NaN); the floor keeps it zero.
    config = Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), set_inductor_config=False, activation_value_lb=ACTIVATION_AMAX_FLOOR
    )
    quantize_(model, config, filter_fn=lambda module, name: name in chosen)
    missed = sorted(name for name in chosen if not isinstance(linear[name].weight, Float8Tensor))
    if missed:
        raise RuntimeError(f"--target-dtype fp8: torchao left {len(missed)} linear layers unconverted: {missed[:5]}")
    return Fp8Report(len(chosen), len(linear) - len(chosen), fp8_weights / max(decoder_weights, 1))
