"""The models of bench/zoo.py: name -> build() -> (model, kwargs), random weights, small inputs, no downloads.

- every torchvision classification model (`torchvision.models.list_models(module=torchvision.models)`),
  weights=None, batch 2 (train-mode BatchNorm needs more than one value per channel) of 64x64 images;
  ViTs are built with image_size=32 (the constructor's position embeddings fix the input size);
- transformers architectures from small configs (hidden 32, 2 layers, 4 heads, vocab 99, `use_cache=False`),
  through the class users call (XModel for encoders, XForCausalLM, XForConditionalGeneration,
  XForImageClassification, ...), batch 2, 8 tokens.
Models over MAX_PARAMS parameters (MAX_PARAMS_CUDA on a GPU) are skipped (torchvision: its weights' metadata; others counted on the meta device).
"""
from __future__ import annotations

from typing import Callable

import torch

MAX_PARAMS = 300_000_000        # on the CPU (its time and memory); a GPU takes every model
MAX_PARAMS_CUDA = 2_000_000_000
BATCH, SEQ, VOCAB = 2, 8, 99

# Per-model input sizes for the torchvision models that need more than 64x64 or take their size in the constructor.
TV_INPUT = {"inception_v3": 299, "maxvit_t": 224}  # inception_v3: its auxiliary head needs 299x299
TV_KWARGS = {"inception_v3": dict(init_weights=False), "googlenet": dict(init_weights=False),
             "vit_b_16": dict(image_size=32), "vit_b_32": dict(image_size=32), "vit_l_16": dict(image_size=32),
             "vit_l_32": dict(image_size=32), "vit_h_14": dict(image_size=28)}
TV_SIZE_FROM_KWARGS = {"vit_b_16": 32, "vit_b_32": 32, "vit_l_16": 32, "vit_l_32": 32, "vit_h_14": 28}


def torchvision_names() -> list[str]:
    import torchvision
    return sorted(torchvision.models.list_models(module=torchvision.models))


def torchvision_model(name: str) -> Callable:
    def build(device: str = "cpu"):
        import torchvision
        with torch.device(device):
            model = torchvision.models.get_model(name, weights=None, **TV_KWARGS.get(name, {}))
        size = TV_SIZE_FROM_KWARGS.get(name, TV_INPUT.get(name, 64))
        return model, {"x": torch.randn(BATCH, 3, size, size)}
    return build


# ---------------------------------------------------------------- transformers

def _ids(n: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (BATCH, n))


def text() -> dict:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def ids_only() -> dict:
    return {"input_ids": _ids()}


def seq2seq() -> dict:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": _ids()}


def image(size: int = 32) -> Callable[[], dict]:
    return lambda: {"pixel_values": torch.randn(BATCH, 3, size, size)}


def audio() -> dict:
    return {"input_values": torch.randn(BATCH, 400)}


def whisper_inputs() -> dict:
    return {"input_features": torch.randn(BATCH, 16, 32), "decoder_input_ids": _ids()}


def text_image() -> dict:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(BATCH, 3, 32, 32)}


BERTLIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=64)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=37, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCDEC = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, image_size=32,
           patch_size=4, num_labels=10)
AUDIO = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
             conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
             num_conv_pos_embedding_groups=2, mask_time_prob=0.0)


def d(base: dict, **over) -> dict:
    return {**base, **over}


