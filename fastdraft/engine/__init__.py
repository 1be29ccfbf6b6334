"""Runtime: KV cache, sampling parameters, tokenizer and generation."""
