"""What of the drafter step ``torch.compile`` compiles: one decoder layer, one loss chunk and
DFlash2's selector loss, each reused for all (regional compilation), or the whole step
(``--compile-scope``).

``regional`` (the default): the decoder layer's forward, one loss chunk
(:func:`dflash.train.loss.chunk_loss`) and DFlash2's selector loss
(:func:`dflash.train.selector_loss.selector_loss`) are compiled as regions of their own; every
layer and every chunk calls them, so each compiles once per kind of call (:data:`GRAPHS_PER_SHAPE`)
however many layers and chunks there are. What stays eager is the glue around them: the
draft-token embedding, the drafter's input projection, norms and rotary tables, label building,
and the chunks' sums; elementwise work over the step's tokens next to the regions' matmuls and
attention. On one H100 with the user's drafter (5 layers at the Qwen3.6-27B width, 2 rows x 512
anchors, ``docs/results.md`` 2026-12-05) the first step came 84 s after the drafter was built
regional and 246 s as one graph, cold; the drafter step then took 24 ms (5%) longer regional, 14 ms
of which were the loss chunks' gradients gathered by one full-size add per chunk, eager between
the regions (gathered in one ``cat`` since). At the user's full shape on an H200 (4 rows, e5ac64f)
the regional step ran at 58.0% MFU, against 56.8% for the one graph 129 commits earlier.

``step``: :func:`~dflash.train.step.drafter_forward_loss` is one dynamo graph. Dynamo unrolls every
decoder layer and every chunk of the LM head + loss into it, and inductor lowers each copy, so the
first step's compile grows with layers x chunks: at the user's shape (4 rows x 512 anchors per
micro-batch, 16 blocks per chunk) that is 5 layers and 128 chunks, minutes.

PyTorch's recipe for this: https://docs.pytorch.org/tutorials/recipes/regional_compilation.html.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

from dflash.choices import check_choice
from dflash.compile_watch import CompiledRegion
from dflash.config import CompileScope
from dflash.drafter.modeling_dflash import DFlashDecoderLayer
from dflash.train.loss import chunk_loss
from dflash.train.selector_loss import selector_loss
from dflash.train.step import drafter_forward_loss

#: The most graphs one region compiles per sequence length (dynamo's recompile limit counts per
#: code object): the decoder layer's, one per layer type (flex_attention's full and sliding masks
#: differ in mask_mod) and one more for the first layer, whose input (the frozen embedding) needs
#: no gradient; the loss chunk's at most 2 (whole chunks and a shorter last one, the same for every
#: length: its shape is the anchors').
GRAPHS_PER_SHAPE = 3


class RegionalStep:
    """:func:`~dflash.train.step.drafter_forward_loss` with the drafter's decoder layers and the
    loss chunks running compiled regions (module docstring); called exactly like it.

    The layers' compiled forward is installed on the drafter's layers for the step's forward only
    (backward never calls ``forward``) and removed after it, exceptions included, so outside a
    step the model is the plain module that is saved, copied and exported. A replica's model is
    used by one thread at a time: its drafter thread during a step (the main thread waits for
    every drafter thread's report before it touches a replica).

    Args:
        index (int): the replica's index (each replica compiles its own code objects).
        backend (str): the dynamo backend (``inductor``).
    """

    def __init__(self, index: int, backend: str) -> None:
        self.layer = CompiledRegion("decoder layer", DFlashDecoderLayer.forward, index, backend)
        self.chunk = CompiledRegion("loss chunk", chunk_loss, index, backend)
        self.selector = CompiledRegion("selector loss", selector_loss, index, backend)

    @property
    def regions(self) -> list[CompiledRegion]:
        return [self.layer, self.chunk, self.selector]

    def __call__(self, drafter, *args, **kwargs):
        with self._compiled_layers(drafter):
            return drafter_forward_loss(drafter, *args, chunk_fn=self.chunk, selector_fn=self.selector, **kwargs)

    @contextmanager
    def _compiled_layers(self, drafter):
        layers = list(drafter.layers)
        for layer in layers:
            # The region compiled DFlashDecoderLayer.forward: a layer of another class, or one
            # whose forward is already replaced, must not silently run it (or lose its own).
            if type(layer).forward is not DFlashDecoderLayer.forward or "forward" in vars(layer):
                raise TypeError(f"{type(layer).__name__} is not a plain DFlashDecoderLayer: no regional compile")
        for layer in layers:
            layer.forward = types.MethodType(self.layer, layer)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward


def compile_step(scope: CompileScope, index: int, backend: str):
    """Replica ``index``'s compiled step function and the regions its :class:`StepWatch` checks.

    Args:
        scope (CompileScope): ``step`` or ``regional``.

    Returns:
        (step_fn, list[CompiledRegion]): ``step_fn`` is called like ``drafter_forward_loss``.

    Raises:
        ValueError: an unknown scope.
    """
    check_choice("compile_scope", scope, CompileScope)
    if scope == "step":
        region = CompiledRegion("drafter step", drafter_forward_loss, index, backend)
        return region, [region]
    step = RegionalStep(index, backend)
    return step, step.regions
