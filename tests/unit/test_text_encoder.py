"""The real all-MiniLM-L6-v2 text encoder loads offline and gives meaningful token embeddings."""

import socket

import torch
import torch.nn.functional as F

from splitstage.pipelines.demo.text import encode_prompts, load_text_encoder


def test_real_text_encoder_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the text encoder tried to use the network")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    encoder, tokenizer = load_text_encoder("cpu", torch.float32)
    prompts = [
        "a handwritten digit seven",
        "the number 7 written by hand",
        "a red sports car parked on a wet street at night under bright neon signs, photo",
    ]
    emb, mask = encode_prompts(encoder, tokenizer, prompts, max_length=16)
    assert emb.shape == (3, 16, 384) and mask.shape == (3, 16) and mask.dtype == torch.bool
    assert mask[2].all() and not mask[0].all()  # long prompt truncated, short one padded
    assert not encoder.training and not any(p.requires_grad for p in encoder.parameters())
    pooled = F.normalize(emb.sum(1) / mask.sum(1, keepdim=True), dim=-1)
    sim = pooled @ pooled.T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[0, 1] > sim[1, 2] + 0.3
