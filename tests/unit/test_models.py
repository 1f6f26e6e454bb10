"""Demo models: shapes, determinism, meta-device loading, PP stages, LoRA names, flow matching."""

import pytest
import torch

from splitstage.pipelines.demo.dit import DiT, dit_module_fqns, prune_to_stage
from splitstage.pipelines.demo.text import encode_prompts, load_tiny_text_encoder
from splitstage.pipelines.demo.vae import VAEEncoder
from splitstage.pipelines.demo.weight_files import (
    build_demo_weights,
    load_weights,
    save_weights,
    weights_config,
)
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.flow_matching import (
    add_noise,
    flow_matching_loss,
    sample_noise,
    sample_timesteps,
)

B = 2


def _inputs(batch=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    t = torch.rand(batch, generator=g)
    emb = torch.randn(batch, 16, 384, generator=g)
    mask = torch.ones(batch, 16, dtype=torch.bool)
    mask[:, 5:] = False
    return latents, t, emb, mask


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return build_demo_weights(tmp_path_factory.mktemp("w"), seed=0)


def test_vae_shape_and_determinism():
    torch.manual_seed(0)
    vae = VAEEncoder().eval()
    images = torch.rand(3, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        z1, z2 = vae(images), vae(images)
        alone = vae(images[1:2])
    assert z1.shape == (3, 4, 8, 8)
    assert torch.equal(z1, z2)
    torch.testing.assert_close(alone, z1[1:2])  # batch composition does not change a sample
    with pytest.raises(ValueError, match="divisible by 8"):
        vae(torch.zeros(1, 3, 60, 60))


def test_dit_forward_backward_reaches_every_block():
    torch.manual_seed(0)
    dit = DiT()
    assert 1_000_000 < sum(p.numel() for p in dit.parameters()) < 3_500_000
    out = dit(*_inputs())
    assert out.shape == (B, 4, 8, 8)
    out.square().mean().backward()
    for name, p in dit.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for block in dit.blocks.values():
        assert block.attn.to_q.weight.grad.abs().sum() > 0  # no zero-init gate blocks gradients


def test_dit_ignores_padded_prompt_tokens():
    torch.manual_seed(0)
    dit = DiT().eval()
    latents, t, emb, mask = _inputs()
    changed = emb.clone()
    changed[:, 5:] = torch.randn_like(changed[:, 5:])
    with torch.no_grad():
        torch.testing.assert_close(dit(latents, t, emb, mask), dit(latents, t, changed, mask))
        assert not torch.allclose(dit(latents, t, emb, None), dit(latents, t, changed, None))


def test_meta_init_to_empty_load_matches_normal_build(weights):
    assert weights_config(weights["dit"])["depth"] == 6
    reference = load_weights(DiT(), weights["dit"]).eval()
    with torch.device("meta"):
        meta = DiT()
    meta.to_empty(device="cpu")
    load_weights(meta, weights["dit"])
    meta.init_non_persistent_buffers()
    meta.eval()
    with torch.no_grad():
        assert torch.equal(meta(*_inputs()), reference(*_inputs()))
    assert "pos_embed" not in meta.state_dict()  # non-persistent: never in the file


def test_weights_are_deterministic_and_checked(tmp_path, weights):
    again = build_demo_weights(tmp_path, seed=0)
    for name in ("vae", "dit"):
        assert again[name].read_bytes() == weights[name].read_bytes()
    assert (
        build_demo_weights(tmp_path / "s1", seed=1)["dit"].read_bytes() != again["dit"].read_bytes()
    )
    small = save_weights(DiT(depth=2), tmp_path / "small.safetensors")
    with pytest.raises(ValueError, match="missing .*blocks.2"):
        load_weights(DiT(depth=6), small)


def test_pipeline_stages_chain_to_full_model():
    fqns = dit_module_fqns(6)
    assert fqns[:4] == ["patch_embed", "time_embed", "text_proj", "blocks.0"]
    assert fqns[-3:] == ["blocks.5", "norm", "proj_out"]
    torch.manual_seed(0)
    full = DiT().eval()
    state = full.state_dict()
    stages = []
    for keep in (fqns[:5], fqns[5:]):  # first stage holds blocks 0-1, second blocks 2-5 + head
        stage = DiT()
        stage.load_state_dict(state)
        stages.append(prune_to_stage(stage, keep).eval())
    assert list(stages[1].blocks.keys()) == ["2", "3", "4", "5"]
    assert all(
        k.startswith(("blocks.2", "blocks.3", "blocks.4", "blocks.5", "norm", "proj_out"))
        for k in stages[1].state_dict()
    )  # global FQNs are kept
    with torch.no_grad():
        torch.testing.assert_close(stages[1](*stages[0](*_inputs())), full(*_inputs()))
    with torch.device("meta"):
        tail = prune_to_stage(DiT(depth=2), ["blocks.1", "norm", "proj_out"])
    tail.to_empty(device="cpu")
    tail.init_weights()  # a stage initializes only what it holds (training from scratch)
    assert torch.isfinite(tail.blocks["1"].scale_shift_table).all()
    with pytest.raises(ValueError, match="contiguous"):
        prune_to_stage(DiT(depth=2), ["blocks.0", "proj_out"])
    with pytest.raises(ValueError, match="all of"):
        prune_to_stage(DiT(depth=2), ["text_proj", "blocks.0"])


def test_lora_target_modules_exist():
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    dit = DiT(depth=2)
    names = {n for n, _ in dit.named_modules()}
    for leaf in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "mlp.fc1", "mlp.fc2"):
        assert f"blocks.1.{leaf}" in names
    targets = ["to_q", "to_k", "to_v", "to_out", "fc1", "fc2"]
    dit = inject_adapter_in_model(LoraConfig(r=4, target_modules=targets), dit)
    lora = [n for n, p in dit.named_parameters() if "lora_" in n]
    assert len(lora) == 2 * 2 * len(targets) and all(n.startswith("blocks.") for n in lora)
    dit(*_inputs()).square().mean().backward()
    lora_b = [p for n, p in dit.named_parameters() if "lora_B" in n]
    assert all(p.grad.abs().sum() > 0 for p in lora_b)  # LoRA learns from the first step


def test_flow_matching_helpers():
    g = Draws.shared(torch.Generator().manual_seed(0))
    t = sample_timesteps(1000, g)
    assert t.shape == (1000,) and t.min() >= 0 and t.max() <= 1
    t = sample_timesteps(1000, g, distribution="logit_normal")
    assert t.min() > 0 and t.max() < 1 and abs(t.mean().item() - 0.5) < 0.05
    with pytest.raises(ValueError, match="uniform"):
        sample_timesteps(2, g, distribution="cosine")
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(add_noise(x0, noise, torch.zeros(2)), x0)
    torch.testing.assert_close(add_noise(x0, noise, torch.ones(2)), noise)
    assert flow_matching_loss(noise - x0, noise, x0).item() == 0
    assert sample_noise(x0, g).shape == x0.shape


def test_flow_matching_loss_decreases_on_two_samples():
    torch.manual_seed(0)
    dit = DiT(depth=2)
    encoder, tokenizer = load_tiny_text_encoder()
    emb, mask = encode_prompts(encoder, tokenizer, ["a handwritten digit one", "the number 2"])
    assert emb.shape == (2, 16, 384) and mask.sum(1).tolist() == [4, 3]
    assert emb[~mask].abs().sum() == 0  # padding is zeroed
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    t = sample_timesteps(2, Draws.shared(g))
    opt = torch.optim.AdamW(dit.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = flow_matching_loss(dit(add_noise(x0, noise, t), t, emb, mask), noise, x0)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
