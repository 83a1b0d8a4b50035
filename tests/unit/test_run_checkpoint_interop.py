"""A trained drafter checkpoint as the serving engines and every transformers version read it.

The round trip uses a Qwen3-8B-shaped target at tiny width: 36 decoder layers, RoPE base 1e6 and
more embedding rows than tokenizer entries (Qwen3: 151936 rows, 151669 tokens). It trains a
drafter a few optimizer steps, saves it in bf16 with ``save_checkpoint`` and checks it as (a) a
transformers 4.x loader reads ``config.json``, (b) ``AutoModel``/``AutoModelForCausalLM`` with
``trust_remote_code=True`` load it, against the project's model, and (c) vLLM's
``qwen3_dflash.py`` and SGLang's ``models/dflash.py`` map its weights. CI runs this file under the
transformers floor of pyproject.toml and under the newest release (``.ci/run``).

(a) and (b) also run on the config as transformers 5 writes it (RoPE only as ``rope_parameters``),
so under the 4.x floor they check what broke there: a 5.x-trained drafter served by a 4.x loader.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tiny import loss_settings, make_tokenizer

from dflash import masks
from dflash.drafter.hf_config import rope_parameters_of
from dflash.drafter.mask_token import UNUSED_ROW, resolve_mask_token_id
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.run.checkpoint import MASTER_WEIGHTS_KEY, load_training_state, resume_weights, save_checkpoint
from dflash.target_model.model import load_target
from dflash.train.loss import dflash_loss

ROPE_THETA, VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1e6, 512, 32, 4, 2, 8, 64
TARGET_LAYERS, DRAFT_LAYERS, BLOCK = 36, 2, 4


def _inv_freq(theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


def _as_transformers_5_writes_it(config: dict) -> dict:
    """A drafter config dict in the transformers 5 form whatever version is installed."""
    rope = rope_parameters_of(config)
    return {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")} | {"rope_parameters": rope}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, trained drafter, {writer: step directory of its bf16 checkpoint}, mask token source);
    writer "installed" saves the installed transformers' config dict, "transformers 5" its 5.x form."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("interop")
    tokenizer = make_tokenizer(root / "target")
    tokenizer.mask_token = None  # like Qwen3: no mask token, unused embedding rows past the tokenizer
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        rope_theta=ROPE_THETA,  # both transformers 4.x and 5.x accept this spelling
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(root / "target")
    target = load_target(root / "target", device="cpu", dtype=torch.float32)

    mask_id, source = resolve_mask_token_id(
        explicit=None, drafter_config=None, tokenizer=tokenizer, vocab_size=target.embed_tokens.num_embeddings
    )
    drafter_config = create_drafter_config(target.config, DRAFT_LAYERS, block_size=BLOCK, mask_token_id=mask_id)
    drafter = AnchoredDrafter._from_config(drafter_config, attn_implementation="sdpa", dtype=torch.float32)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, len(tokenizer), (2, 48), generator=gen)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    context = target.capture(input_ids).context
    for _ in range(3):
        anchors, valid = masks.sample_anchors(loss_mask, 6, generator=gen)
        ids = masks.draft_input_ids(input_ids, anchors, valid, BLOCK, mask_id)
        hidden = drafter(F.embedding(ids, target.embed_tokens.weight), context, anchors, valid)
        labels, label_mask = masks.build_labels(input_ids, loss_mask, anchors, valid, BLOCK)
        settings = loss_settings(block_size=BLOCK, gamma=2.0)
        out = dflash_loss(hidden, target.lm_head.weight, labels, label_mask, settings.position_weight("cpu"), settings)
        optimizer.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        optimizer.step()
    written = drafter.config.to_diff_dict()
    step_dirs = {
        writer: save_checkpoint(
            root / writer.replace(" ", "_"),
            3,
            weights=drafter.state_dict(),
            drafter_config=config,
            training_state={"step": 3},
            dtype=torch.bfloat16,
        )
        for writer, config in (("installed", written), ("transformers 5", _as_transformers_5_writes_it(written)))
    }
    return target, drafter.eval(), step_dirs, source


WRITERS = pytest.mark.parametrize("writer", ["installed", "transformers 5"])


def _block_inputs(target, drafter, *, context_len=40):
    """One decoding block after ``context_len`` verified tokens: (context, block embeddings)."""
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(4, 300, (1, context_len + 1), generator=gen)
    context = target.capture(prefix[:, :-1]).context
    block = torch.cat([prefix[:, -1:], torch.full((1, BLOCK - 1), drafter.config.mask_token_id)], dim=1)
    return context, target.embed_tokens(block).detach()


def _bf16_rounded(drafter):
    """The project model with the checkpoint's (bf16) weights, computing in float32 (RoPE
    buffers untouched: loaders compute them in float32)."""
    model = copy.deepcopy(drafter)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    return model


@WRITERS
def test_config_reads_the_rope_base_under_every_transformers_version(trained, writer):
    from transformers import AutoConfig, Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    step_dir = trained[2][writer]
    raw = json.loads((step_dir / "config.json").read_text())
    # transformers 4.x loaders (z-lab's pinned 4.57.1; vLLM under transformers < 5) read these two keys.
    assert raw["rope_theta"] == ROPE_THETA and raw["rope_scaling"] is None
    # transformers 5.x and SGLang read this one first.
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": ROPE_THETA}
    # What the installed transformers really builds from it: the stock class (vLLM, SGLang) and AutoConfig.
    for config in (Qwen3Config.from_pretrained(step_dir), AutoConfig.from_pretrained(step_dir)):
        torch.testing.assert_close(Qwen3RotaryEmbedding(config).inv_freq, _inv_freq(ROPE_THETA))
    assert raw["dtype"] == "bfloat16"


@WRITERS
def test_trust_remote_code_builds_the_drafter_and_loads_every_weight(trained, writer, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic_modules
    from transformers import AutoModel, AutoModelForCausalLM, Qwen3Config

    target, drafter, step_dirs, _ = trained
    step_dir = step_dirs[writer]
    # Remote code is copied into HF_MODULES_CACHE and imported from there: keep it in tmp_path.
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    context, block = _block_inputs(target, drafter)
    with torch.no_grad():
        expected = _bf16_rounded(drafter).block_hidden(context, block)
    positions = torch.arange(context.shape[1] + BLOCK)[None]
    for auto in (AutoModel, AutoModelForCausalLM):
        model, info = auto.from_pretrained(
            step_dir, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
        )
        assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.startswith("transformers_modules")
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        assert model.block_size == BLOCK and model.target_layer_ids == drafter.config.target_layer_ids
        with torch.no_grad():
            got = model.eval()(noise_embedding=block, target_hidden=context, position_ids=positions)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The comparison can fail: the same weights with the transformers-4 fallback base (10000) differ.
    wrong = _bf16_rounded(drafter)
    wrong.rotary_emb.inv_freq.copy_(_inv_freq(10000.0))
    with torch.no_grad():
        assert (wrong.block_hidden(context, block) - expected).abs().max() > 1e-3
    # Loading registered the drafter for the checkpoint's own config class only.
    stock = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
    assert type(AutoModel.from_config(stock)).__name__ == "Qwen3Model"


@WRITERS
def test_project_model_loads_the_checkpoint(trained, writer):
    target, drafter, step_dirs, _ = trained
    step_dir = step_dirs[writer]
    loaded = AnchoredDrafter.from_pretrained(step_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    context, block = _block_inputs(target, drafter)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.block_hidden(context, block), _bf16_rounded(drafter).block_hidden(context, block)
        )


def test_weights_follow_the_vllm_and_sglang_loader_rules(trained):
    target, drafter, step_dirs, mask_source = trained
    step_dir = step_dirs["installed"]
    raw = json.loads((step_dir / "config.json").read_text())
    with safe_open(str(step_dir / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}
    assert dtypes == {torch.bfloat16}

    # Both engines add "model." themselves and take embed_tokens / lm_head from the target.
    assert not [n for n in shapes if n.startswith("model.") or "embed_tokens" in n or "lm_head" in n]
    assert not [n for n in shapes if "mask_hidden" in n]  # vLLM asserts it away
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = {
        "self_attn.q_proj.weight": (q, HIDDEN),
        "self_attn.k_proj.weight": (kv, HIDDEN),
        "self_attn.v_proj.weight": (kv, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, q),
        "self_attn.q_norm.weight": (HEAD_DIM,),
        "self_attn.k_norm.weight": (HEAD_DIM,),
        "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    ids = raw["dflash_config"]["target_layer_ids"]
    expected = {"fc.weight": (HIDDEN, len(ids) * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    expected |= {f"layers.{i}.{name}": shape for i in range(DRAFT_LAYERS) for name, shape in per_layer.items()}
    assert shapes == expected  # SGLang skips unknown names silently, so an extra or missing one is a bug
    for i in range(DRAFT_LAYERS):
        # Stacked on load: q/k/v rows into qkv_proj ((heads + 2 kv heads) * head_dim), gate/up into gate_up_proj.
        qkv = [shapes[f"layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert {s[1] for s in qkv} == {HIDDEN} and sum(s[0] for s in qkv) == (HEADS + 2 * KV_HEADS) * HEAD_DIM
        assert shapes[f"layers.{i}.mlp.gate_proj.weight"] == shapes[f"layers.{i}.mlp.up_proj.weight"]

    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["num_hidden_layers"] == DRAFT_LAYERS and raw["block_size"] == BLOCK
    assert raw["num_target_layers"] == TARGET_LAYERS and raw["hidden_act"] == "silu"  # SGLang: silu only
    assert ids == [1, 9, 17, 25, 33]  # the public default for 36 target layers, 5 taps
    assert raw["dflash_config"]["mask_token_id"] == 300 and mask_source == UNUSED_ROW  # first row past the tokenizer
    # vLLM captures aux hidden states target_layer_ids + 1 (HF hidden_states index; 0 = embeddings)
    # unless eagle_aux_hidden_state_layer_ids overrides it. The drafter was trained on exactly those.
    assert "eagle_aux_hidden_state_layer_ids" not in raw
    input_ids = torch.randint(4, 300, (1, 12))
    with torch.no_grad():
        hidden_states = target.model(input_ids, output_hidden_states=True).hidden_states
    aux = [i + 1 for i in ids]
    assert max(aux) <= TARGET_LAYERS
    torch.testing.assert_close(torch.cat([hidden_states[j] for j in aux], -1), target.capture(input_ids).context)


def test_bf16_export_keeps_full_precision_weights_for_resume(trained):
    _, drafter, step_dirs, _ = trained
    step_dir = step_dirs["installed"]
    state = load_training_state(step_dir)
    assert state[MASTER_WEIGHTS_KEY]["fc.weight"].dtype == torch.float32
    weights = resume_weights(step_dir, state)
    for name, value in drafter.state_dict().items():
        assert torch.equal(weights[name], value), name


def test_save_dtype_choices_and_the_as_is_default(tmp_path):
    from dflash.config import TrainConfig
    from dflash.run.checkpoint import resolve_save_dtype

    assert resolve_save_dtype("auto", torch.bfloat16) == torch.bfloat16  # training in bf16 exports bf16
    assert resolve_save_dtype("auto", torch.float32) == torch.float32
    assert resolve_save_dtype("float32", torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        resolve_save_dtype("fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        TrainConfig(save_dtype="fp8")
    with pytest.raises(ValueError, match="dpace_alpha must be in"):
        TrainConfig(dpace_alpha=1.5)
    step_dir = save_checkpoint(
        tmp_path,
        1,
        weights={"fc.weight": torch.ones(2, 2)},
        drafter_config={"rope_theta": 1e6, "rope_scaling": None},  # the transformers 4.x form
        training_state={"step": 1},
    )
    assert json.loads((step_dir / "config.json").read_text())["dtype"] == "float32"
    assert MASTER_WEIGHTS_KEY not in load_training_state(step_dir)  # nothing was narrowed
    raw = json.loads((step_dir / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(ValueError, match="no RoPE base"):
        save_checkpoint(tmp_path, 2, weights={}, drafter_config={}, training_state=None)
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()


@pytest.mark.parametrize("form", ["transformers 4", "transformers 5"])
def test_scaled_rope_survives_the_config_in_either_form(form):
    """A yarn-scaled RoPE written from either config form reads back as the installed transformers
    builds it natively (4.x: rope_scaling without rope_theta; 5.x: one rope_parameters dict)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash.drafter.hf_config import portable_config

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    geometry = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096)
    native = Qwen3Config(**geometry, rope_theta=ROPE_THETA, rope_scaling=dict(scaling))
    written = (
        {**geometry, "rope_theta": ROPE_THETA, "rope_scaling": dict(scaling)}
        if form == "transformers 4"
        else {**geometry, "rope_parameters": {**scaling, "rope_theta": ROPE_THETA}}
    )
    raw = json.loads(json.dumps(portable_config(written, dtype=None)))
    assert raw["rope_theta"] == ROPE_THETA and raw["rope_scaling"] == scaling
    assert raw["rope_parameters"] == {**scaling, "rope_theta": ROPE_THETA}
    expected, read = Qwen3RotaryEmbedding(native), Qwen3RotaryEmbedding(Qwen3Config.from_dict(raw))
    torch.testing.assert_close(read.inv_freq, expected.inv_freq)
    assert read.attention_scaling == expected.attention_scaling != 1.0  # yarn's attention factor applies


