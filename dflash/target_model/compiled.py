"""The target's per-token work compiled as regions (``dflash train --compile``, on CUDA): each decoder
layer's two RMSNorms, its MLP and, in a Gated DeltaNet layer of a packed row, the projections
before its conv and the gated norm and output projection after its delta rule.

Why: at the user's shape the target's forward is half of a training step, and a quarter of that
forward was eager elementwise work (transformers' RMSNorm in six kernels, SwiGLU in three, casts);
an FP8 target spends more again quantizing each linear layer's input in separate kernels, once per
layer even where several layers read one input (q/k/v, gate/up, the four Gated DeltaNet input
projections), which made its forward slower than bf16's (``docs/results.md``). Compiled, each
region's elementwise work fuses into a few kernels and an input read by several FP8 layers is
quantized once (inductor fuses the quantization into the op before, and common subexpression
elimination keeps one copy).

What stays eager: the attention and the Gated DeltaNet kernels themselves (SDPA, flash-linear-
attention's conv and delta rule, which keep packed documents apart: :mod:`dflash.target_model.documents`)
and the attention layers' projections. Every region is a per-token function, so packing changes
nothing it computes: a document's states in a packed row stay as close to the document run alone
as the eager forward's (the packing bar, measured by ``benchmarks/target_profile.py``). Regional
compilation: one region per kind of work, shared by every layer, compiles once per input shape
(PyTorch's recipe: https://docs.pytorch.org/tutorials/recipes/regional_compilation.html), so the
compile does not grow with depth.

The regions run only inside :meth:`TargetRegions.active`, in the thread that entered it
(:class:`dflash.target_model.layer_skip.ForwardOverride`): another thread decoding with the same model
(regeneration, held-out acceptance), whose shapes change every step, runs the layers eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from dflash.compile_watch import CompiledRegion, raise_recompile_limit, recompile_limit_name
from dflash.target_model import documents
from dflash.target_model.layer_skip import ForwardOverride

logger = logging.getLogger(__name__)

#: The regions' modules run their region while the calling thread is inside :meth:`TargetRegions.active`.
_REGIONS = ForwardOverride("dflash_target_regions")
#: Graphs one region may compile: one per input shape (a short last batch, a dense and a packed
#: forward's hidden states) before dynamo falls back to eager.
RECOMPILE_LIMIT = 8


class TargetRegions:
    """Compiled regions of a target's decoder layers (module docstring); nothing compiles until
    the first forward inside :meth:`active`.

    Args:
        model: the target (a transformers causal LM whose decoder layers have ``input_layernorm``,
            ``post_attention_layernorm`` and ``mlp``: Qwen3, Qwen3.5/3.6, Llama, Mistral, ...).
        index (int): this target's number among the process's targets (each compiles its own code
            objects, :func:`dflash.compile_watch.fresh_function`).
        backend (str): the dynamo backend (inductor).
    """

    def __init__(self, model, index: int, backend: str = "inductor") -> None:
        self._by_function: dict = {}
        self._index, self._backend = index, backend
        self._warned: set[str] = set()
        kept = 0
        for layer in model.get_decoder().layers:
            for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
                module = getattr(layer, part, None)
                if not isinstance(module, torch.nn.Module):
                    continue
                if "forward" in vars(module):  # a forward of its own (accelerate's hooks): its class's would skip it
                    kept += 1
                    continue
                self._region(f"target {type(module).__name__}", type(module).forward)
                _REGIONS.install(module, _run_region)
        if kept:
            logger.info("target: %d norms and MLPs keep a forward of their own and run eagerly", kept)
        self.work = documents.PerTokenWork(
            inputs=self._region("target Gated DeltaNet inputs", documents.gated_deltanet_inputs),
            output=self._region("target Gated DeltaNet output", documents.gated_deltanet_output),
        )

    def _region(self, name: str, function) -> CompiledRegion:
        if function not in self._by_function:
            self._by_function[function] = CompiledRegion(name, function, self._index, self._backend)
        return self._by_function[function]

    @property
    def regions(self) -> list[CompiledRegion]:
        return list(self._by_function.values())

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """In this thread, until exit, the layers' norms and MLPs run compiled; pass :attr:`work`
        to :func:`dflash.target_model.documents.linear_layers_apart` for the Gated DeltaNet layers. A
        region that ran eagerly (dynamo gave up on it) or in pieces (graph breaks, eager code
        between them) is logged once."""
        raise_recompile_limit(RECOMPILE_LIMIT)
        with _REGIONS.active(self):
            yield
        for region in self.regions:
            if region.name not in self._warned and (problem := _what_went_wrong(region)):
                self._warned.add(region.name)
                logger.warning("%s: %s; the target's forward is slower, not different", region.name, problem)

    def run(self, module: torch.nn.Module, *args, **kwargs):
        return self._by_function[type(module).forward](module, *args, **kwargs)


def _run_region(module, regions: TargetRegions, own_forward, *args, **kwargs):
    return regions.run(module, *args, **kwargs)


def _what_went_wrong(region: CompiledRegion) -> str | None:
    """Why ``region`` did not run as one compiled graph per call in this thread, or None."""
    compiles, runs, calls = region.counts()
    if runs < calls:
        limit = getattr(torch._dynamo.config, recompile_limit_name())
        return (
            f"{calls - runs} of its {calls} calls in this thread ran eagerly, not compiled (dynamo gave up on it: "
            f"the recompile limit {limit}, or code it cannot compile)"
        )
    if runs > calls:
        pieces = f"{runs / calls:.1f} graphs a call"
        return f"it ran as {pieces}, eager code between them (graph breaks: TORCH_LOGS=graph_breaks)"
    return None
