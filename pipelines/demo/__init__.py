"""The demo family: a small text-to-image pipeline (MiniLM, a conv VAE, a DiT) on the digits."""
