"""Random-weight target shapes of the benchmarks, from the public configs: Qwen3-8B and Qwen3-32B
(dense; the 32B is a 64 x 5120 27B-class shape) and Qwen3.6-27B (the hybrid this project exists for:
64 layers in 16 x (3 Gated DeltaNet + 1 gated attention), as its checkpoint's ``text_config``), plus
tiny ones for CPU smoke tests. The benchmarks import it from their own folder."""

#: Random-weight target shapes, from the public configs (Qwen3-8B, Qwen3-32B: a dense 64 x 5120;
#: Qwen3.6-27B: the hybrid the project exists for, as its multimodal checkpoint ships) plus tiny
#: ones for the CPU smoke test. ``arch`` picks the config class; the rest are its fields.
_QWEN36_ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
SHAPES = {
    "qwen3-8b": dict(
        arch="qwen3",
        num_hidden_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        rope_theta=1e6,
    ),
    "qwen3-32b": dict(
        arch="qwen3",
        num_hidden_layers=64,
        hidden_size=5120,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=25600,
        vocab_size=151936,
        rope_theta=1e6,
    ),
    "qwen3.6-27b": dict(
        arch="qwen3_5",
        num_hidden_layers=64,  # 16 x (3 Gated DeltaNet + 1 gated attention)
        hidden_size=5120,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        vocab_size=248320,
        rope_parameters=_QWEN36_ROPE,
    ),
    "tiny": dict(
        arch="qwen3",
        num_hidden_layers=8,  # 5 distinct tapped layers need >= 8
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=4096,  # the embedded tokenizer's
        rope_theta=1e6,
    ),
    "tiny-qwen3.6": dict(
        arch="qwen3_5",
        num_hidden_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        vocab_size=4096,
        rope_parameters={**_QWEN36_ROPE, "mrope_section": [1, 1, 0]},
    ),
}

#: Qwen3.6-27B's vision tower (its checkpoint's vision_config): written into the hybrid configs so the
#: target directory is the multimodal checkpoint form; the trainer loads the language model only.
QWEN36_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120, patch_size=16
)


def dense_text_config(shape: str, layers: int, **overrides):
    """A transformers ``Qwen3Config`` of a dense ``shape``, its first ``layers`` layers, untied, with
    ``overrides`` of its fields."""
    from transformers import Qwen3Config

    fields = {k: v for k, v in SHAPES[shape].items() if k != "arch"}
    fields.update(num_hidden_layers=layers, tie_word_embeddings=False, **overrides)
    return Qwen3Config(**fields)


def hybrid_text_config(shape: str, layers: int):
    """A transformers ``Qwen3_5TextConfig`` of a hybrid ``shape``, its first ``layers`` layers."""
    from transformers import Qwen3_5TextConfig

    fields = {k: v for k, v in SHAPES[shape].items() if k != "arch"}
    fields.update(num_hidden_layers=layers, max_position_embeddings=262144, tie_word_embeddings=False)
    return Qwen3_5TextConfig(**fields)
