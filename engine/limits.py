"""EngineLimits: the request limits one built engine enforces, and the one check against them.

Torch-free, so the ingress can check requests with the same code as the engine: a replica publishes its
engine's value (after the KV pool is sized) and the ingress fetches it once; nothing is predicted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from affinity_serve.engine.errors import ContextLengthExceededError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a request must fit into.

    max_model_len: the context length (prompt + output tokens), already capped at the KV capacity.
    vocab_size: prompt token ids must lie in [0, vocab_size); None where the caller only knows lengths.
    max_kv_tokens: the KV slots one request can ever hold.
    block_size: tokens per KV block, which the prompt's block hashes must be computed with (the ingress
        hashes prompts once for routing and hands the hashes on); None where unknown: send no hashes.
    """

    max_model_len: int
    vocab_size: int | None
    max_kv_tokens: int
    block_size: int | None = None

    def check(self, prompt: Sequence[int] | int, max_tokens: int) -> None:
        """Raise InvalidRequestError (or ContextLengthExceededError) if the request can never be served.

        `prompt` is the token ids (then also checked against the vocabulary) or just their count. A prompt
        plus max_tokens longer than the context is served: it stops at max_model_len with finish_reason
        "length". The HTTP API is stricter, as OpenAI's is: see `check_fits_context`. Runs once per request
        (`EngineRequest.checked_limits` carries a caller's check to the engine).
        """
        n = prompt if isinstance(prompt, int) else len(prompt)
        if n == 0:
            raise InvalidRequestError("prompt is empty; send at least one token", param="prompt",
                                      code="invalid_value")
        if n >= self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} "
                f"tokens; shorten it to at most {self.max_model_len - 1} tokens")
        if not isinstance(prompt, int) and self.vocab_size is not None:
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})",
                                          param="prompt", code="invalid_value")
        if max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1", param="max_tokens", code="invalid_value")
        worst = min(n + max_tokens, self.max_model_len)
        if worst > self.max_kv_tokens:
            raise ContextLengthExceededError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {worst} tokens of KV cache but this "
                f"engine holds at most {self.max_kv_tokens}; lower max_tokens or shorten the prompt",
                param="max_tokens")

    def check_fits_context(self, prompt: Sequence[int] | int, max_tokens: int) -> None:
        """`check`, and the OpenAI contract on top: prompt + max_tokens must fit the context."""
        self.check(prompt, max_tokens)
        n = prompt if isinstance(prompt, int) else len(prompt)
        if n + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n} "
                f"tokens and max_tokens is {max_tokens}; lower max_tokens or shorten the prompt",
                param="max_tokens")
