"""Packed targets at public widths on CUDA. Hybrid (Qwen3.6) targets with flash-linear-attention:
its varlen kernels equal the exact reference on segments, and a packed row's later conversations
differ from each run alone no more than packing already differs on a dense Qwen3 target of the
same width (bf16 rounding of the two attention kernels). Sliding-window layers: the same bar
against the same dense target with its window off. Needs a GPU (and flash-linear-attention for the
hybrid tests); skipped otherwise (run on the device host: ``pytest
tests/integration/test_hybrid_cuda.py -s`` prints the measured differences)."""

import pytest
import torch

from dflash.target_model import documents
from dflash.target_model.files import fla_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_fla = pytest.mark.skipif(not fla_available(), reason="needs flash-linear-attention")

VOCAB = 151936  # token ids valid in both targets' vocabularies
LAYERS = 4  # one round of Qwen3.6's 3 Gated DeltaNet + 1 gated attention layers
#: Documents of the two packed rows (tokens), the second row reversed: every size is a later document somewhere.
SIZES = [700, 300, 513, 64, 400, 70]


@needs_fla
def test_fla_delta_rule_equals_the_reference_on_segments():
    torch.manual_seed(0)
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate([100, 37, 1, 200, 62])])[None]
    segments = documents.Segments.of(ids, torch.device("cuda"))
    tokens = ids.shape[1]
    q, k = (torch.randn(1, tokens, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, tokens, 4, 64, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, tokens, 4, device="cuda").mul(0.5)
    beta = torch.rand(1, tokens, 4, device="cuda", dtype=torch.bfloat16)
    out = [
        kernels.delta_rule(q, k, v, g, beta, segments).float()
        for kernels in (documents.FLA_KERNELS, documents.REFERENCE_KERNELS)
    ]
    print(f"delta rule: fla vs reference max abs {(out[0] - out[1]).abs().max().item():.3e}")
    torch.testing.assert_close(out[0], out[1], rtol=3e-2, atol=3e-2)


@needs_fla
def test_varlen_and_fused_kernels_equal_the_ops_they_replace_on_segments():
    """flash-linear-attention's varlen conv restarts at each segment as the segmented conv does (its
    activation after it, as transformers applies it: within one bf16 rounding of the sum's order);
    fused with the activation, and its gated RMSNorm, they are transformers' within the rounding they
    place differently."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    torch.manual_seed(0)
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate([100, 37, 1, 2, 200, 62])])[None]
    segments = documents.Segments.of(ids, torch.device("cuda"))
    x = torch.randn(1, ids.shape[1], 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16) / 2
    kernel_sets = (documents.FLA_FUSED_KERNELS, documents.FLA_CONV_KERNELS, documents.FLA_KERNELS)
    fused, varlen, ops = (k.conv(x, weight, None, "silu", segments).float() for k in kernel_sets)
    norm = Qwen3_5RMSNormGated(128).cuda().to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    h, z = (torch.randn(500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gated = [k.gated_norm(norm, h, z).float() for k in (documents.FLA_FUSED_KERNELS, documents.FLA_KERNELS)]
    for name, (got, want), tolerance in (
        ("varlen conv", (varlen, ops), 1e-2),
        ("fused conv", (fused, ops), 2e-2),
        ("fused gated norm", gated, 2e-2),
    ):
        print(f"{name} vs ops: max abs {(got - want).abs().max().item():.3e}")
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@needs_fla
def test_a_changing_segment_count_compiles_no_new_kernels():
    """Packed batches differ in their number of documents every step; the varlen kernels must not
    compile (or autotune) again for each count."""
    import triton

    def compiled_kernels() -> int:
        import sys

        total = 0
        for name, module in list(sys.modules.items()):
            if not name.startswith("fla.ops"):
                continue
            for obj in vars(module).values():
                while hasattr(obj, "fn") and not isinstance(obj, triton.runtime.jit.JITFunction):
                    obj = obj.fn
                if isinstance(obj, triton.runtime.jit.JITFunction):
                    total += sum(len(cache[0]) for cache in obj.device_caches.values())
        return total

    tokens = 4096
    args = lambda: (
        torch.randn(1, tokens, 16, 128, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, tokens, 16, 128, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, tokens, 48, 128, device="cuda", dtype=torch.bfloat16),
        -torch.rand(1, tokens, 48, device="cuda"),
        torch.rand(1, tokens, 48, device="cuda", dtype=torch.bfloat16),
    )
    counts = []
    for sizes in ([2048, 2048], [700, 300, 1048, 2048], [100] * 40 + [96], [4096]):
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)])[None]
        documents.FLA_KERNELS.delta_rule(*args(), documents.Segments.of(ids, torch.device("cuda")))
        torch.cuda.synchronize()
        counts.append(compiled_kernels())
    print(f"compiled Triton kernels after 2, 4, 41 and 1 segments: {counts}")
    assert counts[0] > 0 and len(set(counts[1:])) == 1 and counts[1] == counts[0]


#: Qwen3-8B's window for its second half of layers in the sliding test (Qwen3's max_window_layers
#: rule): shorter than 4 of the 6 documents, so a packed row that ignored it would differ.
WINDOW = 256


def _target(kind: str, kernels: documents.LinearAttentionKernels | None = None):
    """The first 4 layers of Qwen3.6-27B (``"hybrid"``: one round of its layout), of Qwen3-32B
    (``"dense"``, the same width), or of Qwen3-8B with (``"sliding"``) or without (``"qwen3-8b"``)
    a window of :data:`WINDOW` tokens on layers 2 and 3."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from shapes import dense_text_config, hybrid_text_config
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    from dflash.target_model.model import Target

    torch.manual_seed(0)
    if kind == "hybrid":
        config, make = hybrid_text_config("qwen3.6-27b", LAYERS), Qwen3_5ForCausalLM
    elif kind == "dense":
        config, make = dense_text_config("qwen3-32b", LAYERS), Qwen3ForCausalLM
    else:
        window = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=LAYERS // 2)
        config = dense_text_config("qwen3-8b", LAYERS, **(window if kind == "sliding" else {}))
        if kind == "sliding":
            assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2, config.layer_types
        make = Qwen3ForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = make(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return Target(model, list(range(LAYERS)), linear_kernels=kernels)


def _worst_later_difference(target, *, mask_only: bool = False) -> float:
    """Largest |packed - alone| over every tapped layer of every later document; with ``mask_only``
    the packed forward gets the attention layers' document mask and nothing else."""
    from tiny import packed_batch

    from dflash.target_model.model import TargetStates

    rows = [SIZES, SIZES[::-1]]
    batch = packed_batch(rows, seq_len=sum(SIZES) + 1, seed=2)
    batch.input_ids.random_(5, VOCAB)
    if mask_only:
        mask = documents.attention_mask(batch.document_ids.cuda(), "sdpa", target.dtype)
        out = target.decoder_forward(
            batch.input_ids.cuda(), position_ids=batch.position_ids.cuda(), attention_mask=mask
        )
        packed = TargetStates(target.select(out.hidden_states), out.hidden_states[-1])
    else:
        packed = target.capture(batch.input_ids, batch.position_ids, batch.document_ids)
    worst = 0.0
    for row, sizes in enumerate(rows):
        start = sizes[0]
        for size in sizes[1:]:
            alone = target.capture(batch.input_ids[row : row + 1, start : start + size])
            got = packed.context[row : row + 1, start : start + size]
            worst = max(worst, (got.float() - alone.context.float()).abs().max().item())
            start += size
    return worst


def _packing_differences(kind: str, dense: str, kernels=None) -> tuple[float, float, float]:
    """(packed ``kind`` target, the same with the document mask alone, packed ``dense`` target):
    :func:`_worst_later_difference` of each, one target on the GPU at a time."""
    target = _target(kind, kernels)
    packed, mask_only = _worst_later_difference(target), _worst_later_difference(target, mask_only=True)
    del target
    torch.cuda.empty_cache()
    return packed, mask_only, _worst_later_difference(_target(dense))


@needs_fla
@pytest.mark.parametrize("kernels", [documents.FLA_KERNELS, documents.FLA_CONV_KERNELS], ids=["fla", "fla-conv"])
def test_packed_hybrid_rows_stay_within_dense_packings_bf16_difference(kernels):
    hybrid, leaky, dense = _packing_differences("hybrid", "dense", kernels)
    print(
        f"packed vs alone, later documents, every layer, bf16, {kernels.name}: hybrid {hybrid:.4f} (document "
        f"mask alone: {leaky:.4f}), dense Qwen3 {dense:.4f}"
    )
    assert hybrid <= dense < leaky


def test_packed_sliding_window_rows_stay_within_dense_packings_bf16_difference():
    """Each sliding layer gets its own document mask limited to the window; the full document mask
    alone lets its positions see past the window, which a document run alone does not."""
    sliding, unwindowed, dense = _packing_differences("sliding", "qwen3-8b")
    print(
        f"packed vs alone, later documents, every layer, bf16, Qwen3-8B width: window {WINDOW} on layers 2-3 "
        f"{sliding:.4f} (the full document mask alone: {unwindowed:.4f}), no window {dense:.4f}"
    )
    assert sliding <= 2 * dense < unwindowed
