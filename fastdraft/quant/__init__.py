"""Weight-only low-bit quantization: the canonical INT4/INT6/INT8 formats, RTN, GPTQ and AWQ,
quantized checkpoints, accuracy evaluation against the unquantized model, and the automatic
search for the fastest configuration within an accuracy target."""
