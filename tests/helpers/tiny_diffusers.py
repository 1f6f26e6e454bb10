"""Tiny random-weight diffusers folders (SD 1.5, SD 2, SDXL, SD3, FLUX, Qwen-Image, Qwen-Image-Edit
(and Plus), Wan 2.1, Wan
2.2 A14B's two experts, Z-Image, FLUX.2) in Hub layout.

`write_tiny_folder(kind, folder)` saves what `XPipeline.save_pretrained(folder)` writes for a real
checkpoint of that family (model_index.json, one subfolder per component, tokenizers, scheduler
config), with components 1000x or more smaller, so tests and demos load, split and train real
diffusers/transformers classes in seconds without the network. Run
`python -m tests.helpers.tiny_diffusers KIND FOLDER [--seed N] [--max-shard-size S]` to write one.
"""

from __future__ import annotations

import argparse
import shutil
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KINDS = ("sd", "sd2", "sdxl", "sd3", "flux")  # the CLIP / T5 kinds
QWEN_KINDS = ("qwenimage",)  # Qwen2.5-VL prompts, a video VAE
VIDEO_KINDS = ("wan", "wan22")  # UMT5 prompts, a causal 3D VAE, video transformer(s)
CHAT_KINDS = ("zimage", "flux2")  # chat-templated decoder-only text encoders (Qwen3, Mistral 3)
EDIT_KINDS = ("flux_kontext",)  # FLUX's parts behind an editing pipeline (a reference image)
I2V_KINDS = ("wan_i2v", "wan22_i2v")  # Wan image-to-video (2.1 with CLIP; 2.2 A14B's experts)
# Qwen-Image's parts behind QwenImageEdit(Plus)Pipeline: a Qwen2.5-VL that sees the references
QWEN_EDIT_KINDS = ("qwenimage_edit", "qwenimage_edit_plus")
ALL_KINDS = (
    *KINDS,
    *QWEN_KINDS,
    *VIDEO_KINDS,
    *CHAT_KINDS,
    *EDIT_KINDS,
    *QWEN_EDIT_KINDS,
    *I2V_KINDS,
)

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512
SD_SCHEDULE = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
SD_SCHEDULE |= {"num_train_timesteps": 1000, "steps_offset": 1}
SD_VAE_BLOCKS = 4  # 3 downsamplings: latents are 1/8 of the image side, as in every real VAE here


# ---------------------------------------------------------------- tokenizers


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2/CLIP's bytes_to_unicode)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def clip_vocab() -> dict[str, int]:
    """A CLIP BPE vocab without merges: every byte alone and as word end, then the two specials."""
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}


def clip_tokenizer() -> Any:
    """A CLIPTokenizer built in memory (514 ids): any text encodes, one id per byte."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=clip_vocab(), merges=[], model_max_length=CLIP_MAX_LENGTH)


def t5_vocab() -> list[tuple[str, float]]:
    """A Unigram vocab in T5's order (<pad> 0, </s> 1, <unk> 2), then '▁', '▁'+char, and chars."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in string.ascii_lowercase + string.digits]
    pieces += [(c, -4.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return pieces


def t5_tokenizer() -> Any:
    """A T5Tokenizer built in memory (134 ids, no sentinels); unknown characters map to <unk>."""
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=t5_vocab(), extra_ids=0, model_max_length=T5_MAX_LENGTH)


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_tokenizer(template: str | None = None, specials: Sequence[str] = QWEN_SPECIALS) -> Any:
    """A Qwen2Tokenizer built in memory: every byte, plus one token per piece of
    QwenImagePipeline's prompt template (or `template`), so its system prefix is 34 tokens as
    with the real vocabulary (the pipeline drops exactly that many); other text encodes byte by
    byte; `specials` are single tokens."""
    import re

    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    pre_tokenizer = Qwen2Tokenizer(vocab=dict(vocab), merges=[])._tokenizer.pre_tokenizer
    merges = []
    pattern = "|".join(re.escape(s) for s in specials)
    for part in re.split(pattern, (template or _qwen_template()).replace("{}", "")):
        for piece, _ in pre_tokenizer.pre_tokenize_str(part):
            for end in range(2, len(piece) + 1):  # one merge chain per piece, left to right
                if piece[:end] not in vocab:
                    vocab[piece[:end]] = len(vocab)
                    merges.append((piece[: end - 1], piece[end - 1]))
    vocab |= {special: len(vocab) + i for i, special in enumerate(specials)}
    return Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=list(specials[1:]))


