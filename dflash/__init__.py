"""DFlash block-diffusion speculative decoding: the method, framework-free (torch + transformers)."""
