"""Run a target only as deep as its deepest tapped layer.

The drafter is conditioned on the outputs of the tapped layers; only soft labels also read the
target's final hidden state. No tapped output depends on the layers past the deepest tap, so a
capture that does not need the final hidden state skips them: the default taps of Qwen3.6-27B
(``[1, 16, 31, 46, 61]`` of 64 layers) and of Qwen3-8B (``[1, 9, 17, 25, 33]`` of 36) leave the
last 2 layers unread.

Skipping holds for one call in one thread (a context variable): the skippable layers run as
usual everywhere else, so another thread decoding with the same model (acceptance measured
during training) runs every layer. A skipped layer returns the very output object of the deepest
tapped layer, tensor or tuple, which fits both calling conventions of Hugging Face decoder stacks
(``hidden_states = layer(...)`` and ``layer_outputs = layer(...)`` then ``layer_outputs[0]``);
the stack's final norm then runs on that state, and the result is not the final hidden state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch

#: Inside :func:`skipping`: a one-item list holding the deepest tapped layer's output once it ran.
_deepest_output: ContextVar[list | None] = ContextVar("dflash_deepest_tap_output", default=None)


def make_skippable(layers: Sequence[torch.nn.Module], deepest: int) -> bool:
    """Let :func:`skipping` skip ``layers[deepest + 1 :]`` (once per model: it wraps their
    ``forward`` and hooks ``layers[deepest]``).

    Args:
        layers: the decoder layers in the order the stack runs them.
        deepest (int): index of the deepest tapped layer.

    Returns:
        bool: whether any layer can be skipped (False when ``deepest`` is the last layer).
    """
    if deepest >= len(layers) - 1:
        return False
    layers[deepest].register_forward_hook(_keep_output)
    for layer in layers[deepest + 1 :]:
        layer.forward = _skippable(layer.forward)
    return True


@contextlib.contextmanager
def skipping() -> Iterator[None]:
    """In this thread, until exit, the layers :func:`make_skippable` prepared pass the deepest
    tapped layer's output through instead of running."""
    token = _deepest_output.set([None])
    try:
        yield
    finally:
        _deepest_output.reset(token)


def _keep_output(module, args, output) -> None:
    kept = _deepest_output.get()
    if kept is not None:
        kept[0] = output


def _skippable(forward):
    @functools.wraps(forward)
    def forward_unless_skipping(*args, **kwargs):
        kept = _deepest_output.get()
        if kept is None or kept[0] is None:
            return forward(*args, **kwargs)
        return kept[0]

    return forward_unless_skipping
