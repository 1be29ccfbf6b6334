"""Building blocks of the decoder: norms, rotary embeddings, attention, sampling."""
