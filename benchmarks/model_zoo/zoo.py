"""The architectures of the model-zoo benchmark (issue 27), each with a small config.

Every config is built by transformers' own config class (``AutoConfig.for_model(model_type,
**sizes)``: 2 layers, width 64, vocabulary 256; 128 tokens, 64-pixel images, a quarter second
of audio, so that at the benchmark's batch of 8 the activations, not the weights and AdamW's
state, make most of the peak),
never read from the network; its natural task is the one tilefit reads from the config
(``tilefit.models.tasks.default_task``). ``load`` holds the workload's sizes (tokens, decoder
labels, audio samples) as ``load_workload`` takes them; ``exempt`` says why the 1% peak target
cannot apply to an architecture (its peak depends on values: a mixture of experts' routing).

LayerDrop and SpecAugment are off in the speech configs (and BART-family's layerdrop is 0 by
default): each step draws them at random on the host, so a real step's peak would depend on
that draw (``tilefit.models.hf._no_random_structure`` turns them off in the trace for the same
reason). Dropout stays on everywhere: its mask has a fixed shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEQ = {"seq_len": 128}
SEQ2SEQ_LOAD = {"seq_len": 128, "target_seq_len": 64}
AUDIO_LOAD = {"input_shape": (4000,), "target_seq_len": 20}  # 0.25 s at 16 kHz

_DECODER = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}
_GQA = {**_DECODER, "num_key_value_heads": 2}
_ENCODER = {**_DECODER}
_BART = {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128,
         "decoder_ffn_dim": 128, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
         "vocab_size": 256, "max_position_embeddings": 128}
_T5 = {"num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4,
       "d_kv": 16, "vocab_size": 256, "decoder_start_token_id": 0, "pad_token_id": 0}
_W2V = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "vocab_size": 32, "conv_dim": [32, 32], "conv_stride": [5, 2],
        "conv_kernel": [10, 3], "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4, "pad_token_id": 0, "layerdrop": 0.0,
        "mask_time_prob": 0.0, "mask_feature_prob": 0.0}
_VIT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "image_size": 64, "patch_size": 8, "num_labels": 10}
# Mamba-2 mixers (Bamba, Falcon-H1, Granite-4 hybrids) and gated-delta-rule layers (Qwen3-Next,
# Qwen3.5, OLMo hybrid), at the zoo's width
_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
           "mamba_n_groups": 1}
_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4}
_STAGES = {"depths": [1, 1], "hidden_sizes": [16, 32], "num_labels": 10, "image_size": 64}


@dataclass(frozen=True)
class Arch:
    model_type: str
    family: str
    sizes: dict[str, Any]
    load: dict[str, Any] = field(default_factory=dict)
    exempt: str | None = None  # why the 1% peak target does not apply
    note: str = ""


_MOE = ("value-dependent: the tokens each expert receives come from the router's top-k over "
        "the logits; the trace assumes balanced routing (Recipe.routing='balanced')")

ZOO: tuple[Arch, ...] = (
    # decoder LMs (causal-lm)
    Arch("gpt2", "decoder", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                             "n_positions": 128}, SEQ),
    Arch("gpt_neox", "decoder", {**_DECODER}, SEQ),
    Arch("gptj", "decoder", {"n_layer": 2, "n_embd": 64, "n_head": 4, "rotary_dim": 8,
                             "vocab_size": 256, "n_positions": 128}, SEQ),
    Arch("llama", "decoder", _GQA, SEQ),
    Arch("mistral", "decoder", _GQA, SEQ),
    Arch("qwen2", "decoder", _GQA, SEQ),
    Arch("qwen3", "decoder", {**_GQA, "head_dim": 16}, SEQ),
    Arch("gemma", "decoder", {**_GQA, "head_dim": 16}, SEQ),
    Arch("gemma2", "decoder", {**_GQA, "head_dim": 16}, SEQ),
    Arch("phi", "decoder", {**_DECODER}, SEQ),
    Arch("phi3", "decoder", {**_GQA, "pad_token_id": 0}, SEQ),
    Arch("falcon", "decoder", {"num_hidden_layers": 2, "hidden_size": 64,
                               "num_attention_heads": 4, "vocab_size": 256}, SEQ),
    Arch("opt", "decoder", {"num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128,
                            "num_attention_heads": 4, "vocab_size": 256,
                            "word_embed_proj_dim": 64, "max_position_embeddings": 128}, SEQ),
    Arch("bloom", "decoder", {"n_layer": 2, "hidden_size": 64, "n_head": 4,
                              "vocab_size": 256}, SEQ),
    Arch("starcoder2", "decoder", _GQA, SEQ),
    Arch("olmo", "decoder", _GQA, SEQ),
    Arch("olmo2", "decoder", _GQA, SEQ),
    Arch("stablelm", "decoder", _GQA, SEQ),
    Arch("cohere", "decoder", _GQA, SEQ),
    Arch("granite", "decoder", _GQA, SEQ),
    Arch("mixtral", "decoder-moe", {**_GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
         SEQ, exempt=_MOE),
    Arch("qwen2_moe", "decoder-moe", {**_GQA, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 64,
                                      "shared_expert_intermediate_size": 64}, SEQ, exempt=_MOE),
    Arch("qwen3_moe", "decoder-moe", {**_GQA, "head_dim": 16, "num_experts": 4,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                      "decoder_sparse_step": 1, "mlp_only_layers": []},
         SEQ, exempt=_MOE),
    Arch("olmoe", "decoder-moe", {**_DECODER, "num_key_value_heads": 4, "num_experts": 4,
                                  "num_experts_per_tok": 2, "eos_token_id": 2,
                                  "pad_token_id": 1}, SEQ, exempt=_MOE),
    Arch("deepseek_v3", "decoder-moe", {**_DECODER, "num_key_value_heads": 4,
                                        "n_routed_experts": 4, "n_shared_experts": 1,
                                        "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                                        "n_group": 1, "topk_group": 1,
                                        "moe_intermediate_size": 64, "q_lora_rank": 32,
                                        "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                        "qk_nope_head_dim": 8, "v_head_dim": 16,
                                        "rope_scaling": None}, SEQ, exempt=_MOE),
    Arch("gpt_oss", "decoder-moe", {**_GQA, "head_dim": 16, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "sliding_window": 64,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_scaling": None}, SEQ, exempt=_MOE),
    # state-space (causal-lm)
    Arch("mamba", "state-space", {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 256,
                                  "state_size": 8}, SEQ),
    Arch("mamba2", "state-space", {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 256,
                                   "state_size": 16, "num_heads": 8, "head_dim": 16,
                                   "n_groups": 1, "expand": 2, "chunk_size": 16}, SEQ),
    # hybrids: state-space or linear-attention layers beside attention (their kernels from
    # mamba-ssm, causal-conv1d or flash-linear-attention traced as transformers' reference
    # PyTorch code: tilefit.tracing.kernels)
    Arch("falcon_mamba", "state-space", {"num_hidden_layers": 2, "hidden_size": 64,
                                         "state_size": 8, "vocab_size": 256,
                                         "intermediate_size": 128, "time_step_rank": 4}, SEQ),
    Arch("jamba", "hybrid-moe", {**_GQA, "num_experts": 4, "num_experts_per_tok": 2,
                                 "expert_layer_period": 2, "expert_layer_offset": 1,
                                 "attn_layer_period": 2, "attn_layer_offset": 1,
                                 "mamba_d_state": 8, "mamba_dt_rank": 4,
                                 "use_mamba_kernels": False}, SEQ, exempt=_MOE),
    Arch("bamba", "hybrid", {**_GQA, **_MAMBA2, "attn_layer_indices": [1]}, SEQ),
    Arch("falcon_h1", "hybrid", {**_GQA, **_MAMBA2, "mamba_d_ssm": 128, "head_dim": 16}, SEQ),
    Arch("granitemoehybrid", "hybrid-moe", {**_GQA, **_MAMBA2, "num_local_experts": 4,
                                            "num_experts_per_tok": 2,
                                            "shared_intermediate_size": 64,
                                            "layer_types": ["mamba", "attention"]},
         SEQ, exempt=_MOE),
    Arch("nemotron_h", "hybrid", {"num_hidden_layers": 3, "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
                                  "layers_block_type": ["mamba", "attention", "mlp"],
                                  "mamba_num_heads": 8, "mamba_head_dim": 16,
                                  "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16}, SEQ),
    Arch("lfm2", "hybrid", {**_GQA, "layer_types": ["conv", "full_attention"]}, SEQ),
    Arch("qwen3_5_text", "hybrid", {**_GQA, **_LINEAR, "head_dim": 16,
                                    "layer_types": ["linear_attention", "full_attention"]}, SEQ),
    Arch("qwen3_next", "hybrid-moe", {**_GQA, **_LINEAR, "head_dim": 16, "num_experts": 4,
                                      "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                      "shared_expert_intermediate_size": 64,
                                      "layer_types": ["linear_attention", "full_attention"]},
         SEQ, exempt=_MOE),
    Arch("olmo_hybrid", "hybrid", {**_DECODER, "num_key_value_heads": 4,
                                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
                                   "linear_value_head_dim": 16, "linear_num_key_heads": 4,
                                   "linear_num_value_heads": 4, "pad_token_id": 1,
                                   "eos_token_id": 2,
                                   "layer_types": ["linear_attention", "full_attention"]}, SEQ),
    # encoders (masked-lm)
    Arch("bert", "encoder", _ENCODER, SEQ),
    Arch("roberta", "encoder", {**_ENCODER, "max_position_embeddings": 130}, SEQ),
    Arch("xlm-roberta", "encoder", {**_ENCODER, "max_position_embeddings": 130}, SEQ),
    Arch("deberta-v2", "encoder", _ENCODER, SEQ),
    Arch("distilbert", "encoder", {"n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4,
                                   "vocab_size": 256, "max_position_embeddings": 128}, SEQ),
    Arch("electra", "encoder", {**_ENCODER, "embedding_size": 64}, SEQ),
    Arch("albert", "encoder", {**_ENCODER, "embedding_size": 32}, SEQ),
    # encoder-decoders (seq2seq-lm)
    Arch("t5", "seq2seq", _T5, SEQ2SEQ_LOAD),
    Arch("mt5", "seq2seq", _T5, SEQ2SEQ_LOAD),
    Arch("bart", "seq2seq", _BART, SEQ2SEQ_LOAD),
    Arch("mbart", "seq2seq", _BART, SEQ2SEQ_LOAD),
    Arch("pegasus", "seq2seq", {**_BART, "pad_token_id": 0}, SEQ2SEQ_LOAD),
    Arch("marian", "seq2seq", {**_BART, "pad_token_id": 0, "decoder_start_token_id": 0},
         SEQ2SEQ_LOAD),
    # speech (speech-seq2seq, ctc)
    Arch("whisper", "speech", {**{k: v for k, v in _BART.items() if k != "max_position_embeddings"},
                               "num_mel_bins": 16, "max_source_positions": 128,
                               "max_target_positions": 64, "decoder_start_token_id": 1,
                               "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    Arch("wav2vec2", "speech", _W2V, AUDIO_LOAD),
    Arch("hubert", "speech", _W2V, AUDIO_LOAD),
    Arch("wavlm", "speech", _W2V, AUDIO_LOAD),
    Arch("data2vec-audio", "speech", _W2V, AUDIO_LOAD),
    # vision (image-cls)
    Arch("vit", "vision", _VIT),
    Arch("deit", "vision", _VIT),
    Arch("beit", "vision", _VIT),
    Arch("dinov2", "vision", _VIT),
    Arch("swin", "vision", {"image_size": 64, "patch_size": 4, "embed_dim": 16,
                            "depths": [1, 1], "num_heads": [2, 2], "window_size": 4,
                            "num_labels": 10}),
    Arch("convnext", "vision", {**_STAGES, "num_stages": 2}),
    Arch("resnet", "vision", {**_STAGES, "embedding_size": 16, "layer_type": "basic"}),
    Arch("regnet", "vision", {**_STAGES, "embedding_size": 16, "groups_width": 8}),
    Arch("mobilenet_v2", "vision", {"depth_multiplier": 0.35, "image_size": 64,
                                    "num_labels": 10}),
    Arch("efficientnet", "vision", {"width_coefficient": 0.1, "depth_coefficient": 0.1,
                                    "image_size": 64, "hidden_dim": 128, "num_labels": 10}),
    # multimodal
    Arch("clip", "multimodal", {
        "text_config": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 4, "vocab_size": 256,
                        "max_position_embeddings": 32},
        "vision_config": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "image_size": 64, "patch_size": 8},
        "projection_dim": 32, "num_labels": 10},
        note="no contrastive task in tilefit: CLIP trains as its image classifier "
             "(CLIPForImageClassification, transformers' image-cls head for clip)"),
)
