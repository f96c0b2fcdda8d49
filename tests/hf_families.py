"""Tiny configurations (4 blocks of width 64) of every model family the docs' table lists
(``docs/models.md``), for the parity tests of ``tests/runtime/blocks/test_hf_families.py`` and, sharded,
``tests/runtime/replicas/test_shard_outside.py``. Needs ``transformers``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.hf_models import HFModule, swin

WIDTH = 64
VOCAB = 96
CLASSES = 5
MELS, FRAMES = 8, 16  # Whisper's input features: mel bins x frames (its encoder halves the frames)
SAMPLES = 400  # a waveform for Wav2Vec2 and HuBERT (39 frames)


def _decoder(config_cls: Any, model_cls: Any, **extra: Any) -> Callable[..., nn.Module]:
    """A causal LM of the Llama shape family (``model.model.layers``)."""

    def build(layers: int = 4) -> nn.Module:
        config = config_cls(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)  # fmt: skip
        return model_cls(config)

    return build


def gpt2(layers: int = 4) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt_neox(layers: int = 4) -> nn.Module:
    config = transformers.GPTNeoXConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers,
                                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPTNeoXForCausalLM(config)


def _bert_config(layers: int, **extra: Any) -> Any:
    return transformers.BertConfig(hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                                   intermediate_size=2 * WIDTH, vocab_size=VOCAB, max_position_embeddings=32,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)  # fmt: skip


def bert_classifier(layers: int = 4) -> nn.Module:
    return transformers.BertForSequenceClassification(_bert_config(layers, num_labels=CLASSES, classifier_dropout=0.0))


def bert_mlm(layers: int = 4) -> nn.Module:
    """HF's default: the decoder's weight tied to the word embeddings, and its bias one parameter
    under two names (``cls.predictions.bias``, ``cls.predictions.decoder.bias``)."""
    return transformers.BertForMaskedLM(_bert_config(layers))


def roberta_mlm(layers: int = 4) -> nn.Module:
    config = transformers.RobertaConfig(hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                                        intermediate_size=2 * WIDTH, vocab_size=VOCAB, max_position_embeddings=34,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        pad_token_id=0)  # fmt: skip
    return transformers.RobertaForMaskedLM(config)


def distilbert_mlm(layers: int = 4) -> nn.Module:
    config = transformers.DistilBertConfig(dim=WIDTH, n_layers=layers, n_heads=4, hidden_dim=2 * WIDTH,
                                           vocab_size=VOCAB, max_position_embeddings=32, dropout=0.0,
                                           attention_dropout=0.0, pad_token_id=0)  # fmt: skip
    return transformers.DistilBertForMaskedLM(config)


def vit(layers: int = 4) -> nn.Module:
    config = transformers.ViTConfig(hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                                    intermediate_size=2 * WIDTH, image_size=8, patch_size=4, num_channels=3,
                                    num_labels=CLASSES, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.ViTForImageClassification(config)


def whisper(layers: int = 4) -> nn.Module:
    """Whisper's encoder-decoder (8 mel bins, 16 frames); ``layers`` blocks in the encoder and in the decoder."""
    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, encoder_layers=layers,
                                        decoder_layers=layers, d_model=WIDTH, encoder_attention_heads=4,
                                        decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
                                        max_source_positions=FRAMES // 2, max_target_positions=32, dropout=0.0,
                                        attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=1,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def bart(layers: int = 4) -> nn.Module:
    """BART: one embedding shared by the encoder, the decoder and the head (three modules, one weight)."""
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=layers, decoder_layers=layers,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH,
                                     decoder_ffn_dim=2 * WIDTH, max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2, decoder_start_token_id=1)  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def vision_encoder_decoder(layers: int = 4) -> nn.Module:
    """A ViT encoder and a GPT-2 decoder (its head tied to its token embedding) with cross-attention."""
    encoder = transformers.ViTConfig(hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                                     intermediate_size=2 * WIDTH, image_size=8, patch_size=4, num_channels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    decoder = transformers.GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      add_cross_attention=True, is_decoder=True)  # fmt: skip
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return transformers.VisionEncoderDecoderModel(config)


def _speech_config(config_cls: Any, layers: int, **extra: Any) -> Any:
    """Wav2Vec2's or HuBERT's configuration: two convolutions (400 samples: 39 frames)."""
    return config_cls(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=2 * WIDTH, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                      layerdrop=0.0, mask_time_prob=0.0, num_labels=CLASSES, classifier_proj_size=32,
                      pad_token_id=0, **extra)  # fmt: skip


