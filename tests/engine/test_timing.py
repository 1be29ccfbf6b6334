"""The automatic search's timer: the serving engine's batch-1 decode step on a tiny model."""

from __future__ import annotations

import pytest

from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.timing import DecodeStepTimer
from fastdraft.kernels.build import load_cpu_kernels
from fastdraft.models.fused_decoder import FusedDecoder


def test_decode_step_timer_rejects_bad_arguments():
    for kwargs in (dict(num_steps=0), dict(num_steps=2, context_len=-1), dict(num_steps=2, block_size=0)):
        with pytest.raises(ValueError, match="num_steps"):
            DecodeStepTimer(**kwargs)


def test_decode_step_timer_times_the_model_runners_step(tiny_loaded, monkeypatch):
    """The timed pass is the engine's: ModelRunner.logits over one token after
    ``context_len`` cached ones, through the runner's C++ step wherever the kernels exist."""
    passes, cpp_steps = [], []
    runner_logits, run = ModelRunner.logits, FusedDecoder._run

    def spy_logits(self, input_ids, meta, rows):
        passes.append((self.decoder, input_ids.numel(), list(meta.context_lens), rows))
        return runner_logits(self, input_ids, meta, rows)

    def spy_run(self, *args, **kwargs):
        cpp_steps.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "logits", spy_logits)
    monkeypatch.setattr(FusedDecoder, "_run", spy_run)
    ms = DecodeStepTimer(num_steps=3, context_len=20, block_size=16).time(tiny_loaded.model)
    assert ms > 0
    assert len(passes) == 4  # a warm-up pass, then the timed ones
    assert all((n, lens, rows) == (1, [21], [0]) for _, n, lens, rows in passes)
    if load_cpu_kernels() is None:
        assert all(decoder is None for decoder, *_ in passes) and not cpp_steps
    else:
        decoders = {id(decoder) for decoder, *_ in passes}
        assert len(decoders) == 1 and isinstance(passes[0][0], FusedDecoder)
        assert len(cpp_steps) == 4 and all(step is passes[0][0] for step in cpp_steps)