def qwen_edit_tokenizer(plus: bool) -> Any:
    """qwen_tokenizer over QwenImageEdit(Plus)Pipeline's template (its system prefix is the 64
    tokens the pipeline drops) and Qwen2.5-VL's vision marks ("Picture 1: " byte by byte)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls.__new__(cls)
    cls.__init__(pipe, None, None, None, None, None, None)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    tokenizer = qwen_tokenizer(template, (*QWEN_SPECIALS, *VISION_SPECIALS))
    prefix = template.split("{}")[0].split("<|vision_start|>")[0]
    system = prefix.split("<|im_start|>")[1].split("<|im_end|>")[0]  # "system\nDescribe ..."
    pieces = tokenizer._tokenizer.pre_tokenizer.pre_tokenize_str(system)
    excess = len(tokenizer(prefix).input_ids) - drop
    pairs = [pieces[i][1][0] for i in range(0, 2 * excess, 2)]  # where each joined pair starts
    ends = [pieces[i + 1][1][1] for i in range(0, 2 * excess, 2)]
    tokenizer.add_tokens([system[a:b] for a, b in zip(pairs, ends, strict=True)])
    return tokenizer  # pairs of pieces joined until the system prefix is `drop` tokens, as real


# The generation prompt of Qwen3's chat template, as ZImagePipeline applies it (enable_thinking):
# the user turn, then the assistant's turn opened (an empty think block when thinking is off).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def qwen3_tokenizer() -> Any:
    """A byte-level Qwen2Tokenizer (Qwen3's class) with Qwen3's chat-template generation prompt:
    every byte one token, plus the chat specials."""
    from transformers import Qwen2Tokenizer

    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    vocab |= {special: len(vocab) + i for i, special in enumerate(QWEN_SPECIALS)}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        extra_special_tokens=list(QWEN_SPECIALS[1:]),
        chat_template=QWEN3_CHAT_TEMPLATE,
    )


# Mistral 3's template for text-only turns as Flux2Pipeline sends them (content as a list of
# {"type": "text"} parts): BOS, the system prompt, each user turn in [INST] ... [/INST].
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- set text = message.content[0].text if message.content is not string "
    "else message.content %}"
    "{%- if message.role == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message.role == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
MISTRAL_MARKS = ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")


def mistral_tokenizer() -> Any:
    """A byte-level tokenizer standing in for FLUX.2's Mistral 3 one (<unk> 0, <s> 1, </s> 2,
    <pad> 3, the chat marks, then every byte) with its text-only chat template."""
    from transformers import Qwen2Tokenizer

    tokens = [*MISTRAL_SPECIALS, *MISTRAL_MARKS, *_byte_symbols()]
    return Qwen2Tokenizer(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[],
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=list(MISTRAL_MARKS),
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def _qwen_template() -> str:
    """QwenImagePipeline's prompt template, read from a pipeline built without components."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.__new__(QwenImagePipeline)
    QwenImagePipeline.__init__(pipe, None, None, None, None, None)
    return pipe.prompt_template_encode


# ---------------------------------------------------------------- text encoders


def _clip_text(hidden: int, *, projection: bool, act: str = "quick_gelu") -> Any:
    """A 2-layer CLIP text model over `clip_vocab()` (with a projection head when `projection`)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = len(clip_vocab())
    config = CLIPTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act=act,
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5_settings(d_model: int) -> dict[str, Any]:
    """A 2-layer T5 v1.1-style encoder's config fields (gated GELU, untied head) over
    `t5_vocab()`: the same for T5 (SD3, FLUX) and UMT5 (Wan)."""
    return {
        "vocab_size": len(t5_vocab()),
        "d_model": d_model,
        "d_kv": 8,
        "d_ff": 2 * d_model,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def _t5_encoder(d_model: int = 32) -> Any:
    """A tiny T5 encoder (SD3's and FLUX's text encoder)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**_t5_settings(d_model)))