def wav2vec2_classifier(layers: int = 4, **extra: Any) -> nn.Module:
    """Its forward records every layer's hidden states whatever was asked (transformers'
    ``filter_output_hidden_states``) and reads only the last unless ``use_weighted_layer_sum``."""
    return transformers.Wav2Vec2ForSequenceClassification(_speech_config(transformers.Wav2Vec2Config, layers, **extra))


def hubert_classifier(layers: int = 4, **extra: Any) -> nn.Module:
    return transformers.HubertForSequenceClassification(_speech_config(transformers.HubertConfig, layers, **extra))


def t5(layers: int = 4) -> nn.Module:
    config = transformers.T5Config(d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=layers, num_decoder_layers=layers,
                                   num_heads=4, vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def dinov2(layers: int = 4) -> nn.Module:
    """DINOv2: its embeddings hold the [CLS] and mask tokens and the positions beside the patch convolution;
    each block scales its branches by a learned layer scale."""
    config = transformers.Dinov2Config(hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4, mlp_ratio=2,
                                       image_size=8, patch_size=4, num_channels=3, num_labels=CLASSES,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       drop_path_rate=0.0)  # fmt: skip
    return transformers.Dinov2ForImageClassification(config)


def beit(layers: int = 4) -> nn.Module:
    """BEiT: mean pooling through its pooler's norm, a layer scale in each block."""
    config = transformers.BeitConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=layers,
                                     num_attention_heads=4, intermediate_size=2 * WIDTH, image_size=8, patch_size=4,
                                     num_channels=3, num_labels=CLASSES, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)  # fmt: skip
    return transformers.BeitForImageClassification(config)


class Tower(nn.Module):
    """A vision or text tower of a two-tower model (CLIP, SigLIP) under a classifier of its pooled output:
    the towers have no loss of their own."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower
        self.classifier = nn.Linear(tower.config.hidden_size, CLASSES)

    def forward(self, labels: torch.Tensor, **inputs: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.classifier(self.tower(**inputs).pooler_output)
        return SequenceClassifierOutput(loss=nn.functional.cross_entropy(logits, labels), logits=logits)


def _tower_config(config_cls: Any, layers: int, **extra: Any) -> Any:
    return config_cls(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers, num_attention_heads=4,
                      attention_dropout=0.0, **extra)  # fmt: skip


VISION = dict(image_size=8, patch_size=4, num_channels=3)
TEXT = dict(vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, pad_token_id=0, eos_token_id=2)


def clip_vision(layers: int = 4) -> nn.Module:
    """CLIP's vision tower: its embeddings hold the class embedding beside the patch convolution."""
    return Tower(transformers.CLIPVisionModel(_tower_config(transformers.CLIPVisionConfig, layers, **VISION)))


def clip_text(layers: int = 4) -> nn.Module:
    """CLIP's text tower, pooled at its largest token id (its end-of-text token when ``eos_token_id`` is 2)."""
    return Tower(transformers.CLIPTextModel(_tower_config(transformers.CLIPTextConfig, layers, **TEXT)))


def siglip_vision(layers: int = 4) -> nn.Module:
    """SigLIP's vision tower, pooled by its attention head: a probe beside ``nn.MultiheadAttention``, whose
    forward reads its ``out_proj``'s weight without calling it."""
    return Tower(transformers.SiglipVisionModel(_tower_config(transformers.SiglipVisionConfig, layers, **VISION)))


def siglip_text(layers: int = 4) -> nn.Module:
    """SigLIP's text tower, pooled at its last token through its head."""
    return Tower(transformers.SiglipTextModel(_tower_config(transformers.SiglipTextConfig, layers, **TEXT)))


IMAGE_TOKEN = VOCAB - 1  # LLaVA's: 4 per sequence, one per patch of an 8x8 image


def llava(layers: int = 4) -> nn.Module:
    """LLaVA: a CLIP vision tower (2 blocks, its features read at the second to last) and a projector
    before a Llama's ``layers`` blocks; the image's 4 features replace its 4 image tokens."""
    vision = _tower_config(transformers.CLIPVisionConfig, 2, **VISION)
    text = transformers.LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                    pad_token_id=0)  # fmt: skip
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return transformers.LlavaForConditionalGeneration(config)


def _seq2seq(config_cls: Any, model_cls: Any, layers: int, **extra: Any) -> nn.Module:
    """An encoder-decoder of BART's layout (mBART, Pegasus, Marian)."""
    config = config_cls(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * WIDTH,
                        decoder_ffn_dim=2 * WIDTH, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=1,
                        **extra)  # fmt: skip
    return model_cls(config)


