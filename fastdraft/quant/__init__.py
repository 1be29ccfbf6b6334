"""Weight-only low-bit quantization (to come: RTN, GPTQ, AWQ)."""