def _umt5_encoder(d_model: int = 32) -> Any:
    """A tiny UMT5 encoder (Wan's text encoder: per-layer relative attention bias)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**_t5_settings(d_model)))


def _qwen_vl(vocab_size: int, hidden: int = 32, tokens: dict[str, int] | None = None) -> Any:
    """A 2-layer Qwen2.5-VL (1-block vision tower) whose last hidden states are the prompt
    embeddings; mrope_section sums to half the head size (8 / 2)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "rope_theta": 10000.0,
        "bos_token_id": None,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": vocab_size - 3,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **(tokens or {}))
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen3(vocab_size: int, hidden: int = 32) -> Any:
    """A 3-layer Qwen3Model (Z-Image's text encoder; the pipeline reads hidden_states[-2])."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=vocab_size - 3,
        eos_token_id=vocab_size - 1,
    )
    return Qwen3Model(config)


def _mistral3(vocab_size: int, hidden: int = 16) -> Any:
    """A Mistral3ForConditionalGeneration (1-layer Pixtral tower) with 30 text layers, as
    Flux2Pipeline reads hidden states 10, 20 and 30 by default."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {
        "model_type": "mistral",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": 1024,
        "num_attention_heads": 4,
        "num_hidden_layers": 30,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 32,
        "image_size": 30,
        "patch_size": 6,
        "num_channels": 3,
    }
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=0,
        vision_feature_layer=-1,
        spatial_merge_size=1,
    )
    return Mistral3ForConditionalGeneration(config)


# ---------------------------------------------------------------- VAE, denoisers, schedulers


def _vae(latent_channels: int, scaling: float, shift: float | None = None) -> Any:
    """A 4-block AutoencoderKL (x8 downsampling); SD3/FLUX style (no quant convs) when `shift`."""
    from diffusers import AutoencoderKL

    flow = shift is not None
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * SD_VAE_BLOCKS,
        up_block_types=("UpDecoderBlock2D",) * SD_VAE_BLOCKS,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=latent_channels,
        sample_size=64,
        scaling_factor=scaling,
        shift_factor=shift,
        use_quant_conv=not flow,
        use_post_quant_conv=not flow,
    )


def _unet(cross_attention_dim: int, **overrides: Any) -> Any:
    """A 2-level UNet2DConditionModel for 64 px images (8x8 latents, 4 channels)."""
    from diffusers import UNet2DConditionModel

    config: dict[str, Any] = {
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": (32, 64),
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "attention_head_dim": 2,
        "cross_attention_dim": cross_attention_dim,
    }
    return UNet2DConditionModel(**(config | overrides))


def _sdxl_unet(text_dims: tuple[int, int], pooled_dim: int, time_dim: int = 8) -> Any:
    """SDXL's UNet layout in small: plain first block, text_time added conditioning, linear proj."""
    return _unet(
        sum(text_dims),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + pooled_dim,
    )


def _sd3_transformer(joint_dim: int, pooled_dim: int) -> Any:
    """A 2-block MMDiT (SD3Transformer2DModel) on 16-channel latents, 2x2 patches."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=joint_dim,
        caption_projection_dim=32,
        pooled_projection_dim=pooled_dim,
        pos_embed_max_size=16,
    )


def _flux_transformer(joint_dim: int, pooled_dim: int) -> Any:
    """A FLUX.1-dev-like transformer: 2 double + 2 single blocks, guidance embedding, packed 2x2."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_dim,
        pooled_projection_dim=pooled_dim,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )


def _qwen_vae() -> Any:
    """A tiny AutoencoderKLQwenImage (x8 spatial, 4 latent channels) with per-channel
    latents_mean / latents_std that are not 0 / 1, so the normalisation is exercised."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[-0.25, 0.5, 0.1, -0.6],
        latents_std=[1.5, 0.8, 2.0, 1.2],
    )


def _qwen_transformer(joint_dim: int) -> Any:
    """A 2-block QwenImageTransformer2DModel on 2x2-packed 4-channel latents (RoPE 4+6+6=16)."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_dim,
        axes_dims_rope=(4, 6, 6),
    )