def mbart(layers: int = 4) -> nn.Module:
    """mBART: BART with a norm after each stack; its labels shifted to start with their last token."""
    return _seq2seq(transformers.MBartConfig, transformers.MBartForConditionalGeneration, layers, bos_token_id=2)


def pegasus(layers: int = 4) -> nn.Module:
    """Pegasus: fixed sinusoidal positions (parameters that do not train)."""
    return _seq2seq(transformers.PegasusConfig, transformers.PegasusForConditionalGeneration, layers)


def marian(layers: int = 4) -> nn.Module:
    """Marian: sinusoidal positions, and its logits' bias a buffer."""
    return _seq2seq(transformers.MarianConfig, transformers.MarianMTModel, layers)


@dataclass(frozen=True)
class Family:
    """One row of the model-family table: how to build a tiny model, where its blocks are, what its
    data looks like (``tokens``: labels = inputs; ``classes``: a class per sequence; ``images``),
    and whether the pipeline trains it (``refused``: the reason the table gives; ``compared``: the
    cases compared with plain training, for a family outside the grid)."""

    name: str
    build: Callable[..., nn.Module]
    model: type  # what ``build`` returns, or the tower a :class:`Tower` holds (checked by the tests that build it)
    module: str
    data: str = "tokens"
    refused: str = ""
    compared: str = ""
    sharded: bool = False  # trains as plain under data_parallel="shard" (tests/runtime/replicas/test_shard_outside.py)
    converted: str = ""  # what transformers converts in a save_pretrained directory's names when it loads them


def _causal(
    name: str, config_cls: Any, model_cls: type, converted: str = "", sharded: bool = False, **extra: Any
) -> Family:
    """A causal LM whose blocks are ``model.model.layers`` (Llama's layout)."""
    build = _decoder(config_cls, model_cls, **extra)
    return Family(name, build, model_cls, "model.model.layers", converted=converted, sharded=sharded)


T = transformers
STACKED = "per-expert tensors stacked into `experts.*`"
VIT_NAMES = "`encoder.layer.N.attention.attention.query` to `layers.N.attention.q_proj`, ..."
SHARDED_ONLY = "-"  # compared under data_parallel="shard" only
MOE_OFF = dict(output_router_logits=False)  # the auxiliary loss reads every block's router logits after the loop

#: families compared with plain training under ``data_parallel="shard"`` only: name, build, model, module, data
SHARDED_ONLY_ROWS: list[tuple[str, Callable[..., nn.Module], type, str, str]] = [
    ("DINOv2", dinov2, T.Dinov2ForImageClassification, "model.dinov2.encoder.layer", "images"),
    ("BEiT", beit, T.BeitForImageClassification, "model.beit.layers", "images"),
    ("CLIP vision tower", clip_vision, T.CLIPVisionModel, "model.tower.encoder.layers", "images"),
    ("CLIP text tower", clip_text, T.CLIPTextModel, "model.tower.encoder.layers", "classes"),
    ("SigLIP vision tower", siglip_vision, T.SiglipVisionModel, "model.tower.encoder.layers", "images"),
    ("SigLIP text tower", siglip_text, T.SiglipTextModel, "model.tower.encoder.layers", "classes"),
    ("LLaVA", llava, T.LlavaForConditionalGeneration, "model.model.language_model.layers", "image_and_text"),
    ("mBART (split by its encoder)", mbart, T.MBartForConditionalGeneration, "model.model.encoder.layers", "tokens"),
    ("mBART (split by its decoder)", mbart, T.MBartForConditionalGeneration, "model.model.decoder.layers", "tokens"),
    ("Pegasus", pegasus, T.PegasusForConditionalGeneration, "model.model.encoder.layers", "tokens"),
    ("Marian", marian, T.MarianMTModel, "model.model.decoder.layers", "tokens"),
]  # fmt: skip

