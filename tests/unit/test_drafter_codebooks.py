"""dflash.drafter.codebooks: a selector whose codebooks are projected from the target's frozen
embeddings scores as the tables it materialises; a run trained so checkpoints those tables in the
published layout (loaded strictly, with nothing missing or unexpected) and resumes exactly from the
projections; the flag is refused where it cannot apply."""

import pytest
import torch
from safetensors.torch import load_file
from tiny import make_target, record_losses, train_config, write_chat_data

from dflash.drafter.codebooks import PROJECTION_NAMES, ProjectedSelector
from dflash.drafter.modeling_dflash import CandidateSelector
from dflash.run.settle import settle
from dflash.train.trainer import Trainer


def test_the_projected_codebooks_score_as_the_tables_they_materialise():
    torch.manual_seed(0)
    hidden_size, vocab, rank, top_k = 16, 40, 8, 5
    projected = ProjectedSelector(hidden_size, rank, top_k)
    for weight in projected.parameters():
        torch.nn.init.normal_(weight)
    inputs, outputs = torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size)
    projected.attach(inputs, outputs)
    assert sum(p.numel() for p in projected.parameters()) == 3 * hidden_size * rank
    tables = CandidateSelector(hidden_size, vocab, rank, top_k)
    predecessors, successors = projected.tables()
    assert predecessors.shape == successors.shape == (vocab, rank)
    tables.load_state_dict(
        {
            "hidden_projection.weight": projected.hidden_projection.weight,
            "predecessor_codebook": predecessors,
            "successor_codebook": successors,
        }
    )
    hidden, logits = torch.randn(3, 4, hidden_size), torch.randn(3, 4, vocab)
    anchors = torch.randint(0, vocab, (3,))
    candidates = logits.topk(top_k).indices
    previous = torch.randint(0, vocab, (3, 4))
    torch.testing.assert_close(
        projected.scores(hidden, logits.gather(-1, candidates), candidates, previous),
        tables.scores(hidden, logits.gather(-1, candidates), candidates, previous),
    )
    assert torch.equal(projected.walk(hidden, logits, anchors), tables.walk(hidden, logits, anchors))