def _qwen_flow_match() -> Any:
    """Qwen-Image's scheduler config: exponential dynamic shift by image tokens, terminal 0.02."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def _zimage_transformer(cap_dim: int) -> Any:
    """A ZImageTransformer2DModel: 2 main + 1 refiner layers, 2 heads of 24 (RoPE 8+8+8, its MLP
    128 wide: both split over 2 tensor-parallel ranks), on 16-channel latents in 2x2 patches;
    its pad tokens (left uninitialised by the class) set."""
    import torch
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=48,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=cap_dim,
        axes_dims=[8, 8, 8],
        axes_lens=[1024, 32, 32],  # caption positions: up to 512 tokens, as the real model
    )
    with torch.no_grad():
        model.x_pad_token.normal_()
        model.cap_pad_token.normal_()
    return model


def _zimage_flow_match() -> Any:
    """Z-Image's scheduler config: FlowMatchEuler, static shift 3 (the pipeline passes mu,
    unused without dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False
    )


def _flux2_vae() -> Any:
    """A 4-block AutoencoderKLFlux2 (x8, 4 latent channels: 16 after 2x2 patching) whose
    batch-norm statistics are not 0 / 1, so the normalisation is exercised."""
    import torch
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * SD_VAE_BLOCKS,
        up_block_types=("UpDecoderBlock2D",) * SD_VAE_BLOCKS,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    return vae


def _flux2_transformer(joint_dim: int) -> Any:
    """A FLUX.2-dev-like transformer: 2 double + 2 single blocks, guidance embedding, on the
    VAE's 2x2-patched 16 channels (RoPE 4 x 4 over t, h, w, l)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=joint_dim,
        axes_dims_rope=(4, 4, 4, 4),
    )


def _wan_vae() -> Any:
    """A tiny AutoencoderKLWan (x8 spatial, x4 temporal, 4 latent channels) whose latents_mean /
    latents_std are not 0 / 1, so the normalisation is exercised."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.3, -0.2, 0.05, -0.5],
        latents_std=[1.3, 0.7, 1.8, 1.1],
    )


def _wan_transformer(text_dim: int) -> Any:
    """A 2-block WanTransformer3DModel (2 heads of 16: RoPE t 8 + h 4 + w 4) on 4 channels."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )


def _wan_i2v_transformer(text_dim: int, image_dim: int | None) -> Any:
    """The 2-block Wan transformer of I2V: 4 + 4 + 4 input channels (noisy latents, the
    first-frame mask over the VAE's 4x temporal compression, the condition latents), and with
    `image_dim` the CLIP image embeddings' projection and added K/V (Wan 2.1 I2V)."""
    from diffusers import WanTransformer3DModel

    extra = {} if image_dim is None else {"image_dim": image_dim, "added_kv_proj_dim": 32}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=12,
        out_channels=4,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
        **extra,
    )


def _clip_vision(hidden: int = 32) -> Any:
    """A 2-layer CLIPVisionModel on 32 px images in 8 px patches (17 tokens with the class one)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    return CLIPVisionModel(config)


def _clip_image_processor() -> Any:
    """CLIP's image processing (bicubic resize, center crop, CLIP's mean / std) at 32 px; the
    PIL class, saved as `CLIPImageProcessor` as the Hub's folders name it (no torchvision)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _wan_unipc() -> Any:
    """Wan 2.1's scheduler config: UniPC on flow sigmas shifted by flow_shift 3 (480p)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        solver_order=2,
        final_sigmas_type="zero",
    )


def _ddpm(prediction_type: str) -> Any:
    """SD 1.5/2.x's training schedule (scaled_linear betas, no sample clipping)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(**SD_SCHEDULE, clip_sample=False, prediction_type=prediction_type)


def _euler() -> Any:
    """SDXL base's scheduler config (EulerDiscrete, leading spacing, epsilon)."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        **SD_SCHEDULE, prediction_type="epsilon", timestep_spacing="leading"
    )


def _flow_match(*, dynamic: bool) -> Any:
    """SD3's (shift 3) or FLUX.1-dev's (dynamic resolution shift) flow-matching scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not dynamic:
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