FAMILIES: list[Family] = [
    Family("GPT-2", gpt2, T.GPT2LMHeadModel, "model.transformer.h", sharded=True),
    _causal("Llama (tied embeddings)", T.LlamaConfig, T.LlamaForCausalLM, sharded=True, tie_word_embeddings=True),
    _causal("Llama (untied)", T.LlamaConfig, T.LlamaForCausalLM, sharded=True, tie_word_embeddings=False),
    _causal("Qwen2", T.Qwen2Config, T.Qwen2ForCausalLM),
    _causal("Qwen3", T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=16),
    _causal("Mistral", T.MistralConfig, T.MistralForCausalLM, sliding_window=8),
    _causal("Gemma", T.GemmaConfig, T.GemmaForCausalLM, head_dim=16),
    _causal("Gemma 2", T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=16, sliding_window=8),
    _causal("Gemma 3 (text)", T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=16, sliding_window=8),
    _causal("Phi-3", T.Phi3Config, T.Phi3ForCausalLM),
    Family("GPT-NeoX", gpt_neox, T.GPTNeoXForCausalLM, "model.gpt_neox.layers", converted="`embed_out` to `lm_head`"),
    _causal(
        "Mixtral (auxiliary loss off)",
        T.MixtralConfig,
        T.MixtralForCausalLM,
        STACKED,
        num_local_experts=4,
        num_experts_per_tok=2,
        **MOE_OFF,
    ),
    _causal(
        "Qwen2-MoE (auxiliary loss off)",
        T.Qwen2MoeConfig,
        T.Qwen2MoeForCausalLM,
        STACKED,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=WIDTH,
        shared_expert_intermediate_size=WIDTH,
        **MOE_OFF,
    ),
    Family(
        "BERT sequence classification",
        bert_classifier,
        T.BertForSequenceClassification,
        "model.bert.encoder.layer",
        data="classes",
    ),
    Family("BERT masked LM (tied)", bert_mlm, T.BertForMaskedLM, "model.bert.encoder.layer"),
    Family("RoBERTa masked LM (tied)", roberta_mlm, T.RobertaForMaskedLM, "model.roberta.encoder.layer"),
    Family(
        "DistilBERT masked LM (tied)", distilbert_mlm, T.DistilBertForMaskedLM, "model.distilbert.transformer.layer"
    ),
    Family(
        "ViT image classification",
        vit,
        T.ViTForImageClassification,
        "model.vit.layers",
        data="images",
        converted=VIT_NAMES,
        sharded=True,
    ),
    Family(
        "Whisper (split by its encoder)",
        whisper,
        T.WhisperForConditionalGeneration,
        "model.model.encoder.layers",
        data="audio_to_text",
        sharded=True,
    ),
    Family(
        "Whisper (split by its decoder)",
        whisper,
        T.WhisperForConditionalGeneration,
        "model.model.decoder.layers",
        data="audio_to_text",
    ),
    Family(
        "BART (split by its encoder)", bart, T.BartForConditionalGeneration, "model.model.encoder.layers", sharded=True
    ),
    Family(
        "BART (split by its decoder)", bart, T.BartForConditionalGeneration, "model.model.decoder.layers", sharded=True
    ),
    Family(
        "ViT + GPT-2 (split by its encoder)",
        vision_encoder_decoder,
        T.VisionEncoderDecoderModel,
        "model.encoder.layers",
        data="image_to_text",
        converted=VIT_NAMES,
        sharded=True,
    ),
    Family(
        "Wav2Vec2 sequence classification",
        wav2vec2_classifier,
        T.Wav2Vec2ForSequenceClassification,
        "model.wav2vec2.encoder.layers",
        data="speech",
        sharded=True,
    ),
    Family(
        "HuBERT sequence classification",
        hubert_classifier,
        T.HubertForSequenceClassification,
        "model.hubert.encoder.layers",
        data="speech",
        sharded=True,
    ),
    *(
        Family(name, build, model, module, data=data, compared=SHARDED_ONLY, sharded=True)
        for name, build, model, module, data in SHARDED_ONLY_ROWS
    ),
    Family(
        "T5",
        t5,
        T.T5ForConditionalGeneration,
        "model.encoder.block",
        compared=(
            "its position biases cross stages; by encoder blocks, 2 stages x `1f1b` (default run), 4 x `1f1b`, "
            "2 processes x `zbv`, 4 x `chimera` (slow); by decoder blocks, 2 and 4 "
            "stages x `1f1b`, 4 x `zero_bubble` (slow)"
        ),
        sharded=True,
    ),
    Family(
        "Swin image classification",
        swin,
        T.SwinForImageClassification,
        "model.swin.encoder.layers",
        data="images",
        compared=(
            "Swin stages return their output's and submodules' structure; within atol 2e-6, 4 one-block Swin "
            "stages, 2 processes x `1f1b` (default run), 4 x `1f1b`, 2 x `interleaved_1f1b`, and `SwinModel` "
            "(`model.encoder.layers`) under the module's own classifier (slow): tests/runtime/blocks/test_hf_models.py"
        ),
    ),
]

