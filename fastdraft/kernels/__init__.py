"""Fast CPU kernels (to come), each with a plain PyTorch reference twin."""