# ---------------------------------------------------------------- pipelines


Builders = dict[str, Callable[[], Any]]


def _sd_parts(v_prediction: bool) -> tuple[str, Builders, dict[str, Any]]:
    """StableDiffusionPipeline parts (SD 2.x: v-prediction, GELU text encoder, linear proj)."""
    sd2 = {"attention_head_dim": (2, 4), "use_linear_projection": True, "upcast_attention": True}
    builders: Builders = {
        "unet": lambda: _unet(32, **(sd2 if v_prediction else {})),
        "vae": lambda: _vae(4, 0.18215),
        "text_encoder": lambda: _clip_text(
            32, projection=False, act="gelu" if v_prediction else "quick_gelu"
        ),
        "tokenizer": clip_tokenizer,
        "scheduler": lambda: _ddpm("v_prediction" if v_prediction else "epsilon"),
    }
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    return "StableDiffusionPipeline", builders, extra


def _sdxl_parts() -> tuple[str, Builders, dict[str, Any]]:
    """StableDiffusionXLPipeline parts: CLIP (32) + CLIP with projection (48) feed the UNet."""
    builders: Builders = {
        "unet": lambda: _sdxl_unet((32, 48), pooled_dim=48),
        "vae": lambda: _vae(4, 0.13025),
        "text_encoder": lambda: _clip_text(32, projection=False),
        "text_encoder_2": lambda: _clip_text(48, projection=True, act="gelu"),
        "tokenizer": clip_tokenizer,
        "tokenizer_2": clip_tokenizer,
        "scheduler": _euler,
    }
    extra = {"image_encoder": None, "feature_extractor": None, "force_zeros_for_empty_prompt": True}
    return "StableDiffusionXLPipeline", builders, extra


def _sd3_parts() -> tuple[str, Builders, dict[str, Any]]:
    """StableDiffusion3Pipeline parts: 2 CLIPs (16 + 16 <= T5's 32, padded) and a T5 encoder."""
    builders: Builders = {
        "transformer": lambda: _sd3_transformer(joint_dim=32, pooled_dim=16 + 16),
        "vae": lambda: _vae(16, 1.5305, shift=0.0609),
        "text_encoder": lambda: _clip_text(16, projection=True),
        "text_encoder_2": lambda: _clip_text(16, projection=True, act="gelu"),
        "text_encoder_3": lambda: _t5_encoder(32),
        "tokenizer": clip_tokenizer,
        "tokenizer_2": clip_tokenizer,
        "tokenizer_3": t5_tokenizer,
        "scheduler": lambda: _flow_match(dynamic=False),
    }
    return "StableDiffusion3Pipeline", builders, {"image_encoder": None, "feature_extractor": None}


def _flux_parts() -> tuple[str, Builders, dict[str, Any]]:
    """FluxPipeline parts: CLIP (pooled 32) and T5 (32) feed a guidance-distilled transformer."""
    builders: Builders = {
        "transformer": lambda: _flux_transformer(joint_dim=32, pooled_dim=32),
        "vae": lambda: _vae(16, 0.3611, shift=0.1159),
        "text_encoder": lambda: _clip_text(32, projection=False),
        "text_encoder_2": lambda: _t5_encoder(32),
        "tokenizer": clip_tokenizer,
        "tokenizer_2": t5_tokenizer,
        "scheduler": lambda: _flow_match(dynamic=True),
    }
    return "FluxPipeline", builders, {"image_encoder": None, "feature_extractor": None}


def _flux_kontext_parts() -> tuple[str, Builders, dict[str, Any]]:
    """FluxKontextPipeline parts: FLUX.1's (Kontext [dev] has FLUX.1-dev's component classes)."""
    _, builders, extra = _flux_parts()
    return "FluxKontextPipeline", builders, extra


