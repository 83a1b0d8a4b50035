"""dflash.evaluation.sampling: speculative sampling is lossless. On tiny targets with a vocabulary
of 8 tokens, whose distribution over short continuations is computed exactly by enumeration, the
continuations of 4 tokens speculative decoding samples with a random DFlash or DFlash2 drafter
(block 3: a prefill token, then a step that accepts both drafts, or one that rejects and a second
step after it; rejections, corrections and bonus tokens all occur) fit the target's own
sampling distribution by a chi-square goodness-of-fit test at alpha 0.001 over 300 seeds: a dense
Qwen3 target at T = 0.6 and 1.0 for both drafters, a hybrid Qwen3.5 target (whose states roll back
after rejections) at one temperature each, top-p 0.9 throughout. Mutants that draw the correction
from p instead of norm(max(0, p - q)), or that verify DFlash2's drafts with its LM head's
distribution instead of the selector's, or that record DFlash2's q without the temperature it was
drawn at, fail the same test."""

import functools
from collections import Counter

import pytest
import torch
from tiny import random_causal_lm

from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.drafter.modeling_dflash import DFLASH2_DEFAULTS, DFlashDraftConfig
from dflash.evaluation import sampling
from dflash.evaluation.decoding import speculative_generate
from dflash.evaluation.sampling import Decoder
from dflash.evaluation.sampling_settings import Sampling
from dflash.target_model.model import Target

VOCAB, MASK, BLOCK, NEW_TOKENS = 8, 7, 3, 4
PROMPT = torch.tensor([[1, 4, 2, 6]])
SAMPLES = 300
ALPHA = 1e-3
TOP_P = 0.9


@functools.cache
def _target(family: str) -> Target:
    """A 2-layer target (the hybrid one: a Gated DeltaNet layer, then a gated attention layer) whose
    token embeddings share one direction: the drafter, reading the same embedding and LM head,
    proposes distributions near the target's, about half of its drafts are accepted, and where one
    is rejected norm(max(0, p - q)) is far from p (a total variation of about 0.2 at the first
    draft), so a wrong correction shows in a few hundred samples."""
    if family == "qwen3_5":
        pytest.importorskip("transformers.models.qwen3_5", reason="qwen3_5 needs transformers >= 5.2")
    layers = {"layer_types": ["linear_attention", "full_attention"]} if family == "qwen3_5" else {}
    model = random_causal_lm(family, vocab_size=VOCAB, num_layers=2, initializer_range=0.2, seed=3, **layers)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        shared = torch.randn(embedding.shape[1], generator=generator)
        embedding.copy_(2.0 * shared + torch.randn(embedding.shape, generator=generator))
        model.get_output_embeddings().weight.normal_(0.0, 0.4, generator=generator)
    return Target(model, [0, 1])


def _drafter(target, arch):
    config = create_drafter_config(
        target.config, 1, block_size=BLOCK, target_layer_ids=target.layer_ids, mask_token_id=MASK, arch="dflash"
    )
    if arch == "dflash2":  # fewer candidates than tokens: q is 0 off them
        selector = {**DFLASH2_DEFAULTS, "selector_rank": 8, "selector_top_k": 4}
        config = DFlashDraftConfig(**{**config.to_dict(), "dflash_config": {**config.dflash_config, **selector}})
    torch.manual_seed(5)
    drafter = AnchoredDrafter._from_config(config, attn_implementation="sdpa").eval()
    if arch == "dflash2":
        with torch.no_grad():  # a selector that reorders its candidates, and still proposes what the target takes
            selector = drafter.candidate_selector
            selector.hidden_projection.weight.normal_(0.0, 0.3)
            selector.predecessor_codebook.normal_(0.0, 0.5)
            selector.successor_codebook.normal_(0.0, 0.5)
    return drafter


@torch.no_grad()
def _exact_distribution(target, settings: Sampling) -> dict[tuple, float]:
    """Every continuation of NEW_TOKENS tokens the target samples after PROMPT, with its probability."""
    prefixes = {(): 1.0}
    for _ in range(NEW_TOKENS):
        keys = list(prefixes)
        ids = torch.cat([PROMPT.expand(len(keys), -1), torch.tensor(keys, dtype=torch.long).view(len(keys), -1)], 1)
        out = target.decoder_forward(ids)
        probs = settings.probabilities(target.lm_head(out.last_hidden_state[:, -1]))
        prefixes = {
            (*key, token): prefixes[key] * float(probs[row, token])
            for row, key in enumerate(keys)
            for token in torch.nonzero(probs[row])[:, 0].tolist()
        }
    return prefixes


