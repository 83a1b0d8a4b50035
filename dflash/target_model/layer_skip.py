"""Run a target only as deep as its deepest tapped layer, through a module's ``forward`` replaced
for the calls of one thread, inside one block (:class:`ForwardOverride`, which the packed rows of
:mod:`dflash.target_model.documents` use too).

The drafter is conditioned on the outputs of the tapped layers; only soft labels also read the
target's final hidden state. No tapped output depends on the layers past the deepest tap, so a
capture that does not need the final hidden state skips them: the default taps of Qwen3.6-27B
(``[1, 16, 31, 46, 61]`` of 64 layers) and of Qwen3-8B (``[1, 9, 17, 25, 33]`` of 36) leave the
last 2 layers unread.

Skipping holds inside :meth:`LayerSkip.skipping`, in the thread that entered it
(:class:`ForwardOverride`): the same layers run as usual everywhere else,
so another thread decoding with the same model (acceptance measured during training) runs every
layer, and two :class:`LayerSkip` on one model (targets tapping different layers) compose. A
skipped layer returns the very output object of the deepest tapped layer, tensor or tuple, which
fits both calling conventions of Hugging Face decoder stacks (``hidden_states = layer(...)`` and
``layer_outputs = layer(...)`` then ``layer_outputs[0]``); the stack's final norm then runs on
that state, so the stack's final hidden state is not the model's.

:class:`ForwardOverride`: the trainer changes how some target layers run while it captures states
(packed rows: :mod:`dflash.target_model.documents`; stopping at the deepest tap: :class:`LayerSkip`), while
another thread may use the same model unchanged (decoding, regeneration, an acceptance check).
Swapping ``forward`` for the block would change it for every thread; here a module's forward is
wrapped once, and the wrapper runs the replacement only while the calling thread is inside
:meth:`ForwardOverride.active`. The state is a context variable that also holds the thread that
set it, since a thread can inherit its parent's context (Python 3.14's
``sys.flags.thread_inherit_context``). The per-call cost is one ``ContextVar.get``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import torch

#: ``replacement(module, value, own_forward, *args, **kwargs)``: the forward while active.
Replacement = Callable[..., Any]


class ForwardOverride:
    """Routes the forward of the modules :meth:`install` wrapped to a replacement, in the thread
    inside :meth:`active` only.

    Args:
        name (str): the context variable's name (debugging).
    """

    def __init__(self, name: str):
        self._state: ContextVar[tuple[int, Any] | None] = ContextVar(name, default=None)

    def install(self, module: torch.nn.Module, replacement: Replacement) -> None:
        """Wrap ``module.forward`` (whatever it is: the class's, or one accelerate put on the
        instance) so that calls inside :meth:`active` run ``replacement``. Once per module and
        override; another override wraps on top and composes."""
        own = module.forward
        if getattr(own, "dflash_override", None) is self:
            return

        @functools.wraps(own)
        def forward(*args, **kwargs):
            value = self.value()
            return own(*args, **kwargs) if value is None else replacement(module, value, own, *args, **kwargs)

        forward.dflash_override = self
        module.forward = forward

    @contextlib.contextmanager
    def active(self, value: Any) -> Iterator[None]:
        """In this thread, until exit, the wrapped modules run their replacement with ``value``
        (not None)."""
        token = self._state.set((threading.get_ident(), value))
        try:
            yield
        finally:
            self._state.reset(token)

    def value(self) -> Any:
        """The value of the calling thread's :meth:`active` block; None outside one."""
        state = self._state.get()
        return state[1] if state is not None and state[0] == threading.get_ident() else None


class LayerSkip:
    """The decoder layers past the deepest tap, made skippable: their ``forward`` is wrapped and
    the deepest tapped layer hooked, once, when this is built (before threads share the model).

    A forward inside :meth:`skipping` must not use a KV cache: the skipped layers' caches stay
    empty. The wrappers hold the layers' bound ``forward``; a copied model keeps calling the
    original's.

    Args:
        layers: the decoder layers in the order the stack runs them (tensor or tuple outputs).
        deepest (int): index of the deepest tapped layer, below ``len(layers) - 1``.

    Raises:
        ValueError: ``deepest`` leaves no layer to skip (use :meth:`past`).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], deepest: int):
        if not 0 <= deepest < len(layers) - 1:
            raise ValueError(f"deepest tapped layer {deepest} of {len(layers)}: no layer after it to skip")
        self._override = ForwardOverride(f"dflash_layer_skip_{id(self)}")
        layers[deepest].register_forward_hook(self._keep)
        for layer in layers[deepest + 1 :]:
            self._override.install(layer, _pass_kept_output)

    @classmethod
    def past(cls, layers: Sequence[torch.nn.Module], deepest: int) -> LayerSkip | None:
        """A :class:`LayerSkip` of the layers after ``deepest``; None when it is the last layer."""
        return cls(layers, deepest) if deepest < len(layers) - 1 else None

    def skipping(self) -> AbstractContextManager[None]:
        """In this thread, until exit, the skippable layers pass the deepest tapped layer's output
        through instead of running."""
        return self._override.active([None])

    def _keep(self, module, args, output) -> None:
        slot = self._override.value()
        if slot is not None:
            slot[0] = output


def _pass_kept_output(layer, slot: list, own_forward, *args, **kwargs):
    return own_forward(*args, **kwargs) if slot[0] is None else slot[0]