def _qwenimage_parts() -> tuple[str, Builders, dict[str, Any]]:
    """QwenImagePipeline parts: Qwen2.5-VL (32) feeds the MMDiT; a Wan-style video VAE."""
    vocab = len(qwen_tokenizer())
    builders: Builders = {
        "transformer": lambda: _qwen_transformer(joint_dim=32),
        "vae": _qwen_vae,
        "text_encoder": lambda: _qwen_vl(vocab),
        "tokenizer": qwen_tokenizer,
        "scheduler": _qwen_flow_match,
    }
    return "QwenImagePipeline", builders, {}


def _qwenimage_edit_parts(plus: bool) -> tuple[str, Builders, dict[str, Any]]:
    """QwenImageEdit(Plus)Pipeline parts: Qwen-Image's, the tokenizer knowing the vision marks
    and the text encoder their ids; the processor is written beside them (write_tiny_folder)."""
    tokenizer = qwen_edit_tokenizer(plus)
    ids = tokenizer.convert_tokens_to_ids
    tokens = {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }
    builders: Builders = {
        "transformer": lambda: _qwen_transformer(joint_dim=32),
        "vae": _qwen_vae,
        "text_encoder": lambda: _qwen_vl(len(tokenizer), tokens=tokens),
        "tokenizer": lambda: qwen_edit_tokenizer(plus),
        "scheduler": _qwen_flow_match,
    }
    name = "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
    return name, builders, {"processor": None}


def _write_vl_processor(folder: Path, tokenizer: Any) -> None:
    """processor/ as Qwen-Image-Edit ships it (Qwen2VLProcessor: the tokenizer and Qwen2-VL's
    image processor config), named in model_index.json; written without torchvision."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = folder / "processor"
    shutil.rmtree(out, ignore_errors=True)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(out)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config |= {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def _wan_parts() -> tuple[str, Builders, dict[str, Any]]:
    """WanPipeline parts (Wan 2.1 text-to-video): UMT5 (32) feeds the video transformer."""
    builders: Builders = {
        "transformer": lambda: _wan_transformer(text_dim=32),
        "vae": _wan_vae,
        "text_encoder": lambda: _umt5_encoder(32),
        "tokenizer": t5_tokenizer,
        "scheduler": _wan_unipc,
    }
    return "WanPipeline", builders, {}


def _zimage_parts() -> tuple[str, Builders, dict[str, Any]]:
    """ZImagePipeline parts: Qwen3 (32) feeds the single-stream DiT; FLUX's VAE layout."""
    vocab = len(qwen3_tokenizer())
    builders: Builders = {
        "transformer": lambda: _zimage_transformer(cap_dim=32),
        "vae": lambda: _vae(16, 0.3611, shift=0.1159),
        "text_encoder": lambda: _qwen3(vocab),
        "tokenizer": qwen3_tokenizer,
        "scheduler": _zimage_flow_match,
    }
    return "ZImagePipeline", builders, {}


def _flux2_parts() -> tuple[str, Builders, dict[str, Any]]:
    """Flux2Pipeline parts: Mistral 3 (16 wide, three layers stacked: 48) feeds the transformer;
    a batch-norm-normalised VAE; FLUX.1-dev's flow-matching scheduler config."""
    vocab = len(mistral_tokenizer())
    builders: Builders = {
        "transformer": lambda: _flux2_transformer(joint_dim=3 * 16),
        "vae": _flux2_vae,
        "text_encoder": lambda: _mistral3(vocab),
        "tokenizer": mistral_tokenizer,
        "scheduler": lambda: _flow_match(dynamic=True),
    }
    return "Flux2Pipeline", builders, {}


