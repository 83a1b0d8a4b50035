"""DFlash2's selector codebooks projected from the target's frozen token embeddings, for training.

A DFlash2 checkpoint stores the selector's predecessor and successor codebooks as free ``[V, r]``
tables (:class:`dflash.drafter.modeling_dflash.CandidateSelector`; z-lab/dflash 07ebd93), and the
public trainers train them so: 2 x 248,320 x 256 = 127M parameters at Qwen3.6-27B's vocabulary,
with their gradients (dense, an embedding's) and AdamW's two moments. The DFlash2 blog counts
about 2M selector parameters, which fits 3 x hidden x rank: the hidden projection ``P`` ``[r, H]``
and two ``[r, H]`` projections of frozen ``[V, H]`` token embeddings, ``A = E_in W_A^T`` and
``B = E_out W_B^T`` (a derivation from the count, not a published recipe).

:class:`ProjectedSelector` trains that form: ``W_A`` projects the target's input embedding of the
predecessor token (what the drafter reads it as), ``W_B`` its LM head row of the candidate (what
the candidate is scored with). A step projects the whole embedding once per micro-batch, in its
dtype, and gathers the scored rows from that ``[V, r]`` activation: gathering ``[.., K, H]``
embedding rows per candidate first would keep them for the projection's weight gradient (2.7 GB in
bf16 at 2 rows x 512 anchors x 16 slots x 16 candidates, H 5120), the table keeps 127 MB in bf16
at V 248,320 and no parameter, gradient or optimizer state of that size. Checkpoints stay in the published format:
:meth:`ProjectedSelector.tables` materialises ``A`` and ``B`` for ``model.safetensors`` (what
``dflash eval``, ``dflash export``, vLLM, SGLang and z-lab's reference load), and the training
state keeps the projections for an exact resume.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.drafter.modeling_dflash import CandidateSelector

#: State-dict names of the projections, under the drafter's ``candidate_selector.``.
PROJECTION_NAMES = ("predecessor_projection.weight", "successor_projection.weight")


class ProjectedSelector(CandidateSelector):
    """A :class:`CandidateSelector` whose codebooks are projections of frozen token embeddings
    (module docstring): its parameters are ``hidden_projection``, ``predecessor_projection`` and
    ``successor_projection``, each ``[r, H]``.

    The frozen embeddings are the target's, attached per replica with :meth:`attach` (not
    parameters, not buffers: never saved, moved or broadcast with the drafter).

    Args:
        hidden_size (int): H; rank (int): r; top_k (int): K candidates.
    """

    def __init__(self, hidden_size: int, rank: int, top_k: int):
        # The parent's __init__ would allocate the [V, r] tables this class replaces.
        nn.Module.__init__(self)
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_projection = nn.Linear(hidden_size, rank, bias=False)
        self.successor_projection = nn.Linear(hidden_size, rank, bias=False)
        self._embeddings: tuple[Tensor, Tensor] | None = None

    def reset_parameters(self, std: float) -> None:
        """Predecessor projection ``N(0, std)``, successor projection 0: as the tables start, the
        selector first ranks by the logits alone."""
        with torch.no_grad():
            self.predecessor_projection.weight.normal_(0.0, std)
            self.successor_projection.weight.zero_()

    def attach(self, input_embedding: Tensor, output_embedding: Tensor) -> None:
        """Use the target's frozen ``input_embedding`` (``embed_tokens``) and ``output_embedding``
        (``lm_head``) weights ``[V, H]``, on this selector's device."""
        self._embeddings = (input_embedding.detach(), output_embedding.detach())

    def _frozen(self) -> tuple[Tensor, Tensor]:
        if self._embeddings is None:
            raise RuntimeError(
                "a projected selector scores with the target's token embeddings: call attach(embed_tokens.weight, "
                "lm_head.weight) first"
            )
        return self._embeddings

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessors: Tensor) -> Tensor:
        """As :meth:`CandidateSelector.scores`, with the codebooks projected in this call (module
        docstring), in the frozen embeddings' dtype (bf16 on the GPU: no float32 copy of ``[V, H]``)."""
        inputs, outputs = self._frozen()
        predecessor_codebook = F.linear(inputs, self.predecessor_projection.weight.to(inputs.dtype))
        successor_codebook = F.linear(outputs, self.successor_projection.weight.to(outputs.dtype))
        left = F.embedding(predecessors, predecessor_codebook) * self.hidden_projection(hidden)
        right = F.embedding(candidates, successor_codebook)
        return unary + (left[..., None, :] * right).sum(-1)

    @torch.no_grad()
    def tables(self, rows: int = 16384) -> tuple[Tensor, Tensor]:
        """The codebooks ``[V, r]`` (predecessor, successor) in the parameters' dtype: what a
        :class:`CandidateSelector` with these projections' tables scores alike. Projected ``rows``
        embedding rows at a time, so a save never holds a float32 copy of a ``[V, H]`` embedding
        (5.1 GB at Qwen3.6-27B's)."""
        inputs, outputs = self._frozen()
        dtype = self.hidden_projection.weight.dtype

        def project(embedding: Tensor, weight: Tensor) -> Tensor:
            return torch.cat([chunk.to(dtype) @ weight.t() for chunk in embedding.split(rows)])

        return (
            project(inputs, self.predecessor_projection.weight),
            project(outputs, self.successor_projection.weight),
        )


def project_codebooks(drafter) -> None:
    """Give a new DFlash2 ``drafter`` (:class:`dflash.drafter.model.AnchoredDrafter`) a
    :class:`ProjectedSelector` in place of its tables: the same hidden projection, the codebook
    projections initialised as new tables are. Its random draws do not move the global RNG, so the
    rest of the run (data order, anchors) draws as a run with tables does."""
    config, tables = drafter.config, drafter.candidate_selector
    rank, top_k = config.dflash2_value("selector_rank"), config.dflash2_value("selector_top_k")
    with torch.random.fork_rng(devices=[]):
        selector = ProjectedSelector(config.hidden_size, rank, top_k).to(tables.hidden_projection.weight)
        selector.reset_parameters(config.initializer_range)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(tables.hidden_projection.weight)
    drafter.candidate_selector = selector


def published_state_dict(drafter) -> dict[str, Tensor]:
    """``drafter``'s weights in the published layout: a projected selector's codebooks materialised
    as ``candidate_selector.{predecessor,successor}_codebook`` tables, its projections left out."""
    state = drafter.state_dict()
    selector = getattr(drafter, "candidate_selector", None)
    if not isinstance(selector, ProjectedSelector):
        return state
    for name in PROJECTION_NAMES:
        del state[f"candidate_selector.{name}"]
    predecessors, successors = selector.tables()
    state["candidate_selector.predecessor_codebook"] = predecessors
    state["candidate_selector.successor_codebook"] = successors
    return state