def test_a_projected_score_keeps_no_embedding_rows_per_candidate_for_backward():
    # Many candidates of a small vocabulary: a [.., K, H] gather of embedding rows would be kept
    # for the projection's weight gradient; a [V, r] table is what a step may keep.
    torch.manual_seed(0)
    hidden_size, vocab, rank, top_k = 32, 50, 4, 8
    selector = ProjectedSelector(hidden_size, rank, top_k)
    selector.attach(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
    hidden, unary = torch.randn(2, 64, hidden_size), torch.randn(2, 64, top_k)
    candidates, previous = torch.randint(0, vocab, (2, 64, top_k)), torch.randint(0, vocab, (2, 64))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        selector.scores(hidden, unary, candidates, previous).sum().backward()
    assert max(saved) < candidates.numel() * hidden_size // 4, saved


def test_the_codebooks_materialise_in_chunks_as_whole():
    torch.manual_seed(0)
    selector = ProjectedSelector(8, 4, 2)
    selector.attach(torch.randn(37, 8).bfloat16(), torch.randn(37, 8).bfloat16())
    for whole, chunked in zip(selector.tables(), selector.tables(rows=5)):
        assert whole.dtype == torch.float32 and whole.shape == (37, 4)
        torch.testing.assert_close(whole, chunked, rtol=0, atol=0)


def test_a_projected_selector_needs_the_targets_embeddings():
    with pytest.raises(RuntimeError, match=r"call attach\(embed_tokens.weight, lm_head.weight\) first"):
        ProjectedSelector(8, 4, 2).tables()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("codebooks")
    return {"target": make_target(root / "target", num_layers=5), "data": write_chat_data(root / "train.jsonl")}


def _config(assets, out, **overrides):
    flags = dict(arch="dflash2", selector_codebooks="projected", steps=4, save_every=2, num_target_layers=2)
    return train_config(**{"target": assets["target"], "data": assets["data"], "out": out, **flags, **overrides})


def test_a_projected_run_checkpoints_the_published_tables_and_resumes_exactly(assets, tmp_path):
    from dflash.drafter.model import load_drafter_dir
    from dflash.run.step_dirs import find_checkpoint

    reference = record_losses(Trainer(settle(_config(assets, tmp_path / "full"))))
    reference.train()
    selector = reference.drafter.candidate_selector
    assert isinstance(selector, ProjectedSelector)
    hidden, rank = reference.drafter.config.hidden_size, reference.drafter.config.dflash2_value("selector_rank")
    assert sum(p.numel() for p in selector.parameters()) == 3 * hidden * rank

    # The checkpoint is a published DFlash2 drafter: tables, no projections, loaded strictly.
    step_dir = find_checkpoint(tmp_path / "full")
    published = load_drafter_dir(step_dir, dtype=torch.float32)
    predecessors, successors = selector.tables()
    torch.testing.assert_close(published.candidate_selector.predecessor_codebook, predecessors)
    torch.testing.assert_close(published.candidate_selector.successor_codebook, successors)
    saved = load_file(str(step_dir / "model.safetensors"))
    assert not {f"candidate_selector.{name}" for name in PROJECTION_NAMES} & set(saved)

    crashed = record_losses(Trainer(settle(_config(assets, tmp_path / "split"))), crash_after=2)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    resumed = record_losses(Trainer(settle(_config(assets, tmp_path / "split", resume=True))))
    assert resumed.step == 2 and isinstance(resumed.drafter.candidate_selector, ProjectedSelector)
    resumed.train()
    assert crashed.losses + resumed.losses == reference.losses  # bitwise: the projections were restored


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(selector_codebooks="projected"), "--selector-codebooks projected: the candidate selector is DFlash2's"),
        (
            dict(arch="dflash2", selector_codebooks="projected", init_from="somewhere"),
            "selector_codebooks projected trains new codebooks .* drop --selector-codebooks projected",
        ),
    ],
)
def test_projected_codebooks_are_refused_where_they_cannot_apply(assets, tmp_path, flags, message):
    from dflash.config import TrainConfig
    from dflash.run.drafter_shape import resolve_drafter_shape

    with pytest.raises(ValueError, match=message):
        resolve_drafter_shape(TrainConfig(target=str(assets["target"]), **flags))


def test_an_exported_projected_run_has_exactly_the_tensors_of_an_exported_tables_run(assets, tmp_path, monkeypatch):
    """What `dflash export` writes for --selector-codebooks projected is a published DFlash2 drafter:
    the same tensor names, shapes and dtype as a run with free tables, the codebooks the projections'
    tables in bf16, and transformers loads it strictly with trust_remote_code."""
    import sys

    import transformers.dynamic_module_utils as dynamic_modules
    from transformers import AutoModel

    from dflash.cli import main

    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    exported = {}
    for codebooks in ("tables", "projected"):
        trainer = Trainer(settle(_config(assets, tmp_path / codebooks, selector_codebooks=codebooks, steps=2)))
        trainer.train()
        out = tmp_path / f"{codebooks}-dflash2"
        assert main(["export", str(tmp_path / codebooks), "--out", str(out)]) == 0
        exported[codebooks] = load_file(str(out / "model.safetensors"))
        model, info = AutoModel.from_pretrained(out, trust_remote_code=True, dtype="auto", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    layout = {name: (tuple(t.shape), t.dtype) for name, t in exported["tables"].items()}
    assert {name: (tuple(t.shape), t.dtype) for name, t in exported["projected"].items()} == layout
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= set(layout)
    predecessors, successors = trainer.drafter.candidate_selector.tables()
    saved = exported["projected"]
    assert torch.equal(saved["candidate_selector.predecessor_codebook"], predecessors.to(torch.bfloat16))
    assert torch.equal(saved["candidate_selector.successor_codebook"], successors.to(torch.bfloat16))
