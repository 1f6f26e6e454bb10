"""Stage 2: launch torchrun, train V1 + the denoiser from the cache, checkpoint, export."""
