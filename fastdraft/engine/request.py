"""Whether a request can run: :func:`check_request`, the one rule every front door applies."""

from __future__ import annotations

from fastdraft.sampling_params import SamplingParams


class RejectedRequest(ValueError):
    """A request that cannot run. ``param`` names the offending input as the OpenAI API names
    it ("prompt", "max_tokens", "logit_bias"); ``code`` is OpenAI's error code, when it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise :class:`RejectedRequest` unless a request of ``prompt_token_ids`` with ``params``
    can run on a model of ``vocab_size`` tokens and ``max_model_len`` positions."""
    if not isinstance(prompt_token_ids, list) or not all(isinstance(t, int) for t in prompt_token_ids):
        raise RejectedRequest("a prompt is text or a list of token ids", "prompt")
    if not prompt_token_ids:
        raise RejectedRequest("the prompt is empty", "prompt")
    if not all(0 <= t < vocab_size for t in prompt_token_ids):
        raise RejectedRequest(f"prompt token ids must be in [0, {vocab_size}), the model's vocabulary", "prompt")
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise RejectedRequest(f"the prompt ({num_prompt} tokens) leaves no room for a token under the maximum "
                              f"model length {max_model_len}", "prompt", "context_length_exceeded")
    if num_prompt + params.max_new_tokens > max_model_len:
        raise RejectedRequest(f"prompt ({num_prompt} tokens) + max_tokens ({params.max_new_tokens}) exceeds the "
                              f"maximum model length {max_model_len}", "max_tokens", "context_length_exceeded")
    if any(t >= vocab_size for t in params.logit_bias):
        raise RejectedRequest(f"logit_bias token ids must be in [0, {vocab_size}), the model's vocabulary",
                              "logit_bias")