def test_modeling_file_imports_only_torch_and_transformers(trained):
    """The copy in a checkpoint must load where dflash is not installed (a serving host): the standard
    library, torch and transformers only."""
    import ast
    import sys

    step_dir = trained[2]["installed"]
    source = (step_dir / "modeling_dflash.py").read_text()
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            modules.add(node.module.split(".")[0])
    assert modules - sys.stdlib_module_names <= {"torch", "transformers"}, modules


@pytest.fixture(scope="module", params=[None, False], ids=["default-rule", "is_causal-false"])
def sliding(trained, tmp_path_factory, request):
    """(target, a random drafter of 2 sliding layers (window 6) then 1 full, its step directory), on
    the engines' default causality (no is_causal, as the published drafters) or all bidirectional
    (is_causal false: an --init-from drafter or a run saved so)."""
    target = trained[0]
    config = create_drafter_config(
        target.config,
        3,
        block_size=BLOCK,
        mask_token_id=300,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=6,
        is_causal=request.param,
    )
    torch.manual_seed(1)
    drafter = AnchoredDrafter._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("sliding")
    step_dir = save_checkpoint(
        root, 1, weights=drafter.state_dict(), drafter_config=drafter.config.to_diff_dict(), training_state=None
    )
    return target, drafter, step_dir


