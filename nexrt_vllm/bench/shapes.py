"""The real model shapes the benchmarks run: the published Qwen3.5-2B / Qwen3.5-35B-A3B configs
(HF `config.json` fields) and the family's transformers defaults."""

_COMMON = dict(vocab_size=248320, hidden_size=2048, head_dim=256, linear_num_key_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               full_attention_interval=4, rms_norm_eps=1e-6, hidden_act="silu", dtype="bfloat16",
               max_position_embeddings=262144,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
SHAPES = {
    "2b": dict(_COMMON, architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, linear_num_value_heads=16, intermediate_size=6144, tie_word_embeddings=True),
    "35b": dict(_COMMON, architectures=["Qwen3_5MoeForCausalLM"], num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, tie_word_embeddings=False),
}
NAMES = {"2b": "Qwen3.5-2B", "35b": "Qwen3.5-35B-A3B"}
HF_TOKS = {"2b": 12.9, "35b": 6.4}  # plain HF transformers on the H200, tok/s: the baseline of decode_bench's xHF
GRAFT_ARCH = {"2b": "qwen3_5", "35b": "qwen3_5_moe"}  # the tiny family each shape can carry (graft.py)
