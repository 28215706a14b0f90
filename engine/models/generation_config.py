"""What a checkpoint says about generation: every EOS id (config.json, generation_config.json, the tokenizer)
and generation_config.json's sampling defaults, applied where a request leaves a field unset (vLLM's
`--generation-config auto`)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from affinity_serve.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

#: generation_config.json key -> SamplingParams field (the ones vLLM takes from it)
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    #: SamplingParams field -> default, only the ones the file sets
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str | Path) -> "GenerationConfig":
        """The directory's generation_config.json, or an empty one when there is none."""
        file = Path(path) / "generation_config.json"
        if not file.is_file():
            return cls()
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{str(file)!r} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationConfig":
        defaults = {ours: data[key] for key, ours in _SAMPLING_KEYS.items() if data.get(key) is not None}
        if defaults.get("top_k") == 0:                  # transformers' "no top-k"
            defaults.pop("top_k")
        return cls(as_ids(data.get("eos_token_id")), defaults)


def as_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` entry (an int, a list of ints, or null) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def all_eos_token_ids(tokenizer_eos: int | None, config_eos: tuple[int, ...], gen: GenerationConfig
                      ) -> tuple[int, ...]:
    """Every EOS id, the primary first: the tokenizer's, else config.json's first; then the rest of
    config.json's and generation_config.json's, in order, without repeats."""
    ordered = ([tokenizer_eos] if tokenizer_eos is not None else []) + list(config_eos) + list(gen.eos_token_ids)
    return tuple(dict.fromkeys(ordered))