def _sampled(target, drafter, settings: Sampling, samples: int) -> Counter:
    counts = Counter()
    for seed in range(samples):
        decoder = Decoder(settings, torch.Generator().manual_seed(seed))
        generation = speculative_generate(
            target,
            drafter,
            PROMPT,
            max_new_tokens=NEW_TOKENS,
            eos_ids=set(),
            decoder=decoder,
            rollback_strategy="mixers",
        )
        counts[tuple(generation.tokens)] += 1
    return counts


def _chi_square_p_value(counts: Counter, exact: dict[tuple, float]) -> float:
    """Goodness of fit of ``counts`` to ``exact``: cells of at least 5 expected samples, the rest
    pooled into one; an outcome the target never samples fails outright (p-value 0)."""
    if set(counts) - set(exact):
        return 0.0
    total = sum(counts.values())
    big = [key for key, p in exact.items() if p * total >= 5]
    observed = [counts[key] for key in big]
    expected = [exact[key] * total for key in big]
    rest, rest_observed = total - sum(expected), total - sum(observed)
    if rest >= 5:
        observed.append(rest_observed)
        expected.append(rest)
    else:  # too few to stand alone: merged into the smallest cell, so mass piled on rare outcomes still counts
        smallest = expected.index(min(expected))
        observed[smallest] += rest_observed
        expected[smallest] += rest
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    freedom = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(statistic / 2)))


def _fit(target, arch, temperature, samples=SAMPLES) -> float:
    settings = Sampling(temperature=temperature, top_p=TOP_P, top_k=0)
    return _chi_square_p_value(
        _sampled(target, _drafter(target, arch), settings, samples), _exact_distribution(target, settings)
    )


@pytest.mark.parametrize(
    "family, arch, temperature",
    [
        ("qwen3", "dflash", 0.6),
        ("qwen3", "dflash", 1.0),
        ("qwen3", "dflash2", 0.6),
        ("qwen3", "dflash2", 1.0),
        ("qwen3_5", "dflash", 1.0),
        ("qwen3_5", "dflash2", 0.6),
    ],
)
def test_speculative_sampling_is_distributed_as_the_target(family, arch, temperature):
    assert _fit(_target(family), arch, temperature) > ALPHA


def _p_instead_of_residual(p, q):
    return p


_SELECTOR_PATH = Decoder._selector_path


def _lm_head_proposal(self, selector, hidden, logits, anchor):
    tokens, _ = _SELECTOR_PATH(self, selector, hidden, logits, anchor)
    return tokens, self.sampling.probabilities(logits)


@torch.no_grad()
def _proposal_without_temperature(self, selector, hidden, logits, anchor):
    """The path drawn from softmax(scores / T), its q recorded as softmax(scores): the same at T = 1."""
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)
    predecessor, tokens, proposal = anchor, [], torch.zeros(logits.shape)
    for slot in range(hidden.shape[0]):
        scores = selector.scores(
            hidden[slot : slot + 1], unary[slot : slot + 1], candidates[slot : slot + 1], predecessor
        )
        pick = torch.multinomial((scores[0] / self.sampling.temperature).softmax(-1), 1, generator=self.generator)
        proposal[slot].scatter_(0, candidates[slot], scores[0].softmax(-1))
        predecessor = candidates[slot, pick]
        tokens.append(predecessor)
    return torch.cat(tokens), proposal


_MUTANTS = {
    "residual": (sampling, "residual", _p_instead_of_residual),
    "proposal": (Decoder, "_selector_path", _lm_head_proposal),
    "temperature": (Decoder, "_selector_path", _proposal_without_temperature),
}


@pytest.mark.parametrize(
    "arch, mutant, temperature, samples",
    # The temperature slip shifts q by less than the others: twice the samples keep it far below alpha.
    [
        ("dflash", "residual", 1.0, SAMPLES),
        ("dflash2", "residual", 1.0, SAMPLES),
        ("dflash2", "proposal", 1.0, SAMPLES),
        ("dflash2", "temperature", 0.6, 2 * SAMPLES),
    ],
)
def test_a_wrong_rule_fails_the_fit(monkeypatch, arch, mutant, temperature, samples):
    monkeypatch.setattr(*_MUTANTS[mutant])
    assert _fit(_target("qwen3"), arch, temperature, samples) < ALPHA


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1)
    probs = logits.exp()[0]
    top_k = Sampling(temperature=1.0, top_p=1.0, top_k=2).probabilities(logits)[0]
    assert torch.allclose(top_k, torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)]))
    # The smallest set reaching top_p: the first token alone holds 0.64 of the mass.
    assert Sampling(temperature=1.0, top_p=0.6, top_k=0).probabilities(logits)[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    two = Sampling(temperature=1.0, top_p=0.7, top_k=0).probabilities(logits)[0]
    assert torch.allclose(two, torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)]))
    assert torch.allclose(Sampling(temperature=0.5, top_p=1.0, top_k=0).probabilities(logits), (2 * logits).softmax(-1))
