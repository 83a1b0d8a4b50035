"""Putting a hybrid target's cache back to the last accepted token after a rejected draft.

Greedy verification (:func:`dflash.evaluation.decoding.speculative_generate`) runs the target over a whole
draft block and keeps only the tokens up to the first rejection. Attention layers keep a KV cache,
which is cropped. Linear-attention layers (Qwen3.5 / Qwen3.6 Gated DeltaNet) keep a recurrent state
and a conv window instead, summaries of every token they saw, which cannot be cropped: after a
rejection they must be put back to the state after the last kept token (vLLM and SGLang do the
same for Mamba-style layers).

:class:`StateRollback` snapshots those states before verification and, after a rejection, restores
them and advances them by the kept tokens, in one of two ways (:data:`STRATEGIES`):

- ``mixers``: re-run only the linear-attention token mixers, each on its own input hidden states
  of the kept tokens, recorded during verification (causal: they equal what a forward of the kept
  tokens alone would feed it). Reads the mixer weights only (a quarter of Qwen3.6-27B's).
- ``forward``: re-run the kept tokens through the whole target (KV cropped to before the block).

Reads transformers 5.x's cache layout: ``cache.layers[i].conv_states`` / ``recurrent_states``, a
tensor each (5.7-5.14) or a dict of them by state index (5.15-5.25); from 5.25 a linear-attention
layer also counts its tokens (``cumulative_length_linear``, which ``cache.get_seq_length()`` reads
when layer 0 is linear, and so the positions of the next forward), saved and restored with the
states. Older releases verify a block from a zero state, newer ones may lay the cache out otherwise
(:data:`dflash.target_model.files.TRANSFORMERS_FOR_DECODING`; ``dflash eval`` refuses both before loading).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dflash.target_model.documents import linear_layers
from dflash.target_model.files import decoding_transformers_range

#: How a rejected block's linear-attention states are advanced by the kept tokens (module docstring).
STRATEGIES = ("mixers", "forward")


def new_cache(target):
    """An empty decoding cache for ``target``: a hybrid target's is built from its config, which gives
    its linear-attention layers their state slots; a standard target's is a bare ``DynamicCache()``
    (built from the config, a sliding-window target's layers refuse to be cropped)."""
    from transformers import DynamicCache

    return DynamicCache(config=target.config) if linear_layers(target.model) else DynamicCache()


def crop(cache, keep: int, *, skip: frozenset[int] = frozenset()) -> None:
    """Drop every cached token past the first ``keep`` of the attention layers of ``cache``; layers
    in ``skip`` (linear attention) have no tokens to drop. Each layer's own length decides: the
    cache's length is layer 0's, a linear-attention count on a hybrid target (transformers 5.25)."""
    if not skip:
        remove = cache.get_seq_length() - keep
        if remove > 0:
            cache.crop(-remove)  # DynamicCache.crop(-n) drops the last n tokens in transformers 4.x and 5.x
        return
    for index, layer in enumerate(cache.layers):
        remove = 0 if index in skip else layer.get_seq_length() - keep
        if remove > 0:
            layer.crop(-remove)


class StateRollback:
    """Snapshot and restore of a hybrid target's linear-attention states around verification.

    Args:
        target (dflash.target_model.model.Target): a target with linear-attention layers.
        cache: its decoding cache (:func:`new_cache`), already past the prompt.
        strategy (str): one of :data:`STRATEGIES`.

    Raises:
        ValueError: an unknown strategy.
    """

    def __init__(self, target, cache, strategy: str = "mixers"):
        if strategy not in STRATEGIES:
            raise ValueError(f"rollback strategy {strategy!r}: use one of {STRATEGIES}")
        self.target, self.cache, self.strategy = target, cache, strategy
        self.mixers = linear_layers(target.model)
        self._saved: dict[int, tuple[torch.Tensor, ...]] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    @classmethod
    def for_target(cls, target, cache, strategy: str = "mixers") -> StateRollback | None:
        """A rollback for ``target`` when it has linear-attention layers, else None (KV crop suffices)."""
        return cls(target, cache, strategy) if linear_layers(target.model) else None

    @property
    def linear_layers(self) -> frozenset[int]:
        """Indices of the cache layers that hold linear-attention states."""
        return frozenset(self.mixers)

    @contextlib.contextmanager
    def verifying(self) -> Iterator[None]:
        """Wrap the verification forward: snapshot the states first, record the mixers' inputs."""
        self._saved = {i: tuple(state.clone() for state in self._states(i)) for i in self.mixers}
        hooks = [
            mixer.register_forward_pre_hook(self._recorder(i), with_kwargs=True) for i, mixer in self.mixers.items()
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def keep(self, kept_ids: torch.Tensor, verified: int) -> None:
        """After :meth:`verifying` a block from ``verified`` cached tokens, keep only its first n
        tokens ``kept_ids`` (int64 ``[1, n]``): attention layers cropped to ``verified + n``,
        linear-attention layers put at their state after those n tokens (as they are when the
        whole block is kept)."""
        kept = kept_ids.shape[1]
        if kept == next(iter(self._inputs.values())).shape[1]:
            return
        for index, saved in self._saved.items():
            for now, then in zip(self._states(index), saved):
                now.copy_(then)
        if self.strategy == "forward":
            crop(self.cache, verified, skip=self.linear_layers)
            self.target.decoder_forward(kept_ids, past_key_values=self.cache)
            return
        crop(self.cache, verified + kept, skip=self.linear_layers)
        with torch.no_grad():
            for index, mixer in self.mixers.items():
                mixer(self._inputs[index][:, :kept], self.cache)

    def _states(self, index: int) -> tuple[torch.Tensor, ...]:
        """The tensors a linear-attention layer's place in the sequence lives in: its conv window and
        recurrent state, and from transformers 5.25 its token count (restored in place, so a
        ``mark_static_address`` on them holds)."""
        layer = self.cache.layers[index]
        states = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
        states = tuple(state[0] if isinstance(state, dict) else state for state in states)
        if not all(isinstance(state, torch.Tensor) for state in states):
            raise RuntimeError(
                f"cache layer {index} ({type(layer).__name__}) holds no conv and recurrent state tensors after the "
                "prompt: this transformers release lays its cache out otherwise; dflash eval reads the layouts of "
                f"transformers {decoding_transformers_range()}"
            )
        length = getattr(layer, "cumulative_length_linear", None)
        return (*states, length) if isinstance(length, torch.Tensor) else states

    def _recorder(self, index: int):
        def record(module, args, kwargs):
            self._inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return record
