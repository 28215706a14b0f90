"""Structured outputs (issue 27): the output of a request follows a grammar (JSON schema, regex, choice, EBNF).

Follows vLLM v1's `structured_output` package: the engine owns a `StructuredOutputManager` (manager.py); a
request whose grammar is still compiling waits in `RequestStatus.WAITING_FOR_GRAMMAR` (outside the token budget);
every step the manager fills one bitmask for the scheduled rows that sample; the sampler masks those rows' logits
before anything else; each accepted token advances the sequence's own matcher. xgrammar is imported on first
use, so the engine runs without it until a request asks for structured output. This package's top level is
torch-free (the API layer builds `StructuredOutputSpec`s); the manager lives in `.manager`.
"""
from affinity_serve.engine.structured_output.spec import StructuredOutputSpec, unenforced_schema_keyword

__all__ = ["StructuredOutputSpec", "unenforced_schema_keyword"]
