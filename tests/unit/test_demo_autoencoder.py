"""The demo VAE trained on the digits: it reconstructs held-out digits, deterministically, and its
files load the way the demo family and a sampler load them."""

import pytest
import torch

from splitstage.data.dataset import load_metadata, load_sample
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.demo.autoencoder_training import (
    clear_trained_cache,
    digit_images,
    mean_latents,
    reconstruction_mse,
    split_indices,
    trained_autoencoder,
)
from splitstage.pipelines.demo.vae import VAEDecoder, VAEEncoder
from splitstage.pipelines.demo.weight_files import (
    build_demo_weights,
    load_decoder,
    load_weights,
    weights_config,
)

# Measured held-out MSE in [-1,1] pixels: 0.0046 trained, 0.71 at init (0.23 for the mean image).
HELDOUT_MSE_MAX = 0.02


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The demo weights for seed 0 (the autoencoder trains once here)."""
    return build_demo_weights(tmp_path_factory.mktemp("w"), seed=0)


@pytest.fixture(scope="module")
def held_out():
    """The held-out digits (every 10th), as the demo preprocesses them."""
    images = digit_images()
    return images[split_indices(len(images))[1]]


def load_encoder(path):
    """The demo family's way: config from the metadata, then the tensors."""
    return load_weights(VAEEncoder(**weights_config(path)), path).eval()


def test_images_are_what_the_data_set_gives(tmp_path):
    write_digits_dataset(tmp_path, limit=21)
    rows = load_metadata(tmp_path)
    images = digit_images()
    for i in (0, 7, 10, 20):
        assert torch.equal(load_sample(rows[i], tmp_path, 64)["image"], images[i])
    train, held = split_indices(len(images))
    assert (len(train), len(held)) == (1617, 180) and held[:3].tolist() == [0, 10, 20]


def test_reconstructs_held_out_digits(built, held_out):
    report = trained_autoencoder(0).report
    assert report.heldout_mse < HELDOUT_MSE_MAX, report
    assert report.untrained_heldout_mse > 0.3, report  # training, not the architecture, does it
    encoder, decoder = load_encoder(built["vae"]), load_decoder(built["vae_decoder"])
    assert reconstruction_mse(encoder, decoder, held_out) == pytest.approx(report.heldout_mse)
    untrained = reconstruction_mse(VAEEncoder().eval(), VAEDecoder().eval(), held_out)
    assert untrained > 20 * HELDOUT_MSE_MAX


def test_latents_are_unit_scale_and_round_trip(built, held_out):
    encoder, decoder = load_encoder(built["vae"]), load_decoder(built["vae_decoder"])
    scale = weights_config(built["vae"])["scaling_factor"]
    assert scale == encoder.scaling_factor == decoder.scaling_factor != 1.0
    train_std = mean_latents(encoder, digit_images()[1::10]).std().item()
    assert scale == pytest.approx(1 / train_std, rel=0.1)
    with torch.no_grad():
        latents = encoder(held_out)
        images = decoder(latents)
        assert latents.shape == (180, 4, 8, 8) and images.shape == (180, 3, 64, 64)
        assert 0.8 < latents.std().item() < 1.25 and abs(latents.mean().item()) < 0.3
        assert images.min() >= -1 and images.max() <= 1
        torch.testing.assert_close(
            decoder.decode(latents), decoder.decode_unscaled(latents / scale)
        )
        torch.testing.assert_close(encoder(held_out[:1]), latents[:1])  # per sample, deterministic
        assert decoder(torch.zeros(2, 4, 4, 6)).shape == (2, 3, 32, 48)
    with pytest.raises(ValueError, match="latents"):
        decoder(torch.zeros(1, 3, 8, 8))


def test_files_load_like_the_demo_family(built):
    config = weights_config(built["vae"])
    assert set(config) == {"in_channels", "latent_channels", "base_channels", "scaling_factor"}
    encoder = load_encoder(built["vae"])
    with torch.device("meta"):
        meta = VAEEncoder(**config)  # the family's meta build (pipeline-parallel planning)
    assert set(meta.state_dict()) == set(encoder.state_dict())
    decoder = load_decoder(built["vae_decoder"])
    assert isinstance(decoder, VAEDecoder) and not decoder.training
    assert weights_config(built["vae_decoder"])["latent_channels"] == 4
    with pytest.raises(ValueError, match="does not match VAEEncoder: conv_in.weight"):
        load_weights(VAEEncoder(), built["vae_decoder"])  # same names, other shapes
    with pytest.raises(FileNotFoundError, match="build_demo_weights"):
        load_decoder(built["vae"].with_name("missing.safetensors"))


def test_build_is_deterministic(built, tmp_path):
    first = {name: path.read_bytes() for name, path in built.items()}
    clear_trained_cache()  # train again from scratch, not from the in-process cache
    again = build_demo_weights(tmp_path, seed=0)
    assert set(again) == {"vae", "vae_decoder", "dit"}
    for name, path in again.items():
        assert path.read_bytes() == first[name], name
