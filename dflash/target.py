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
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash import document_separation, early_exit, masks

logger = logging.getLogger(__name__)


class TargetLoadError(ValueError):
    """The target directory cannot be loaded as a causal LM."""


_QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

#: The first transformers release with each model type that older releases cannot load (Qwen3.5 and
#: Qwen3.6, dense and MoE, came with 5.2.0; transformers 4.x maps them to nothing).
FIRST_TRANSFORMERS = dict.fromkeys(_QWEN3_5_TYPES, "5.2.0")

#: The transformers releases (first, last minor) whose hybrid cache :mod:`dflash.state_rollback` puts
#: back after a rejected draft: 5.2-5.6 start every chunked Gated DeltaNet forward from a zero state,
#: and a minor release may lay the linear-attention cache out anew (5.15 and 5.25 did), so eval
#: refuses a newer one rather than measure acceptance against a wrongly restored target.
TRANSFORMERS_FOR_DECODING = dict.fromkeys(_QWEN3_5_TYPES, ("5.7.0", "5.25"))


def decoding_transformers_range(model_type: str = "qwen3_5") -> str:
    """The releases :data:`TRANSFORMERS_FOR_DECODING` names for ``model_type``, as ``"5.7-5.25"``."""
    first, last = TRANSFORMERS_FOR_DECODING[model_type]
    return f"{first.removesuffix('.0')}-{last}"


def require_transformers_for(config: dict, source: str | Path, *, decoding: bool = False) -> None:
    """Refuse a target whose ``model_type`` the installed transformers cannot load (or, with
    ``decoding``, cannot verify speculative drafts with), before it loads.

    Args:
        config (dict): the target's ``config.json``.
        source: the file, for the message.
        decoding (bool): the target decodes with a cache (``dflash eval``).

    Raises:
        TargetLoadError: names the model type, the transformers releases that work, the installed
            one, and the pip command that installs one of them.
    """
    from importlib.metadata import version

    from packaging.version import Version

    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    installed = version("transformers")
    first = FIRST_TRANSFORMERS.get(model_type)
    if first and Version(installed) < Version(first):
        raise TargetLoadError(
            f"target {source}: model_type {model_type!r} (Qwen3.5 / Qwen3.6) loads with transformers {first} or "
            f"newer; this environment has {installed}: pip install -U 'transformers>={first}'"
        )
    if not decoding or model_type not in TRANSFORMERS_FOR_DECODING:
        return
    first, last = TRANSFORMERS_FOR_DECODING[model_type]
    if Version(installed) < Version(first):
        raise TargetLoadError(
            f"target {source}: model_type {model_type!r} (Qwen3.5 / Qwen3.6) verifies speculative drafts from its "
            f"cache with transformers {first} or newer; this environment has {installed}: "
            f"pip install -U 'transformers>={first}'"
        )
    if Version(installed).release[:2] > Version(last).release[:2]:
        upper = f"{Version(last).major}.{Version(last).minor + 1}"
        raise TargetLoadError(
            f"target {source}: dflash eval rolls back the linear-attention cache of model_type {model_type!r} "
            f"(Qwen3.5 / Qwen3.6) as transformers {decoding_transformers_range(model_type)} lay it out; this "
            f"environment has {installed}, whose layout it has not been tested on and could measure acceptance "
            f"wrongly: pip install 'transformers>={first},<{upper}' to evaluate (training is not affected)"
        )


def read_target_config(path: str | Path) -> dict:
    """The ``config.json`` of a target directory, read without loading anything else.

    Raises:
        TargetLoadError: no such directory, no ``config.json``, or one that is not a JSON object.
    """
    path = Path(path)
    if path.is_file():
        raise TargetLoadError(f"target {path}: a file; pass --target with the model's directory ({path.parent}?)")
    if not path.is_dir():
        raise TargetLoadError(
            f"target {path}: no such directory; pass --target with a local HF model "
            "directory (config.json + safetensors)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise TargetLoadError(
            f"target {path}: no config.json; this is not a Hugging Face model "
            "directory (save one with model.save_pretrained)"
        )
    from dflash.json_files import read_json_object

    return read_json_object(
        config_file, error=TargetLoadError, name=f"target {config_file}", fix="restore it from the model's source"
    )


