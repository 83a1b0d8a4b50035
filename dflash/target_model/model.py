"""The frozen target (verifier): load a local Hugging Face causal LM and capture the
hidden states the drafter is conditioned on.

Layer id ``k`` means the OUTPUT of decoder layer ``k``, i.e. ``hidden_states[k + 1]`` of a
Hugging Face forward with ``output_hidden_states=True`` (index 0 is the embedding output),
as in z-lab/dflash ``extract_context_feature``. Off by one here trains a drafter that
reaches good training accuracy and accepts nothing at serving time. NOTE: HF returns the
final-norm output as ``hidden_states[L]``, so id ``L - 1`` gets the normed state; the
default ids never pick it (``docs/dflash.md``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash import masks
from dflash.devices import compute_dtype
from dflash.target_model import documents
from dflash.target_model.compiled import TargetRegions
from dflash.target_model.files import TargetLoadError, read_target_config, require_transformers_for
from dflash.target_model.layer_skip import LayerSkip
from dflash.target_model.taps import check_taps

logger = logging.getLogger(__name__)


@dataclass
class TargetStates:
    """Target hidden states for a batch (no grad).

    Args:
        context (torch.Tensor): ``[B, S, K*H]`` the tapped layer outputs concatenated on the
            feature dim in ``layer_ids`` order; bf16 on GPU, fp32 on CPU.
        last_hidden (torch.Tensor, optional): ``[B, S, H]`` final-norm hidden state (input of
            the LM head), for soft labels; None when the capture skipped the layers past the
            deepest tap (:mod:`dflash.target_model.layer_skip`).
    """

    context: torch.Tensor
    last_hidden: torch.Tensor | None


class Target:
    """A frozen HF causal LM plus the layer ids to tap.

    Args:
        model: a ``PreTrainedModel`` with ``get_decoder()``, ``get_input_embeddings()`` and
            ``get_output_embeddings()`` (Qwen3, Llama, Mistral, ... all have them).
        layer_ids (list[int]): decoder layers to tap, each in ``[0, num_layers)``.
        linear_kernels (LinearAttentionKernels, optional): what packed rows run linear-attention
            layers on (:mod:`dflash.target_model.documents`); None: the device's default
            (:func:`dflash.target_model.documents.kernels_for`).

    Raises:
        ValueError: a layer id out of range.
    """

    def __init__(self, model, layer_ids: list[int], *, linear_kernels: documents.LinearAttentionKernels | None = None):
        self.model = model.eval().requires_grad_(False)
        self._chosen_kernels = linear_kernels
        self.config = model.config
        self.layer_ids = list(layer_ids)
        bad = [k for k in self.layer_ids if not 0 <= k < self.num_layers]
        if bad or not self.layer_ids:
            raise ValueError(
                f"target_layer_ids {self.layer_ids}: each id must be in [0, {self.num_layers}) "
                f"for a target with {self.num_layers} decoder layers"
            )
        self._layer_skip = self._skip_past_taps()
        self._regions: TargetRegions | None = None

    def compile_regions(self, index: int, backend: str = "inductor") -> list:
        """From now on, :meth:`capture` runs the per-token work of the decoder layers compiled
        (:mod:`dflash.target_model.compiled`); ``index`` numbers this target among the process's. Returns
        the regions (:class:`dflash.compile_watch.CompiledRegion`), whose per-thread counts tests and
        benchmarks read; the trainer's are checked by the regions themselves."""
        self._regions = TargetRegions(self.model, index, backend)
        return self._regions.regions

    def _skip_past_taps(self) -> LayerSkip | None:
        layers = getattr(self.model.get_decoder(), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != self.num_layers:
            logger.info("target %s: no decoder layer list, every capture runs all layers", type(self.model).__name__)
            return None
        return LayerSkip.past(layers, max(self.layer_ids))

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """The target's token embedding (frozen; shared with the drafter)."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        """The target's LM head (frozen; shared with the drafter)."""
        return self.model.get_output_embeddings()

    def decoder_forward(self, input_ids: torch.Tensor, *, past_key_values=None, position_ids=None, attention_mask=None):
        """One forward of the decoder stack with all hidden states (no LM head: callers
        project only the positions they need). Returns the HF output."""
        decoder = self.model.get_decoder()
        with torch.no_grad():
            return decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=past_key_values is not None,
                output_hidden_states=True,
                **{self._cache_arg: past_key_values},
            )

    @functools.cached_property
    def _cache_arg(self) -> str:
        # transformers 5.x renames `past_key_values` to `cache` (the old name warns, then goes).
        params = inspect.signature(self.model.get_decoder().forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def select(self, hidden_states) -> torch.Tensor:
        """Concatenate ``hidden_states[k + 1]`` for k in ``layer_ids``: ``[B, S, K*H]``."""
        return torch.cat([hidden_states[k + 1] for k in self.layer_ids], dim=-1)

    def capture(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        *,
        last_hidden: bool = True,
    ) -> TargetStates:
        """Target hidden states of a right-padded batch.

        Without ``document_ids`` no attention mask is passed: with right padding and causal
        attention (and causal linear attention) the real tokens never see the padding, and the
        unmasked call keeps SDPA on its causal fast path. With ``document_ids`` (packed rows,
        :mod:`dflash.data.packing`) every layer keeps each conversation to itself, so its states equal
        those of the conversation run alone: attention layers through a document-causal mask in the
        form of the model's attention backend, linear-attention layers (Qwen3.5 / Qwen3.6 Gated
        DeltaNet) with their conv and recurrence restarted at each conversation
        (:mod:`dflash.target_model.documents` says how, and what it costs).

        Args:
            input_ids (torch.Tensor): int64 ``[B, S]``.
            position_ids (torch.Tensor, optional): int64 ``[B, S]``, positions restarting at 0 in
                each document (:class:`dflash.data.batches.Batch`); None: ``0..S-1`` (or, with
                ``document_ids``, the position within each document).
            document_ids (torch.Tensor, optional): int ``[B, S]``, documents as maximal runs of
                equal ids (-1 on padding); None: one conversation per row. Host tensors spare
                device syncs.
            last_hidden (bool): also return the final hidden state; False skips the layers past
                the deepest tap (:mod:`dflash.target_model.layer_skip`), which change no tapped state.

        Returns:
            TargetStates: ``context [B, S, K*H]`` and ``last_hidden [B, S, H]`` (None without
            ``last_hidden``).

        Raises:
            ValueError: ``document_ids`` with an attention backend that takes no document mask.
            UnknownLayerType: ``document_ids`` for a target with a layer type packing cannot keep
                apart (:func:`dflash.target_model.files.check_packable`).
        """
        input_ids = input_ids.to(self.device)
        attention_mask, apart = None, contextlib.nullcontext()
        regions = self._regions
        if document_ids is not None:
            # Linear layers always take the segmented route, one set of kernels for every batch
            # (a batch of one-document rows would otherwise compile and autotune transformers'
            # own path too: a 60 s stall measured at the 64-layer shape); attention layers need
            # the mask only where a row holds several documents (else SDPA's causal fast path).
            if self._linear_mixers:
                width = self.config.get_text_config().linear_conv_kernel_dim
                segments = documents.Segments.of(document_ids, self.device, conv_width=width)
                work = regions.work if regions is not None else documents.EAGER
                apart = documents.linear_layers_apart(segments, self._linear_kernels, work)
            several = bool(document_ids.max() > 0)
            document_ids = document_ids.to(self.device)
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=self.device) - masks.document_starts(
                    document_ids
                )
            if several:
                attention_mask = documents.attention_masks(document_ids, self.config.get_text_config(), self.dtype)
        if position_ids is not None:
            position_ids = position_ids.to(self.device)
        skip = self._layer_skip
        shallow = skip.skipping() if skip and not last_hidden else contextlib.nullcontext()
        compiled = regions.active() if regions is not None else contextlib.nullcontext()
        with compiled, apart, shallow:
            out = self.decoder_forward(input_ids, position_ids=position_ids, attention_mask=attention_mask)
        return TargetStates(self.select(out.hidden_states), out.hidden_states[-1] if last_hidden else None)

    @functools.cached_property
    def _linear_mixers(self) -> dict[int, torch.nn.Module]:
        mixers = documents.linear_layers(self.model)
        documents.install_segmented_forward(mixers.values())
        return mixers

    @functools.cached_property
    def _linear_kernels(self) -> documents.LinearAttentionKernels:
        kernels = self._chosen_kernels if self._chosen_kernels is not None else documents.kernels_for(self.device)
        logger.info("packed rows: %d linear-attention layers run on %s", len(self._linear_mixers), kernels.name)
        return kernels


