"""A module's ``forward`` replaced for the calls of one thread, inside one block.

The trainer changes how some target layers run while it captures states (packed rows:
:mod:`dflash.document_separation`; stopping at the deepest tap: :mod:`dflash.early_exit`), while
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
from collections.abc import Callable, Iterator
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
