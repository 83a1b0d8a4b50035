"""What torch.compile did: compiles, recompiles, graph breaks and eager fallbacks, per thread.

Silently running a compiled function eagerly is the failure this project exists to prevent, so
every compiled call the trainer, the bug-class checks and the stress suite make goes through
:class:`CountingBackend`, which counts per thread how often it compiled and how often one of its
compiled graphs ran: a call that ran no graph fell back to eager. :class:`CompiledRegion` is one
compiled function with its own counts; :class:`StepWatch` turns a step's regions' counts into log
lines for a training step, with the last dynamo warning of the thread as the
reason (dynamo logs why it gave up, e.g. the recompile limit, just before it falls back).

Also here: :func:`fresh_function` (a copy of a function with its own code object, so dynamo gives
it its own cache and recompile limit) and the recompile-limit helpers (the config field was
renamed from ``cache_size_limit`` to ``recompile_limit`` in torch 2.7; 2.12+ makes a plain
assignment on one thread invisible to the others unless the project's patches are active).

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CountingBackend:
    """A dynamo backend wrapping ``inner`` (a registered backend name) that counts, per thread,
    compiles and compiled-graph runs, and counts graphs that came out dynamic (any symbolic input
    size), for every thread together.

    Args:
        inner (str): the backend that really compiles: ``eager``, ``aot_eager`` (traces with
            make_fx, i.e. through FX, cheaply) or ``inductor``.
    """

    def __init__(self, inner: str = "inductor") -> None:
        self.inner = inner
        self.dynamic_graphs = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self._local.compiles = self.compiles() + 1
        if not is_static(gm):
            with self._lock:
                self.dynamic_graphs += 1
        compiled = torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self._local.runs = self.runs() + 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # dynamo passes boxed args through
        return run

    def compiles(self) -> int:
        """Graphs compiled so far on the calling thread."""
        return getattr(self._local, "compiles", 0)

    def runs(self) -> int:
        """Compiled-graph runs so far on the calling thread."""
        return getattr(self._local, "runs", 0)


def is_static(gm: torch.fx.GraphModule) -> bool:
    """True when no graph input is a SymInt or has a symbolic size."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            return False
        if isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape):
            return False
    return True


def fresh_function(template: Callable, index: int) -> Callable:
    """A copy of ``template`` with its own code object (named ``<name>_<index>``): dynamo caches
    compiled code and counts recompiles per code object, so each copy compiles on its own."""
    code = template.__code__.replace(co_name=f"{template.__name__}_{index}")
    fresh = types.FunctionType(code, template.__globals__, code.co_name, template.__defaults__, template.__closure__)
    fresh.__kwdefaults__ = template.__kwdefaults__
    return fresh


class DynamoWarnings(logging.Handler):
    """Keeps the last ``torch._dynamo`` warning per thread (e.g. the recompile-limit message that
    precedes an eager fallback), to report with that thread's fallback. A context manager that
    attaches itself to the ``torch._dynamo`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.last[record.threadName] = record.getMessage().strip().splitlines()[0][:300]

    def last_for(self, thread_name: str) -> str:
        return self.last.get(thread_name, "none")

    def __enter__(self) -> DynamoWarnings:
        logging.getLogger("torch._dynamo").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("torch._dynamo").removeHandler(self)


def recompile_limit_name() -> str:
    """``recompile_limit``, or ``cache_size_limit`` before torch 2.7 renamed it."""
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


def raise_recompile_limit(limit: int) -> None:
    """Set dynamo's recompile limit to at least ``limit`` *as the calling thread sees it*: on
    torch 2.12+ without the patches, a plain assignment on the main thread is invisible to
    worker threads (bug class F), so each compiling thread calls this itself."""
    import torch._dynamo.config as dynamo_config

    name = recompile_limit_name()
    if getattr(dynamo_config, name) < limit:
        setattr(dynamo_config, name, limit)


def graph_break_count() -> int:
    """Graph breaks dynamo has counted in this process (all threads)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class CompiledRegion:
    """A function compiled on a code object of its own (:func:`fresh_function`) with
    ``dynamic=False`` through a :class:`CountingBackend`, counting its calls per thread: the unit
    :class:`StepWatch` checks. A call after which fewer of its graphs ran than it was called fell
    back to eager somewhere.

    Args:
        name (str): the region's name in log lines (``decoder layer``).
        function: what is compiled; called with the region's arguments.
        index (int): suffix of the copy's code-object name, one per compiling replica.
        backend (str): the backend that really compiles (:class:`CountingBackend`).
    """

    def __init__(self, name: str, function: Callable, index: int, backend: str = "inductor") -> None:
        self.name = name
        self.backend = CountingBackend(backend)
        self._compiled = torch.compile(fresh_function(function, index), backend=self.backend, dynamic=False)
        self._local = threading.local()

    def __call__(self, *args, **kwargs):
        self._local.calls = self.calls() + 1
        return self._compiled(*args, **kwargs)

    def calls(self) -> int:
        """Calls so far on the calling thread."""
        return getattr(self._local, "calls", 0)

    def counts(self) -> tuple[int, int, int]:
        """(compiles, graph runs, calls) so far on the calling thread."""
        return self.backend.compiles(), self.backend.runs(), self.calls()


