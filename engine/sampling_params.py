"""SamplingParams: what to generate for one request, validated on construction (no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from affinity_serve.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from affinity_serve.engine.structured_output import StructuredOutputSpec

_MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation parameters (vLLM / OpenAI semantics).

    temperature == 0 means greedy. `top_k=None` and `top_p=1.0` and `min_p=0.0` disable those filters.
    `logprobs=None` returns no log-probabilities; `logprobs=k` returns the chosen token's plus the top-k.
    `prompt_logprobs=k` also returns, for every prompt token after the first, its log-probability given
    the tokens before it plus the top-k alternatives (such a request does not read the prefix cache).
    `seed` makes sampling reproducible regardless of what else is in the batch.

    temperature, top_p, top_k, min_p and repetition_penalty left unset (None) take the model's
    generation_config.json defaults when the engine has them (`with_defaults`), else the neutral values
    (1.0, 1.0, no top-k, 0.0, 1.0); `unset_fields` records which were left unset (top_k None counts as
    unset: a model default applies to it). `min_tokens` masks every EOS id (unless ignore_eos) and every stop token id
    in the sampler
    until that many tokens are out. `eos_token_ids` is filled in by the engine (every EOS id of the model).
    `structured_output` constrains every token to a grammar (JSON schema, regex, choice, EBNF).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    eos_token_ids: tuple[int, ...] = ()
    #: the output must match this grammar (engine/structured_output.py); None: unconstrained
    structured_output: StructuredOutputSpec | None = None
    unset_fields: frozenset[str] = field(init=False, default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.unset_fields = frozenset(name for name in _NEUTRAL if getattr(self, name) is None)
        for name in self.unset_fields:
            setattr(self, name, _NEUTRAL[name])
        self.eos_token_ids = tuple(self.eos_token_ids or ())
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise bad("top_k", f"must be an integer >= 1 or null, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer or null, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= _MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {_MAX_LOGPROBS}] or null, got {k!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise bad(name, f"must be in [-2, 2], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", f"allows at most 16 strings, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logit_bias:
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or k < 0:
                    raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {k!r}")
                if not _finite(v) or not -100 <= v <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {v!r}")

    def copy_with(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes`, still knowing which fields the request left unset (those not changed here):
        `dataclasses.replace` recomputes them from the neutral values already filled in, so a copy made that
        way lost the model's generation_config defaults (the P/D prefill call's, a structured-output request's)."""
        new = replace(self, **changes)
        new.unset_fields = self.unset_fields - changes.keys()
        return new

    def with_defaults(self, defaults: dict[str, float | int]) -> "SamplingParams":
        """A copy with the fields this request left unset taken from `defaults` (generation_config.json's);
        self when none applies."""
        update = {k: v for k, v in defaults.items() if k in self.unset_fields}
        return replace(self, **update) if update else self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


#: the value of each field generation_config.json may default, when neither the request nor the model sets it
_NEUTRAL: dict[str, float | int | None] = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0,
                                           "repetition_penalty": 1.0}


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