BY_NAME = {f.name: f for f in FAMILIES}


def family_data(family: Family, n: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Token sequences with labels = inputs (a causal LM shifts them; a masked LM predicts every
    token), sequences with a class each, small images with a class each, or an image or Whisper's
    input features with a token sequence to predict."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, VOCAB, (n, 12), generator=g)
    classes = torch.randint(0, CLASSES, (n,), generator=g)
    images = torch.randn(n, 3, 8, 8, generator=g)
    inputs, labels = {
        "images": (images, classes),
        "classes": (tokens, classes),
        "audio_to_text": (torch.randn(n, MELS, FRAMES, generator=g), tokens),
        "image_to_text": (images, tokens),
        "speech": (torch.randn(n, SAMPLES, generator=g), classes),
    }.get(family.data, (tokens, tokens))
    if family.data == "image_and_text":  # LLaVA: an image and its 4 image tokens before the text
        text = torch.cat([torch.full((n, 4), IMAGE_TOKEN), tokens.clamp(max=IMAGE_TOKEN - 1)], dim=1)
        return DataLoader(_Pairs(images, text), batch_size=batch_size, shuffle=False)
    return DataLoader(TensorDataset(inputs, labels), batch_size=batch_size, shuffle=False)


class _Pairs(torch.utils.data.Dataset):
    """``((image, tokens), tokens)``: LLaVA's two inputs, its labels the tokens."""

    def __init__(self, images: torch.Tensor, tokens: torch.Tensor) -> None:
        self.images, self.tokens = images, tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.images[i], self.tokens[i]), self.tokens[i]


class FamilyModule(HFModule):
    """A family's unchanged model; its own loss (``labels=``) is the training loss. The inputs'
    keyword follows from their kind: token ids, images (4 dimensions), or audio features (3)."""

    def forward(self, inputs: Any, labels: torch.Tensor) -> Any:
        if isinstance(inputs, (list, tuple)):  # an image and its text (LLaVA)
            return self.model(pixel_values=inputs[0], input_ids=inputs[1], labels=labels)
        if not inputs.is_floating_point():
            return self.model(input_ids=inputs, labels=labels)
        keyword = {4: "pixel_values", 3: "input_features", 2: "input_values"}[inputs.dim()]
        return self.model(**{keyword: inputs}, labels=labels)

    def outputs(self, inputs: torch.Tensor) -> Any:
        if not inputs.is_floating_point():
            return self.model(input_ids=inputs)
        keyword = {4: "pixel_values", 3: "input_features", 2: "input_values"}[inputs.dim()]
        return self.model(**{keyword: inputs})


#: what the slow tests of ``tests/runtime/blocks/test_hf_families.py`` run for every family that trains
STAGES = (2, 4)
SCHEDULES = ("1f1b", "zero_bubble", "interleaved_1f1b")
WEIGHTS_STAGES = 2
TABLE_BEGIN = (
    "<!-- family table: written by `python -m tests.hf_families`, checked by "
    "tests/runtime/blocks/test_hf_families.py -->"
)
TABLE_END = "<!-- end of family table -->"
DOCS = "docs/models.md"


def family_table() -> str:
    """The docs' table of model families, from :data:`FAMILIES` and what the tests run for them."""
    stages = " and ".join(str(s) for s in STAGES)
    schedules = ", ".join(f"`{s}`" for s in SCHEDULES)
    rows = [
        f'| family | model | `module=` | parity ("yes": {stages} stages x {schedules}) | shard (2 stages x 2 '
        f'replicas) | `weights=` ("yes": {WEIGHTS_STAGES} stages, `1f1b`) |',
        "|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        model = f.model.__name__
        sharded = "yes" if f.sharded else "-"
        if f.refused:
            rows.append(f"| {f.name} | `{model}` | `{f.module}` | refused in the first forward: {f.refused} | - | - |")
            continue
        if f.compared:
            rows.append(f"| {f.name} | `{model}` | `{f.module}` | {f.compared} | {sharded} | - |")
            continue
        weights = "yes"
        if f.converted:
            weights += f"; converted ({f.converted})"
        rows.append(f"| {f.name} | `{model}` | `{f.module}` | yes | {sharded} | {weights} |")
    return "\n".join([TABLE_BEGIN, *rows, TABLE_END])


def write_table(path: str = DOCS) -> None:
    """Put :func:`family_table` between its markers in ``path``."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    with open(path, "w") as f:
        f.write(text[:start] + family_table() + text[end:])


if __name__ == "__main__":
    write_table()
