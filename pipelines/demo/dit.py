"""The demo's denoiser: a small DiT predicting flow-matching velocity, prunable into PP stages."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def sincos_pos_embed_2d(
    dim: int, grid: int, device: torch.device | str | None = None, grid_w: int | None = None
) -> torch.Tensor:
    """Fixed 2-D sin-cos position table [grid*grid_w, dim] (MAE/DiT style), row-major patches
    (`grid_w` defaults to `grid`: a square)."""
    if dim % 4:
        raise ValueError(f"position embedding dim must be divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)
    rows = torch.arange(grid, device=device, dtype=torch.float32)
    cols = torch.arange(grid if grid_w is None else grid_w, device=device, dtype=torch.float32)
    yy, xx = torch.meshgrid(rows, cols, indexing="ij")
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
        self.gradient_checkpointing = False  # recompute each block's activations in backward
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
        b, p = latents.shape[0], self.patch_size
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels or latents.shape[2] % p:
            raise ValueError(
                f"DiT wants latents [B,{self.latent_channels},H,W] with H, W multiples of {p}, "
                f"got {tuple(latents.shape)}"
            )
        if latents.shape[3] % p:
            raise ValueError(f"DiT latent width {latents.shape[3]} is not a multiple of {p}")
        if prompt_emb.ndim != 3 or prompt_emb.shape[0] != b:
            raise ValueError(f"DiT wants prompt_emb [B={b},T,D], got {tuple(prompt_emb.shape)}")
        dtype = self.patch_embed.weight.dtype
        img = self.patch_embed(latents.to(dtype)).flatten(2).transpose(1, 2)
        img = img + self._pos_embed(latents.shape[2] // p, latents.shape[3] // p).to(dtype)
        txt = self.text_proj(prompt_emb.to(dtype))
        timestep = torch.as_tensor(timestep, device=latents.device).reshape(-1).expand(b)
        cond = self.time_embed(timestep)
        if prompt_mask is None:
            txt_keep = torch.ones(txt.shape[:2], device=txt.device, dtype=dtype)
        else:
            txt_keep = prompt_mask.to(device=txt.device, dtype=dtype)
        keep = torch.cat([txt_keep, txt_keep.new_ones(img.shape[:2])], dim=1)
        return torch.cat([txt, img], dim=1), cond, keep

    def _pos_embed(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """The position table of a grid_h x grid_w patch grid (the buffer for the square)."""
        if grid_h == grid_w == self.grid:
            return self.pos_embed
        return sincos_pos_embed_2d(self.hidden, grid_h, self.pos_embed.device, grid_w)

    def _head(self, h: torch.Tensor, cond: torch.Tensor, grid: tuple[int, int] | None = None):
        """Last-stage work: image tokens -> prediction [B,C,H,W] (`grid`: patches down, across;
        the square when None, as a PP stage without the input gets)."""
        gh, gw = grid or (self.grid, self.grid)
        n, p = gh * gw, self.patch_size
        out = self.proj_out(self.norm(h[:, -n:], cond))
        out = out.reshape(h.shape[0], gh, gw, p, p, self.latent_channels)
        return out.permute(0, 5, 1, 3, 2, 4).reshape(
            h.shape[0], self.latent_channels, gh * p, gw * p
        )

    def forward(self, latents, timestep, prompt_emb, prompt_mask=None):
        """Predict velocity [B,C,H,W] from latents, timestep [B] in [0,1], prompt_emb [B,T,D].

        prompt_mask [B,T] bool (True = real token) or None. A pipeline stage made by
        `prune_to_stage` runs only the modules it holds: without `patch_embed` its inputs are the
        previous stage's (hidden, cond, keep); without `proj_out` it returns (hidden, cond, keep).
        """
        grid = None
        if self.patch_embed is not None:
            h, cond, keep = self._embed(latents, timestep, prompt_emb, prompt_mask)
            grid = (latents.shape[2] // self.patch_size, latents.shape[3] // self.patch_size)
        else:
            h, cond, keep = latents, timestep, prompt_emb
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks.values():
            if recompute:  # keep only the block's inputs; rerun it in backward
                h = checkpoint(block, h, cond, keep, use_reentrant=False)
            else:
                h = block(h, cond, keep)
        if self.proj_out is None:
            return h, cond, keep
        return self._head(h, cond, grid)


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