def _engine_causal(config: dict, layer: int, *, reads_is_causal: bool = True) -> bool:
    """A stand-in of vLLM main's ``qwen3_dflash.py::_dflash_layer_causal``: a top-level
    ``is_causal`` wins, else ``dflash_config.causal``, else sliding layers are causal (SGLang PR
    #34524 and TensorRT-LLM PR #16914 default alike). ``reads_is_causal=False``: vLLM releases
    before #52816, which read only ``dflash_config.causal``."""
    if reads_is_causal and config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    return config["layer_types"][layer] == "sliding_attention"


def test_a_sliding_drafter_says_its_window_and_causality_the_way_every_loader_reads_it(sliding):
    from transformers import Qwen3Config

    _, drafter, step_dir = sliding
    raw = json.loads((step_dir / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert raw["sliding_window"] == 6 and raw["use_sliding_window"] is True and raw["max_window_layers"] == 3
    # z-lab/dflash builds each layer from a stock Qwen3Config: window = sliding_window on sliding layers,
    # and (its newer model.py) causal = the sliding layers when is_causal is absent, else is_causal.
    stock = Qwen3Config.from_pretrained(step_dir)
    z_lab_windows = [stock.sliding_window if kind == "sliding_attention" else None for kind in stock.layer_types]
    assert z_lab_windows == [layer.self_attn.sliding_window for layer in drafter.layers] == [6, 6, None]
    stock_causal = getattr(stock, "is_causal", None)
    z_lab_causal = [kind == "sliding_attention" if stock_causal is None else stock_causal for kind in stock.layer_types]
    ours = [drafter.config.layer_is_causal(kind) for kind in drafter.config.layer_types]
    assert ours == ([True, True, False] if drafter.config.is_causal is None else [False] * 3)
    # Every engine serves each layer as trained, whichever key its release reads.
    assert z_lab_causal == ours
    assert [_engine_causal(raw, i) for i in range(3)] == ours
    assert [_engine_causal(raw, i, reads_is_causal=False) for i in range(3)] == ours
    if drafter.config.is_causal is None:  # the published drafters' form: neither key
        assert "is_causal" not in raw and "causal" not in raw["dflash_config"]
    else:
        assert raw["is_causal"] is raw["dflash_config"]["causal"] is False


def test_trust_remote_code_applies_the_window(sliding, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils as dynamic_modules
    from transformers import AutoModel

    target, drafter, step_dir = sliding
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    model, info = AutoModel.from_pretrained(step_dir, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    context, block = _block_inputs(target, drafter, context_len=20)  # longer than the window
    positions = torch.arange(context.shape[1] + BLOCK)[None]
    with torch.no_grad():
        served = model.eval()(noise_embedding=block, target_hidden=context, position_ids=positions)
        torch.testing.assert_close(served, drafter.block_hidden(context, block), rtol=1e-5, atol=1e-5)
        # The served file applies the config's causality: made bidirectional it serves another
        # function unless the config already was.
        causal = model.config.is_causal
        model.config.is_causal = False
        bidirectional = model(noise_embedding=block, target_hidden=context, position_ids=positions)
        assert ((bidirectional - served).abs().max() > 1e-4) == (causal is None)
        model.config.is_causal = causal
        # Served with full attention on every layer (what an engine ignoring the window does): not the same.
        model.config.layer_types = ["full_attention"] * 3
        for layer in model.layers:
            layer.self_attn.layer_type = "full_attention"
        assert (model(noise_embedding=block, target_hidden=context, position_ids=positions) - served).abs().max() > 1e-3
