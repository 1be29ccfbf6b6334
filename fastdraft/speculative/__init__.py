"""Speculative decoding in the engine's steps: the configuration (``speculative_config.py``) and what it
builds (``factory.py``): proposers (draft model, the target's own INT4 copy, n-gram lookup),
the draft's frequent-token vocabulary, and the draft length chosen by load. Verification (greedy
matching or rejection sampling) runs in the engine's model runner."""
