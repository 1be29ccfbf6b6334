"""Speculative decoding (to come: proposers, verifier, rejection sampler)."""