def load_target(
    path: str | Path,
    *,
    layer_ids: list[int] | None = None,
    num_capture_layers: int = 5,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    random_missing: bool = False,
) -> Target:
    """Load a local HF causal-LM directory as a frozen target.

    Args:
        path: directory with ``config.json`` and weights (``*.safetensors``/``*.bin``).
        layer_ids: layers to tap; None uses the DFlash default for ``num_capture_layers``.
        device: where to put it (already resolved, see :func:`resolve_device`).
        dtype: None picks :func:`dflash.devices.compute_dtype` (bf16 on GPU, fp32 on CPU).
        random_missing: keep the random initialisation ``from_pretrained`` gives weights the files
            lack (a benchmark of a model's shape) instead of refusing the target.

    Raises:
        TargetLoadError: missing directory, no ``config.json``, a config/weights that
            ``AutoModelForCausalLM`` cannot load, or (without ``random_missing``) weight files that
            lack some of the model's weights, e.g. under other key names (the message names the
            path, the weights and the fix).
        ValueError: the layers to tap do not fit the target (see :func:`dflash.target_model.taps.check_taps`).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    require_transformers_for(read_target_config(path), path / "config.json")
    device = torch.device(device)
    if dtype is None:
        dtype = compute_dtype(device)
    # Straight onto the GPU: no host copy of the weights (and any weight the files lack is
    # initialised there). device_map needs accelerate; without it the model moves after loading.
    direct = device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            path,
            config=_causal_lm_config(path),
            dtype=dtype,
            local_files_only=True,
            device_map=str(device) if direct else None,
            output_loading_info=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise TargetLoadError(
            f"target {path}: cannot load as a causal LM ({type(e).__name__}: {e}); "
            "check config.json and that the weight files are complete"
        ) from e
    if random_missing:
        _warn_of_random_weights(path, loading)
    else:
        _refuse_missing_weights(path, loading)
    if not direct:
        model.to(device)
    layer_ids = check_taps(model.config.num_hidden_layers, layer_ids=layer_ids, num_captured=num_capture_layers)
    logger.info(
        "target %s: %s, %d layers, hidden %d, tapping layers %s on %s (%s)",
        path,
        type(model).__name__,
        model.config.num_hidden_layers,
        model.config.hidden_size,
        layer_ids,
        device,
        dtype,
    )
    return Target(model, layer_ids)


def _causal_lm_config(path: Path):
    """The config ``AutoModelForCausalLM`` builds the target from. A multimodal checkpoint (Qwen3.5 /
    Qwen3.6) says whether its LM head is tied to the embeddings at the top level, where its
    ``*ForConditionalGeneration`` reads it, and ``save_pretrained`` writes ``false`` into
    ``text_config``, which the causal LM reads: the tied head is not in the files, and would be
    left random."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()
    if text is not config and getattr(config, "tie_word_embeddings", False):
        text.tie_word_embeddings = True
    return config


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _warn_of_random_weights(path: Path, loading: dict) -> None:
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        logger.warning(
            "target %s: %d of its weights are not in its files and stay random (--random-target-weights): %s; "
            "a drafter trained against it fits no real model",
            path,
            len(missing),
            _names(missing),
        )


def _refuse_missing_weights(path: Path, loading: dict) -> None:
    """``from_pretrained`` initialises at random every weight the files lack and only logs it: a
    verifier that is partly random trains a drafter for a model nobody serves."""
    missing = sorted(loading.get("missing_keys") or ())
    if not missing:
        return
    unexpected = sorted(loading.get("unexpected_keys") or ())
    found = (
        f"; the files hold {len(unexpected)} weights the model does not use ({_names(unexpected)})"
        if unexpected
        else ""
    )
    raise TargetLoadError(
        f"target {path}: its weight files lack {len(missing)} of the model's weights ({_names(missing)}){found}, "
        "which would be initialised at random; restore the missing shards or weight names from the model's "
        "source (--random-target-weights of dflash train and dflash eval keeps them random, for a benchmark of the "
        "model's shape)"
    )
