"""Real model families through diffusers: SD 1.x/2.x, SDXL, SD3, FLUX.1."""