def _other_expert(model: Any) -> Any:
    """A second expert unlike the first (both are built from the same seed): every weight moved
    by seeded noise, as Wan 2.2's low-noise expert differs from its high-noise one."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def _wan22_parts() -> tuple[str, Builders, dict[str, Any]]:
    """WanPipeline parts of Wan 2.2 A14B's layout: a high-noise `transformer`, a low-noise
    `transformer_2`, switched at boundary_ratio 0.875 of the timesteps."""
    _, builders, _ = _wan_parts()
    builders["transformer_2"] = lambda: _other_expert(_wan_transformer(text_dim=32))
    return "WanPipeline", builders, {"boundary_ratio": 0.875}


def _wan_i2v_parts() -> tuple[str, Builders, dict[str, Any]]:
    """WanImageToVideoPipeline parts of Wan 2.1 I2V: a CLIP vision encoder (32) and its image
    processor beside UMT5 (32) and the VAE; one 12-channel transformer."""
    _, builders, _ = _wan_parts()
    builders["transformer"] = lambda: _wan_i2v_transformer(text_dim=32, image_dim=32)
    builders["image_encoder"] = _clip_vision
    builders["image_processor"] = _clip_image_processor
    return "WanImageToVideoPipeline", builders, {}


def _name_clip_processor(folder: Path) -> None:
    """model_index.json names the image processor `CLIPImageProcessor`, as the Hub's Wan 2.1 I2V
    folders do (the PIL class saved it; its config file is the same)."""
    import json

    index = json.loads((folder / "model_index.json").read_text())
    index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def _wan22_i2v_parts() -> tuple[str, Builders, dict[str, Any]]:
    """WanImageToVideoPipeline parts of Wan 2.2 I2V A14B: no image encoder, two 12-channel
    experts switched at boundary_ratio 0.875."""
    _, builders, _ = _wan_parts()
    builders["transformer"] = lambda: _wan_i2v_transformer(text_dim=32, image_dim=None)
    builders["transformer_2"] = lambda: _other_expert(
        _wan_i2v_transformer(text_dim=32, image_dim=None)
    )
    extra = {"image_encoder": None, "image_processor": None, "boundary_ratio": 0.875}
    return "WanImageToVideoPipeline", builders, extra


PARTS = {
    "sd": lambda: _sd_parts(v_prediction=False),
    "sd2": lambda: _sd_parts(v_prediction=True),
    "sdxl": _sdxl_parts,
    "sd3": _sd3_parts,
    "flux": _flux_parts,
    "flux_kontext": _flux_kontext_parts,
    "qwenimage": _qwenimage_parts,
    "qwenimage_edit": lambda: _qwenimage_edit_parts(plus=False),
    "qwenimage_edit_plus": lambda: _qwenimage_edit_parts(plus=True),
    "wan": _wan_parts,
    "wan22": _wan22_parts,
    "wan_i2v": _wan_i2v_parts,
    "wan22_i2v": _wan22_i2v_parts,
    "zimage": _zimage_parts,
    "flux2": _flux2_parts,
}


def build_pipeline(kind: str, *, seed: int = 0) -> Any:
    """The tiny pipeline of `kind` in memory; torch is reseeded with `seed` before each part."""
    import diffusers
    import torch

    if kind not in ALL_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")
    class_name, builders, extra = PARTS[kind]()
    components = {}
    for name, build in builders.items():
        torch.manual_seed(seed)
        components[name] = build()
    return getattr(diffusers, class_name)(**components, **extra)


def write_tiny_folder(
    kind: str, folder: str | Path, *, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Write a tiny random-weight diffusers folder of `kind` at `folder`; returns the folder."""
    folder = Path(folder)
    pipe = build_pipeline(kind, seed=seed)
    for name in pipe.components:  # no stale shards or index from an earlier write survive
        shutil.rmtree(folder / name, ignore_errors=True)
    pipe.save_pretrained(folder)
    if kind in QWEN_EDIT_KINDS:
        _write_vl_processor(folder, pipe.tokenizer)
    if kind == "wan_i2v":
        _name_clip_processor(folder)
    if max_shard_size is not None:
        name = "unet" if hasattr(pipe, "unet") else "transformer"
        shutil.rmtree(folder / name)
        getattr(pipe, name).save_pretrained(folder / name, max_shard_size=max_shard_size)
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write one tiny folder and print its path."""
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.tiny_diffusers")
    parser.add_argument("kind", choices=ALL_KINDS)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help="shard the denoiser, e.g. 20KB")
    args = parser.parse_args(argv)
    print(
        write_tiny_folder(
            args.kind, args.folder, seed=args.seed, max_shard_size=args.max_shard_size
        )
    )


if __name__ == "__main__":
    main()