def context_length(path: str | Path) -> int:
    """The target's context in tokens: ``max_position_embeddings`` of its ``config.json`` (of its
    ``text_config`` in a multimodal config), read without loading the model.

    Raises:
        TargetLoadError: see :func:`read_target_config`; or no positive integer
            ``max_position_embeddings`` (the drafter config copies it, so every target has it).
    """
    raw = read_target_config(path)
    positions = (raw.get("text_config") or raw).get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise TargetLoadError(
            f"target {Path(path) / 'config.json'}: max_position_embeddings is {positions!r}, expected the "
            "context length in tokens; is it a causal LM's config?"
        )
    return positions


def require_tokenizer_files(path: str | Path) -> None:
    """Check that the target directory holds its tokenizer and chat template, before anything
    loads it.

    Raises:
        TargetLoadError: no ``tokenizer_config.json`` (its special tokens: eos, pad), no
            vocabulary (``tokenizer.json``, or ``tokenizer.model``/``vocab.json`` for transformers
            to convert), or no chat template (a ``chat_template`` key there, ``chat_template.jinja``
            or ``chat_template.json``): the loss mask and prompts come from it. Names the file.
    """
    path = Path(path)
    fix = "copy it from the model's source, or save it with tokenizer.save_pretrained(DIR)"
    config = path / "tokenizer_config.json"
    if not config.is_file():
        raise TargetLoadError(f"no tokenizer_config.json in {path} (the target's special tokens: eos, pad); {fix}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise TargetLoadError(f"no tokenizer.json in {path} (the target's vocabulary); {fix}")
    if not any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        try:
            has_template = "chat_template" in json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TargetLoadError(f"{config}: cannot read ({e}); {fix}") from None
        if not has_template:
            raise TargetLoadError(
                f"no chat template in {path} (no chat_template.jinja, and tokenizer_config.json has no "
                f"chat_template): the loss mask and prompts are rendered with it; {fix}"
            )


def load_tokenizer(path: str | Path):
    """The target's tokenizer from its local directory (``AutoTokenizer``, no network).

    Raises:
        TargetLoadError: no tokenizer files (:func:`require_tokenizer_files`), or files that
            ``AutoTokenizer`` cannot load (the message names the directory).
    """
    from transformers import AutoTokenizer

    require_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TargetLoadError(
            f"tokenizer in {path}: cannot load ({type(e).__name__}: {e}); check tokenizer.json/tokenizer_config.json"
        ) from e


def resolve_device(name: str | None) -> torch.device:
    """Turn ``"auto"``/None, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` into a device that exists.

    ``"auto"`` picks ``cuda`` when a GPU is visible, else ``cpu``.

    Raises:
        ValueError: unparsable name, CUDA requested on a host without it, or an index past
            the visible GPUs; the message names the fix.
    """
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: CUDA is not available on this host (torch "
                f"{torch.__version__}, no visible GPU); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {name}: this host has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); pick one of those or set CUDA_VISIBLE_DEVICES"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


@dataclass
class TargetStates:
    """Target hidden states for a batch (no grad).

    Args:
        context (torch.Tensor): ``[B, S, K*H]`` the tapped layer outputs concatenated on the
            feature dim in ``layer_ids`` order; bf16 on GPU, fp32 on CPU.
        last_hidden (torch.Tensor, optional): ``[B, S, H]`` final-norm hidden state (input of
            the LM head), for soft labels; None when the capture skipped the layers past the
            deepest tap (:mod:`dflash.early_exit`).
    """

    context: torch.Tensor
    last_hidden: torch.Tensor | None


class Target:
    """A frozen HF causal LM plus the layer ids to tap.

    Args:
        model: a ``PreTrainedModel`` with ``get_decoder()``, ``get_input_embeddings()`` and
            ``get_output_embeddings()`` (Qwen3, Llama, Mistral, ... all have them).
        layer_ids (list[int]): decoder layers to tap, each in ``[0, num_layers)``.

    Raises:
        ValueError: a layer id out of range.
    """

    def __init__(self, model, layer_ids: list[int]):
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        self.layer_ids = list(layer_ids)
        bad = [k for k in self.layer_ids if not 0 <= k < self.num_layers]
        if bad or not self.layer_ids:
            raise ValueError(
                f"target_layer_ids {self.layer_ids}: each id must be in [0, {self.num_layers}) "
                f"for a target with {self.num_layers} decoder layers"
            )
        self._layer_skip = self._skip_past_taps()

    def _skip_past_taps(self) -> early_exit.LayerSkip | None:
        layers = getattr(self.model.get_decoder(), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != self.num_layers:
            logger.info("target %s: no decoder layer list, every capture runs all layers", type(self.model).__name__)
            return None
        return early_exit.LayerSkip.past(layers, max(self.layer_ids))

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
        :mod:`dflash.packing`) every layer keeps each conversation to itself, so its states equal
        those of the conversation run alone: attention layers through a document-causal mask in the
        form of the model's attention backend, linear-attention layers (Qwen3.5 / Qwen3.6 Gated
        DeltaNet) with their conv and recurrence restarted at each conversation
        (:mod:`dflash.document_separation` says how, and what it costs).

        Args:
            input_ids (torch.Tensor): int64 ``[B, S]``.
            position_ids (torch.Tensor, optional): int64 ``[B, S]``, positions restarting at 0 in
                each document (:class:`dflash.data.Batch`); None: ``0..S-1`` (or, with
                ``document_ids``, the position within each document).
            document_ids (torch.Tensor, optional): int ``[B, S]``, documents as maximal runs of
                equal ids (-1 on padding); None: one conversation per row. Host tensors spare
                device syncs.
            last_hidden (bool): also return the final hidden state; False skips the layers past
                the deepest tap (:mod:`dflash.early_exit`), which change no tapped state.

        Returns:
            TargetStates: ``context [B, S, K*H]`` and ``last_hidden [B, S, H]`` (None without
            ``last_hidden``).

        Raises:
            ValueError: ``document_ids`` with an attention backend that takes no document mask.
            UnknownLayerType: ``document_ids`` for a target with a layer type packing cannot keep
                apart (:func:`dflash.document_separation.check_packable`).
        """
        input_ids = input_ids.to(self.device)
        attention_mask, apart = None, contextlib.nullcontext()
        if document_ids is not None:
            # Linear layers always take the segmented route, one set of kernels for every batch
            # (a batch of one-document rows would otherwise compile and autotune transformers'
            # own path too: a 60 s stall measured at the 64-layer shape); attention layers need
            # the mask only where a row holds several documents (else SDPA's causal fast path).
            if self._linear_mixers:
                width = self.config.get_text_config().linear_conv_kernel_dim
                segments = document_separation.Segments.of(document_ids, self.device, conv_width=width)
                apart = document_separation.linear_layers_apart(segments, self._linear_kernels)
            several = bool(document_ids.max() > 0)
            document_ids = document_ids.to(self.device)
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=self.device) - masks.document_starts(
                    document_ids
                )
            if several:
                attention_mask = document_separation.attention_masks(
                    document_ids, self.config.get_text_config(), self.dtype
                )
        if position_ids is not None:
            position_ids = position_ids.to(self.device)
        skip = self._layer_skip
        shallow = skip.skipping() if skip and not last_hidden else contextlib.nullcontext()
        with apart, shallow:
            out = self.decoder_forward(input_ids, position_ids=position_ids, attention_mask=attention_mask)
        return TargetStates(self.select(out.hidden_states), out.hidden_states[-1] if last_hidden else None)

    @functools.cached_property
    def _linear_mixers(self) -> dict[int, torch.nn.Module]:
        mixers = document_separation.linear_layers(self.model)
        document_separation.install_segmented_forward(mixers.values())
        return mixers

    @functools.cached_property
    def _linear_kernels(self) -> document_separation.LinearAttentionKernels:
        kernels = document_separation.kernels_for(self.device)
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
        dtype: None picks bf16 on GPU and fp32 on CPU.
        random_missing: keep the random initialisation ``from_pretrained`` gives weights the files
            lack (a benchmark of a model's shape) instead of refusing the target.

    Raises:
        TargetLoadError: missing directory, no ``config.json``, a config/weights that
            ``AutoModelForCausalLM`` cannot load, or (without ``random_missing``) weight files that
            lack some of the model's weights, e.g. under other key names (the message names the
            path, the weights and the fix).
        ValueError: the layers to tap do not fit the target (see :func:`dflash.layer_taps.check_taps`).
    """
    from transformers import AutoModelForCausalLM

    from dflash.layer_taps import check_taps

    path = Path(path)
    require_transformers_for(read_target_config(path), path / "config.json")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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
        "source (dflash train --random-target-weights keeps them random, for a benchmark of the model's shape)"
    )
