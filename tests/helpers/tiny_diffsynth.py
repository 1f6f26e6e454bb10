"""Tiny random DiffSynth-Studio models and offline tokenizers, for the diffsynth family's tests.

Z-Image (ZImageDiT, a small Qwen3 text encoder, small FLUX VAE encoder/decoder), Wan 2.1
text-to-video (WanModel, WanTextEncoder, a small Wan VAE) and Qwen-Image (a small QwenImageDiT,
a small Qwen2.5-VL text encoder with a cut vocabulary, QwenImageVAE at width 8) and Qwen-Image-Edit
(the same, its text encoder knowing the vision tokens, plus a Qwen2VLProcessor), written as
safetensors files that
DiffSynth's own loader reads. The small classes reuse DiffSynth's blocks; units hard-code 16 latent
channels and an 8x downsample, which the VAEs keep. `register_entries(...)` gives the
`[pipeline] register_models` entries (the hash is computed by DiffSynth from the file); they name
the classes as `tests.helpers.tiny_diffsynth.<class>`, so every process that loads the files must
find `tests` (started from the checkout's root, as the tests' ranks are; the benches put it on
PYTHONPATH). Needs diffsynth installed (the side environment, see docs/families/diffsynth.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffsynth.models.dinov3_image_encoder import DINOv3ImageEncoder
from diffsynth.models.flux_text_encoder_t5 import FluxTextEncoderT5
from diffsynth.models.flux_vae import DownSampler, FluxVAEDecoder, FluxVAEEncoder, ResnetBlock
from diffsynth.models.flux_vae import UpSampler as FluxUpSampler
from diffsynth.models.general_modules import AdaLayerNorm, RMSNorm, TimestepEmbeddings
from diffsynth.models.qwen_image_21_text_encoder import QwenImage21TextEncoder
from diffsynth.models.qwen_image_dit import QwenEmbedRope, QwenImageDiT, QwenImageTransformerBlock
from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
from diffsynth.models.siglip2_image_encoder import Siglip2ImageEncoder, Siglip2ImageEncoder428M
from diffsynth.models.wan_video_vae import VideoVAE_, WanVideoVAE
from diffsynth.models.wav2vec import WanS2VAudioEncoder
from diffsynth.models.z_image_text_encoder import ZImageTextEncoder
from safetensors.torch import save_file
from transformers import DINOv3ViTModel, Siglip2VisionModel, SiglipVisionModel

from tests.helpers.tiny_diffusers import qwen_tokenizer, t5_tokenizer

MODULE = __name__  # the written entries name the classes by this import path
TEXT_DIM = 32
VAE_DIM = 32
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyZImageTextEncoder(ZImageTextEncoder):
    """ZImageTextEncoder around a 2-layer Qwen3 of width 32 (hidden_states[-2] is read); more
    layers, a wider MLP or a wider model make a larger one (a stage-1 memory bench's; a width
    other than the DiT's cap_feat_dim serves stage 1 only)."""

    def __init__(
        self,
        vocab_size: int = 300,
        layers: int = 2,
        intermediate_size: int = 64,
        hidden_size: int = TEXT_DIM,
    ):
        torch.nn.Module.__init__(self)
        from transformers import Qwen3Config, Qwen3Model

        config = Qwen3Config(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=vocab_size,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
        self.model = Qwen3Model(config)


class TinyFluxVAEEncoder(FluxVAEEncoder):
    """FluxVAEEncoder with 32 channels: 3 downsamplings (8x), 32 -> 16 latent channels."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.scaling_factor, self.shift_factor = 0.3611, 0.1159
        self.conv_in = torch.nn.Conv2d(3, VAE_DIM, kernel_size=3, padding=1)
        blocks = [ResnetBlock(VAE_DIM, VAE_DIM, eps=1e-6)]
        for _ in range(3):
            blocks.append(DownSampler(VAE_DIM, padding=0, extra_padding=True))
        self.blocks = torch.nn.ModuleList(blocks)
        self.conv_norm_out = torch.nn.GroupNorm(num_channels=VAE_DIM, num_groups=32, eps=1e-6)
        self.conv_act = torch.nn.SiLU()
        self.conv_out = torch.nn.Conv2d(VAE_DIM, 32, kernel_size=3, padding=1)


class TinyFluxVAEDecoder(FluxVAEDecoder):
    """FluxVAEDecoder with 32 channels: 16 latent channels, 3 upsamplings (8x)."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.scaling_factor, self.shift_factor = 0.3611, 0.1159
        self.conv_in = torch.nn.Conv2d(16, VAE_DIM, kernel_size=3, padding=1)
        blocks = [ResnetBlock(VAE_DIM, VAE_DIM, eps=1e-6)]
        for _ in range(3):
            blocks.append(FluxUpSampler(VAE_DIM))
        self.blocks = torch.nn.ModuleList(blocks)
        self.conv_norm_out = torch.nn.GroupNorm(num_channels=VAE_DIM, num_groups=32, eps=1e-6)
        self.conv_act = torch.nn.SiLU()
        self.conv_out = torch.nn.Conv2d(VAE_DIM, 3, kernel_size=3, padding=1)


class TinyWanVideoVAE(WanVideoVAE):
    """WanVideoVAE whose VideoVAE_ has width 8 and one residual block per level."""

    def __init__(self, z_dim: int = 16):
        torch.nn.Module.__init__(self)
        mean = torch.linspace(-0.5, 0.5, z_dim)
        std = torch.linspace(1.0, 2.0, z_dim)
        self.mean, self.std = mean, std
        self.scale = [self.mean, 1.0 / self.std]
        self.model = VideoVAE_(dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
        self.model.requires_grad_(False)
        self.upsampling_factor = 8
        self.z_dim = z_dim


class TinyQwenImageDiT(QwenImageDiT):
    """QwenImageDiT of width 32 (2 heads of 16, RoPE axes 4+6+6) on 32-wide text embeddings."""

    def __init__(self, num_layers: int = 1, dim: int = 32, text_dim: int = TEXT_DIM):
        torch.nn.Module.__init__(self)
        self.pos_embed = QwenEmbedRope(theta=10000, axes_dim=[4, 6, 6], scale_rope=True)
        self.time_text_embed = TimestepEmbeddings(
            256, dim, diffusers_compatible_format=True, scale=1000, align_dtype_to_timestep=False
        )
        self.txt_norm = RMSNorm(text_dim, eps=1e-6)
        self.img_in = torch.nn.Linear(64, dim)
        self.txt_in = torch.nn.Linear(text_dim, dim)
        self.transformer_blocks = torch.nn.ModuleList(
            QwenImageTransformerBlock(dim=dim, num_attention_heads=2, attention_head_dim=dim // 2)
            for _ in range(num_layers)
        )
        self.norm_out = AdaLayerNorm(dim, single=True)
        self.proj_out = torch.nn.Linear(dim, 64)


class TinyQwenImageTextEncoder(QwenImageTextEncoder):
    """QwenImageTextEncoder around a 2-layer Qwen2.5-VL of width 32 (1-block vision tower), its
    vocabulary cut to the tiny Qwen2Tokenizer's."""

    def __init__(self, vocab_size: int = 400, vision_ids: dict[str, int] | None = None):
        torch.nn.Module.__init__(self)
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

        text = {
            "vocab_size": vocab_size,
            "hidden_size": TEXT_DIM,
            "intermediate_size": 2 * TEXT_DIM,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            "rope_theta": 10000.0,
        }
        ids = {"bos_token_id": None, "eos_token_id": vocab_size - 1, "pad_token_id": 0}
        ids |= vision_ids or {}  # the processor's image / vision tokens (Qwen-Image-Edit)
        vision = {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIM,
            "fullatt_block_indexes": [0],
        }
        config = Qwen2_5_VLConfig(
            text_config=text | ids, vision_config=vision, vocab_size=vocab_size, **ids
        )
        self.model = Qwen2_5_VLModel(config)
        self.lm_head = torch.nn.Linear(TEXT_DIM, vocab_size, bias=False)
        self.config = config


# Per model: (DiffSynth model_name, class path, constructor kwargs, file name).
ZIMAGE_MODELS = {
    "dit": (
        "z_image_dit",
        "diffsynth.models.z_image_dit.ZImageDiT",
        {
            "dim": 64,
            "n_layers": 1,
            "n_refiner_layers": 1,
            "n_heads": 2,
            "n_kv_heads": 2,
            "cap_feat_dim": TEXT_DIM,
            "axes_dims": [8, 12, 12],
            "axes_lens": [1024, 64, 64],
        },
        "dit.safetensors",
    ),
    "text_encoder": (
        "z_image_text_encoder",
        f"{MODULE}.TinyZImageTextEncoder",
        {},
        "text_encoder.safetensors",
    ),
    "vae_encoder": (
        "flux_vae_encoder",
        f"{MODULE}.TinyFluxVAEEncoder",
        {},
        "vae_encoder.safetensors",
    ),
    "vae_decoder": (
        "flux_vae_decoder",
        f"{MODULE}.TinyFluxVAEDecoder",
        {},
        "vae_decoder.safetensors",
    ),
}
WAN_MODELS = {
    "dit": (
        "wan_video_dit",
        "diffsynth.models.wan_video_dit.WanModel",
        {
            "dim": 48,
            "in_dim": 16,
            "ffn_dim": 64,
            "out_dim": 16,
            "text_dim": TEXT_DIM,
            "freq_dim": 32,
            "eps": 1e-6,
            "patch_size": [1, 2, 2],
            "num_heads": 2,
            "num_layers": 1,
            "has_image_input": False,
        },
        "dit.safetensors",
    ),
    "text_encoder": (
        "wan_video_text_encoder",
        "diffsynth.models.wan_video_text_encoder.WanTextEncoder",
        {
            "vocab": 200,
            "dim": TEXT_DIM,
            "dim_attn": TEXT_DIM,
            "dim_ffn": 64,
            "num_heads": 2,
            "num_layers": 1,
            "num_buckets": 8,
        },
        "text_encoder.safetensors",
    ),
    "vae": ("wan_video_vae", f"{MODULE}.TinyWanVideoVAE", {}, "vae.safetensors"),
}
QWEN_IMAGE_MODELS = {
    "dit": ("qwen_image_dit", f"{MODULE}.TinyQwenImageDiT", {}, "dit.safetensors"),
    "text_encoder": (
        "qwen_image_text_encoder",
        f"{MODULE}.TinyQwenImageTextEncoder",
        {},
        "text_encoder.safetensors",
    ),
    "vae": (
        "qwen_image_vae",
        "diffsynth.models.qwen_image_vae.QwenImageVAE",
        {"base_dim": 8, "num_res_blocks": 1},
        "vae.safetensors",
    ),
}
# Qwen-Image-Edit: the same DiT and VAE; a text encoder whose vocabulary holds the processor's
# vision tokens (at the ids the edit tokenizer gives them), so a reference image is encoded.
# Its vocabulary differs in size from Qwen-Image's, so the two files never share a key hash.
EDIT_VOCAB = 416
QWEN_VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_IMAGE_EDIT_MODELS = {
    **QWEN_IMAGE_MODELS,
    "text_encoder": (
        "qwen_image_text_encoder",
        f"{MODULE}.TinyQwenImageTextEncoder",
        {"vocab_size": EDIT_VOCAB},  # vision_ids: added by write_tiny_edit_models
        "text_encoder.safetensors",
    ),
}
MODELS = {
    "ZImagePipeline": ZIMAGE_MODELS,
    "WanVideoPipeline": WAN_MODELS,
    "QwenImagePipeline": QWEN_IMAGE_MODELS,
    "QwenImageEdit": QWEN_IMAGE_EDIT_MODELS,
}


def _class(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextmanager
def nan_filled_empty() -> Iterator[None]:
    """`torch.empty` returns NaN (torch's deterministic mode fills uninitialized memory), so a
    tensor a constructor never initializes is recognizable instead of holding stale memory."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def build_initialized(cls: type, kwargs: dict[str, Any]) -> torch.nn.Module:
    """`cls(**kwargs)` with every tensor defined: what the constructor leaves uninitialized
    (ZImageDiT's `x_pad_token` / `cap_pad_token` are `nn.Parameter(torch.empty(...))`, learned in
    real checkpoints) is drawn from N(0, 0.02) with the global RNG (seeded by the caller). Stale
    memory there made the written file differ per run, up to 1e38: Z-Image's bf16 backward then
    overflowed in RMSNorm and training went NaN on and off."""
    with nan_filled_empty():
        model = cls(**kwargs)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and torch.isnan(tensor).any():
                tensor.copy_(torch.randn(tensor.shape) * 0.02)
    return model


def check_finite(state: dict[str, torch.Tensor], file_name: str) -> None:
    """Refuse to write a tiny model holding NaN / inf (its tests would be meaningless)."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise ValueError(f"{file_name}: non-finite values in {', '.join(sorted(bad))}")


def zimage_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer (Qwen-style specials, a chat template) saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.tiny_diffusers import _byte_symbols

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def wan_tokenizer(folder: Path) -> Path:
    """The tiny T5 (Unigram) tokenizer, saved where Wan's HuggingfaceTokenizer loads it."""
    t5_tokenizer().save_pretrained(folder)
    return folder


def qwen_image_tokenizer(folder: Path) -> Path:
    """The tiny Qwen2Tokenizer (the template's 34-token system prefix, every byte), saved."""
    qwen_tokenizer().save_pretrained(folder)
    return folder


def qwen_image_edit_tokenizer() -> Any:
    """The tiny Qwen2Tokenizer plus the Qwen2.5-VL vision tokens (a reference image's
    `<|vision_start|><|image_pad|><|vision_end|>`), as special tokens after its vocabulary."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_tokens(list(QWEN_VISION_SPECIALS), special_tokens=True)
    return tokenizer


def qwen_image_edit_tokenizer_folder(folder: Path) -> Path:
    """The edit tokenizer, saved where DiffSynth's `tokenizer_config` loads it."""
    qwen_image_edit_tokenizer().save_pretrained(folder)
    return folder


def vision_ids(tokenizer: Any) -> dict[str, int]:
    """The Qwen2.5-VL config's token ids for the tokenizer's vision tokens."""
    ids = tokenizer.convert_tokens_to_ids(list(QWEN_VISION_SPECIALS))
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return dict(zip(names, ids, strict=True))


def qwen_image_edit_processor(folder: Path, tokenizer: Any) -> Path:
    """A Qwen2VLProcessor (Qwen2.5-VL's image processor at most 56 x 56 pixels: 4 vision tokens
    per image; its video processor; the edit tokenizer), saved where DiffSynth's
    `processor_config` loads it."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size),
    )
    processor.save_pretrained(folder)
    return folder


TOKENIZERS = {
    "ZImagePipeline": zimage_tokenizer,
    "WanVideoPipeline": wan_tokenizer,
    "QwenImagePipeline": qwen_image_tokenizer,
    "QwenImageEdit": qwen_image_edit_tokenizer_folder,
}


def write_tiny_models(
    pipeline_class: str,
    folder: str | Path,
    *,
    seed: int = 0,
    kwargs_of: dict[str, dict[str, Any]] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Write the tiny models of `pipeline_class` and its tokenizer under `folder` (`kwargs_of`:
    constructor arguments added per slot, e.g. a larger text encoder for a memory bench; the
    files' floating tensors in `dtype`); returns {"model_paths": [...], "tokenizer_path": ...,
    "register_models": [...]} for `[pipeline]`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    entries, paths = [], []
    for slot, (model_name, class_path, kwargs, file_name) in MODELS[pipeline_class].items():
        kwargs = {**kwargs, **(kwargs_of or {}).get(slot, {})}
        model = build_initialized(_class(class_path), kwargs)
        with torch.no_grad():  # small weights: the tiny models stay numerically tame
            for param in model.parameters():
                param.mul_(0.5)
        state = {
            k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous()
            for k, v in model.state_dict().items()
        }
        check_finite(state, file_name)
        path = folder / file_name
        save_file(state, str(path))
        paths.append(str(path))
        entries.append(
            {"path": str(path), "model_name": model_name, "model_class": class_path}
            | ({"extra_kwargs": kwargs} if kwargs else {})
        )
    tokenizer = folder / "tokenizer"
    TOKENIZERS[pipeline_class](tokenizer)
    (folder / "models.json").write_text(json.dumps(entries, indent=2))
    return {"model_paths": paths, "tokenizer_path": str(tokenizer), "register_models": entries}


def write_tiny_edit_models(folder: str | Path, *, seed: int = 0) -> dict[str, Any]:
    """Qwen-Image-Edit's tiny files (`write_tiny_models` of the "QwenImageEdit" set, its text
    encoder knowing the vision tokens) plus the processor folder; the answer adds
    "processor_path" (DiffSynth's `--processor_path`)."""
    tokenizer = qwen_image_edit_tokenizer()
    kwargs_of = {"text_encoder": {"vision_ids": vision_ids(tokenizer)}}
    info = write_tiny_models("QwenImageEdit", folder, seed=seed, kwargs_of=kwargs_of)
    processor = qwen_image_edit_processor(Path(folder) / "processor", tokenizer)
    return info | {"processor_path": str(processor)}


def _tiny_siglip_config() -> Any:
    """A 1-layer SigLIP vision tower of width 32 on 32 x 32 images (patches of 16)."""
    from transformers.models.siglip.modeling_siglip import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=16,
        hidden_act="gelu_pytorch_tanh",
        dtype="float32",
    )


class TinySiglip2ImageEncoder(Siglip2ImageEncoder):
    """Siglip2ImageEncoder (Qwen-Image's / Z-Image's SigLIP2-G384) around a 1-layer tower."""

    def __init__(self):
        SiglipVisionModel.__init__(self, _tiny_siglip_config())


class TinySiglip2ImageEncoder428M(Siglip2ImageEncoder428M):
    """Siglip2ImageEncoder428M (Z-Image's) around a 1-layer SigLIP2 tower, its config in bf16."""

    def __init__(self):
        from transformers import Siglip2VisionConfig

        config = Siglip2VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_patches=16,
            patch_size=16,
            hidden_act="gelu_pytorch_tanh",
            dtype="bfloat16",
        )
        Siglip2VisionModel.__init__(self, config)


class TinyDINOv3ImageEncoder(DINOv3ImageEncoder):
    """DINOv3ImageEncoder (Qwen-Image's / Z-Image's DINOv3-7B) around a 1-layer ViT of width 32
    (its RoPE buffers built by the constructor, 4 register tokens, gated MLP)."""

    def __init__(self):
        from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTConfig

        config = DINOv3ViTConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
            num_register_tokens=4,
            hidden_act="silu",
            use_gated_mlp=True,
            rope_theta=100.0,
            pos_embed_rescale=2.0,
            dtype="float32",
        )
        DINOv3ViTModel.__init__(self, config)


class TinyFluxTextEncoderT5(FluxTextEncoderT5):
    """FluxTextEncoderT5 (FLUX's T5-XXL encoder) at width 32, 1 layer, a 200-token vocabulary
    (its shared embedding tied to the encoder's, as in T5EncoderModel)."""

    def __init__(self):
        from transformers import T5Config, T5EncoderModel

        config = T5Config(
            vocab_size=200,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            dense_act_fn="gelu_new",
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
        )
        T5EncoderModel.__init__(self, config)


class TinyWanS2VAudioEncoder(WanS2VAudioEncoder):
    """WanS2VAudioEncoder (Wan-S2V's wav2vec2) around a 1-layer wav2vec2 of width 32 (its
    positional convolution weight-normed: a parametrization with a load-state-dict hook)."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        config = Wav2Vec2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            conv_dim=[16, 16],
            conv_kernel=[10, 3],
            conv_stride=[5, 2],
            num_feat_extract_layers=2,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            vocab_size=33,
        )
        self.model = Wav2Vec2ForCTC(config)
        self.video_rate = 30


class TinyQwenImage21TextEncoder(QwenImage21TextEncoder):
    """QwenImage21TextEncoder (its own `to`, which puts the fp32 rotary buffers back after a
    move) around a 1-layer Qwen3-VL of width 32 with a 1-block vision tower."""

    QWEN_IMAGE_21_TEXT_ENCODER_CONFIG = {
        "text_config": {
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": TEXT_DIM,
            "intermediate_size": 64,
            "max_position_embeddings": 1024,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-6,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [2, 3, 3],
                "rope_type": "default",
            },
            "rope_theta": 5000000,
            "vocab_size": 300,
        },
        "vision_config": {
            "deepstack_visual_indexes": [0],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 16,
            "in_channels": 3,
            "intermediate_size": 32,
            "model_type": "qwen3_vl",
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": TEXT_DIM,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "image_token_id": 296,
        "video_token_id": 297,
        "vision_start_token_id": 298,
        "vision_end_token_id": 299,
        "tie_word_embeddings": False,
    }


# Models whose classes run code of their own on what they load or move (transformers'
# `PreTrainedModel.to`, a `to` of their own, a load hook): model name -> the fields of its
# MODEL_CONFIGS entry (FLUX's T5 file holds its tied embedding once; DiffSynth's converter
# reads it twice).
OWN_LOADING_MODELS = {
    "siglip2_image_encoder": {"model_class": f"{MODULE}.TinySiglip2ImageEncoder"},
    "siglip_vision_model_428m": {"model_class": f"{MODULE}.TinySiglip2ImageEncoder428M"},
    "dinov3_image_encoder": {"model_class": f"{MODULE}.TinyDINOv3ImageEncoder"},
    "flux_text_encoder_t5": {
        "model_class": f"{MODULE}.TinyFluxTextEncoderT5",
        "state_dict_converter": "diffsynth.utils.state_dict_converters.flux_text_encoder_t5."
        "FluxTextEncoderT5StateDictConverter",
    },
    "wans2v_audio_encoder": {"model_class": f"{MODULE}.TinyWanS2VAudioEncoder"},
    "qwen_image_21_text_encoder": {"model_class": f"{MODULE}.TinyQwenImage21TextEncoder"},
}


def write_tiny_model(
    model_name: str, fields: dict[str, Any], path: str | Path, *, seed: int = 0
) -> dict[str, Any]:
    """Write one tiny model of `fields["model_class"]` (random, every tensor defined, floating
    tensors in fp32; a tied tensor once, under its first name, as transformers saves it) to
    `path`; returns its MODEL_CONFIGS fields with "path" and "model_name"."""
    torch.manual_seed(seed)
    model = build_initialized(_class(fields["model_class"]), fields.get("extra_kwargs", {}))
    state, written = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in written:
            written.add(tensor.data_ptr())
            state[key] = tensor.detach().contiguous()
    check_finite(state, Path(path).name)
    save_file(state, str(path))
    return {"path": str(path), "model_name": model_name, **fields}