# name -> (config class, model class, inputs, config kwargs)
HF: dict[str, tuple[str, str, Callable[[], dict], dict]] = {
    # encoders
    "bert": ("BertConfig", "BertModel", text, BERTLIKE),
    "roberta": ("RobertaConfig", "RobertaModel", text, BERTLIKE),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel", text, BERTLIKE),
    "deberta": ("DebertaConfig", "DebertaModel", text, BERTLIKE),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", text, BERTLIKE),
    "electra": ("ElectraConfig", "ElectraModel", text, d(BERTLIKE, embedding_size=16)),
    "albert": ("AlbertConfig", "AlbertModel", text, d(BERTLIKE, embedding_size=16)),
    "distilbert": ("DistilBertConfig", "DistilBertModel", text,
                   dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64)),
    "mpnet": ("MPNetConfig", "MPNetModel", text, BERTLIKE),
    "convbert": ("ConvBertConfig", "ConvBertModel", text, d(BERTLIKE, embedding_size=32)),
    "roformer": ("RoFormerConfig", "RoFormerModel", text, d(BERTLIKE, embedding_size=32)),
    "megatron_bert": ("MegatronBertConfig", "MegatronBertModel", text, BERTLIKE),
    "ernie": ("ErnieConfig", "ErnieModel", text, BERTLIKE),
    "mobilebert": ("MobileBertConfig", "MobileBertModel", text,
                   d(BERTLIKE, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                     num_feedforward_networks=2)),
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertModel", text,
                    d(BERTLIKE, embedding_size=32, intermediate_size=32)),
    "longformer": ("LongformerConfig", "LongformerModel", text, d(BERTLIKE, attention_window=4)),
    "big_bird": ("BigBirdConfig", "BigBirdModel", text, d(BERTLIKE, attention_type="original_full")),
    "nystromformer": ("NystromformerConfig", "NystromformerModel", text,
                      d(BERTLIKE, num_landmarks=4, segment_means_seq_len=SEQ)),
    "funnel": ("FunnelConfig", "FunnelModel", text,
               dict(vocab_size=VOCAB, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=37)),
    # decoders
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", ids_only,
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", ids_only,
                dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], max_position_embeddings=64, window_size=4,
                     bos_token_id=1, eos_token_id=2)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", ids_only,
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, bos_token_id=1,
                  eos_token_id=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", ids_only, d(DECODER, rotary_pct=0.5)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", text, DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", text, d(DECODER, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", text, DECODER),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", text, d(DECODER, head_dim=8)),
    "phi": ("PhiConfig", "PhiForCausalLM", text, DECODER),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", text, d(DECODER, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", text, d(DECODER, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", text, d(DECODER, head_dim=8, sliding_window=4)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", text, DECODER),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", text, DECODER),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", text, DECODER),
    "cohere": ("CohereConfig", "CohereForCausalLM", text, DECODER),
    "granite": ("GraniteConfig", "GraniteForCausalLM", text, DECODER),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", text, DECODER),
    "opt": ("OPTConfig", "OPTForCausalLM", text,
            dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=37,
                 word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    "bloom": ("BloomConfig", "BloomForCausalLM", text, dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
    "falcon": ("FalconConfig", "FalconForCausalLM", text,
               dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", text,
                d(DECODER, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", text,
                  d(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16)),
    "mamba": ("MambaConfig", "MambaForCausalLM", ids_only,
              dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "ctrl": ("CTRLConfig", "CTRLLMHeadModel", ids_only, dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, dff=37)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", ids_only,
                dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64,
                     bos_token_id=1, eos_token_id=2)),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", text, BERTLIKE),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", text,
             dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37,
                  max_position_embeddings=64)),
    "mpt": ("MptConfig", "MptForCausalLM", text, dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2)),
    # encoder-decoders
    "t5": ("T5Config", "T5ForConditionalGeneration", seq2seq,
           dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4)),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", seq2seq,
            dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4)),
    "bart": ("BartConfig", "BartForConditionalGeneration", seq2seq, ENCDEC),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", seq2seq, ENCDEC),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", seq2seq, ENCDEC),
    "marian": ("MarianConfig", "MarianMTModel", seq2seq, d(ENCDEC, decoder_vocab_size=VOCAB)),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForConditionalGeneration", seq2seq, ENCDEC),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", seq2seq, ENCDEC),
    "plbart": ("PLBartConfig", "PLBartForConditionalGeneration", seq2seq, ENCDEC),
    # vision
    "vit": ("ViTConfig", "ViTForImageClassification", image(), VIT),
    "deit": ("DeiTConfig", "DeiTForImageClassification", image(), VIT),
    "beit": ("BeitConfig", "BeitForImageClassification", image(), VIT),
    "data2vec_vision": ("Data2VecVisionConfig", "Data2VecVisionForImageClassification", image(),
                        d(VIT, use_relative_position_bias=True)),
    "dinov2": ("Dinov2Config", "Dinov2Model", image(), VIT),
    "swin": ("SwinConfig", "SwinForImageClassification", image(),
             dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                  num_labels=10)),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", image(),
                 dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
    "segformer": ("SegformerConfig", "SegformerForSemanticSegmentation", image(),
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[4, 4],
                       decoder_hidden_size=32, num_labels=10)),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", image(),
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", image(),
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, num_labels=10)),
    "poolformer": ("PoolFormerConfig", "PoolFormerForImageClassification", image(),
                   dict(num_encoder_blocks=2, depths=[1, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                        strides=[4, 2], padding=[2, 1], num_labels=10)),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", image(64),
                  dict(image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                       num_labels=10)),
    # audio
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", audio, AUDIO),
    "hubert": ("HubertConfig", "HubertModel", audio, AUDIO),
    "wavlm": ("WavLMConfig", "WavLMModel", audio, d(AUDIO, num_buckets=16, max_bucket_distance=32)),
    "data2vec_audio": ("Data2VecAudioConfig", "Data2VecAudioModel", audio, AUDIO),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", whisper_inputs,
                d(ENCDEC, num_mel_bins=16, max_source_positions=16, max_target_positions=64, begin_suppress_tokens=None,
                  suppress_tokens=None)),
    # multimodal
    "clip": ("CLIPConfig", "CLIPModel", text_image,
             dict(text_config=d(BERTLIKE, bos_token_id=1, eos_token_id=2),
                  vision_config=d(VIT, num_labels=None), projection_dim=16)),
    "siglip": ("SiglipConfig", "SiglipModel", text_image,
               dict(text_config=BERTLIKE, vision_config=d(VIT, num_labels=None))),
    "blip": ("BlipConfig", "BlipModel", text_image,
             dict(text_config=BERTLIKE, vision_config=d(VIT, num_labels=None), projection_dim=16)),
}


def _clean(cfg: dict) -> dict:
    """num_labels=None means "leave the config's default" (sub-configs of multimodal models take none)."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            v = _clean(v)
        if v is not None:
            out[k] = v
    return out


def hf_model(name: str) -> Callable:
    cfg_name, model_name, inputs, cfg = HF[name]

    def build(device: str = "cpu"):
        import transformers
        config = getattr(transformers, cfg_name)(**_clean(cfg))
        config.use_cache = False
        for sub in ("text_config", "vision_config"):
            if hasattr(config, sub):
                getattr(config, sub).use_cache = False
        with torch.device(device):
            model = getattr(transformers, model_name)(config)
        return model, inputs()
    return build


def all_models() -> dict[str, Callable]:
    """Every zoo model by name: torchvision's under their own names, transformers' as hf_<name>."""
    models = {n: torchvision_model(n) for n in torchvision_names()}
    models.update({f"hf_{n}": hf_model(n) for n in HF})
    return models


def param_count(name: str) -> int:
    """Parameters of the model: torchvision's from its weights' metadata, others counted on the meta device."""
    if not name.startswith("hf_"):
        import torchvision
        return torchvision.models.get_model_weights(name).DEFAULT.meta["num_params"]
    model, _ = all_models()[name]("meta")
    return sum(p.numel() for p in model.parameters())