class StepWatch:
    """Per-thread compile accounting of one training step's compiled regions.

    Call :meth:`before` just before a step on this thread and :meth:`after` right after it, with
    the shape key the step was compiled for (its sequence length). Logged as warnings, and
    counted: a recompile for a shape this thread compiled before (a guard failure), a step in
    which a region's graphs ran fewer times than the region was called (an eager fallback, with
    dynamo's last warning in this thread), new graph breaks. A first compile per shape is logged
    at INFO. A no-op without regions (an eager step).

    Args:
        name (str): the thread's name in log lines (``drafter cuda:1``).
        regions (list[CompiledRegion]): the step's compiled regions (empty: eager).
        warnings (DynamoWarnings | None): where the thread's last dynamo warning is read.
    """

    def __init__(self, name: str, regions: list[CompiledRegion], warnings: DynamoWarnings | None = None) -> None:
        self.name, self.regions, self.warnings = name, list(regions), warnings
        self.compiles = self.unexpected_recompiles = self.eager_fallbacks = self.graph_breaks = 0
        self._shapes: set = set()
        self._before: list[tuple[int, int, int]] = []
        self._breaks = 0

    @property
    def enabled(self) -> bool:
        return bool(self.regions)

    def before(self) -> None:
        if self.enabled:
            self._before = [region.counts() for region in self.regions]
            self._breaks = graph_break_count()

    @contextlib.contextmanager
    def watching(self, step: int, shape):
        """:meth:`before` and :meth:`after` around a drafter step of ``shape`` in ``step``, also one that
        raises (an out-of-memory error the first step retries with fewer rows,
        :mod:`dflash.train.drafter_rows`): its compiles and graph breaks count; its calls that ran
        no graph do not count as an eager fallback, as the call that raised did not finish."""
        self.before()
        try:
            yield
        except BaseException:
            self.after(step, shape, finished=False)
            raise
        self.after(step, shape)

    def after(self, step: int, shape, *, finished: bool = True) -> None:
        if not self.enabled:
            return
        deltas = [
            tuple(now - then for now, then in zip(region.counts(), before, strict=True))
            for region, before in zip(self.regions, self._before, strict=True)  # before() was called
        ]
        compiles = sum(d[0] for d in deltas)
        breaks = graph_break_count() - self._breaks
        reason = self.warnings.last_for(threading.current_thread().name) if self.warnings else "none"
        self.compiles += compiles
        if compiles and shape in self._shapes:
            self.unexpected_recompiles += compiles
            logger.warning(
                "%s step %d: RECOMPILED the drafter step for shape %s, which it had compiled before "
                "(guard failure; last dynamo warning in this thread: %s)",
                self.name, step, shape, reason,
            )  # fmt: skip
        elif compiles:
            logger.info(
                "%s step %d: compiled the drafter step for shape %s (%d graph(s))", self.name, step, shape, compiles
            )
        self._shapes.add(shape)
        eager = [
            f"{region.name} {calls - runs} of {calls}"
            for region, (_, runs, calls) in zip(self.regions, deltas)
            if runs < calls
        ]
        if eager and finished:
            self.eager_fallbacks += 1
            logger.warning(
                "%s step %d: the compiled drafter step ran EAGERLY (calls that ran no compiled graph: %s); "
                "last dynamo warning in this thread: %s",
                self.name, step, ", ".join(eager), reason,
            )  # fmt: skip
        if breaks and compiles:
            # Counted process-wide: with several threads compiling at once, a break may be another's.
            self.graph_breaks += breaks
            logger.warning(
                "%s step %d: %d graph break(s) while compiling the drafter step: part of it runs eagerly",
                self.name, step, breaks,
            )  # fmt: skip

    def summary(self) -> dict[str, int]:
        return {
            "compiles": self.compiles,
            "unexpected_recompiles": self.unexpected_recompiles,
            "eager_fallbacks": self.eager_fallbacks,
            "graph_breaks": self.graph_breaks,
        }

    def healthy(self) -> bool:
        return not (self.unexpected_recompiles or self.eager_fallbacks or self.graph_breaks)
