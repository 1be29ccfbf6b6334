"""Speculative decoding: configuration, proposers (draft model, prompt lookup), a frequent-token
draft vocabulary, adaptive draft length, and verification by greedy matching or rejection sampling."""
