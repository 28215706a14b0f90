"""What a request's output must match (torch-free: the API layer builds and checks these)."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from affinity_serve.engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """Exactly one of: a JSON schema (`json`, serialized), any JSON value of type object (`json_object`), a
    regular expression, a choice among strings, or an EBNF grammar (xgrammar's dialect, GBNF-like).

    `param` names where the spec came from in the request (e.g. "response_format"), for error messages.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(f"{self.param}: give exactly one of json, json_object, regex, choice, "
                                      f"grammar (got {kinds or 'none'})", param=self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of non-empty strings",
                                      param=self.param)

    @classmethod
    def from_schema(cls, schema: Any, param: str = "structured_outputs") -> "StructuredOutputSpec":
        """A JSON schema given as an object (or its text), serialized as given: the output's properties follow
        the schema's order, and the same schema text shares one compiled grammar."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param)
        return cls(json=json.dumps(schema, ensure_ascii=False), param=param)

    @property
    def key(self) -> tuple[str, str]:
        """The compiled-grammar cache key (`param` is not part of it)."""
        if self.json is not None:
            return ("json", self.json)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("grammar", _choice_ebnf(self.choice))
        return ("grammar", self.grammar or "")

    def check(self) -> None:
        """Raise InvalidRequestError (naming `param`) if xgrammar cannot turn this into a grammar; needs no
        tokenizer and takes about a millisecond (the token-level compile is what runs off the step loop)."""
        kind, text = self.key
        if kind == "json":
            problem = unenforced_schema_keyword(json.loads(text))
            if problem is not None:
                raise InvalidRequestError(f"{self.param}: unsupported JSON schema: {problem}", param=self.param,
                                          code="invalid_grammar")
        elif kind in ("regex", "grammar"):
            problem = surrogate_escape(text, ebnf=kind == "grammar")
            if problem is not None:
                what = "regex" if kind == "regex" else "grammar"
                raise InvalidRequestError(f"{self.param}: the {what} {problem}", param=self.param,
                                          code="invalid_grammar")
        xgr = import_xgrammar(self.param)
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(text)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(text)
        except Exception as e:       # xgrammar raises RuntimeError/ValueError with the parser's message
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[kind]
            raise InvalidRequestError(f"{self.param}: unsupported or invalid {what}: {_first_line(e)}",
                                      param=self.param, code="invalid_grammar") from None


#: an escape naming a UTF-16 surrogate code point (U+D800-U+DFFF) as the grammar engine reads it: \uD800,
#: \u{D800}, \x{D800}, and \x or \U with a run of hex digits (xgrammar takes them all: \xD800 is U+D800)
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*"                          # not itself escaped
                               r"(\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\\[ux]\{0*[dD][89a-fA-F][0-9a-fA-F]{2}\}"
                               r"|\\[xU]0*[dD][89a-fA-F][0-9a-fA-F]{2}(?![0-9a-fA-F]))")


def surrogate_escape(pattern: str, ebnf: bool = False) -> str | None:
    """A message when `pattern` (a regex, an EBNF grammar with `ebnf`, a schema's `pattern`) names a UTF-16
    surrogate code point by escape outside a negated class: no UTF-8 output can contain one (the engine keeps
    every constrained output valid UTF-8), so a pattern that needs it could only end in an error mid-generation.
    None otherwise (`[^\uD800]` excludes one, which is harmless). In a grammar a '[' inside a string literal
    ("[") opens no class. One pass over the pattern, whatever the number of escapes (a request body holds up
    to megabytes)."""
    i, start = 0, None                      # start: the open class's first position after '['
    in_string = False                       # inside an EBNF string literal (then no class opens)
    comment_end = -1                        # an EBNF '#' comment runs to the end of its line
    for m in _SURROGATE_ESCAPE.finditer(pattern):
        pos = m.start(1)
        while i < pos:                      # the class state at the escape, carried on from the last one
            c = pattern[i]
            if c == "\\":
                i += 2
                continue
            if start is None:
                if ebnf and c == '"':
                    in_string = not in_string
                elif ebnf and c == "#" and not in_string:
                    end = pattern.find("\n", i)
                    i = comment_end = len(pattern) if end < 0 else end
                    continue
                elif c == "[" and not in_string:
                    start = i + 1
            elif c == "]" and i > start + (1 if pattern.startswith("^", start) else 0):
                start = None                # (a ']' first in a class, after '^' or not, is a literal)
            i += 1
        if pos < comment_end or (start is not None and pattern.startswith("^", start)):
            continue
        return (f"names {m.group(1)}, a UTF-16 surrogate code point, which no UTF-8 output can contain (the "
                "grammar engine does not join a surrogate pair into one character): write the character itself "
                "or leave it out")
    return None


def import_xgrammar(param: str = "structured_outputs"):
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(f"{param}: structured outputs need the xgrammar package on the server "
                                  "(pip install xgrammar)", param=param, code="structured_outputs_unavailable"
                                  ) from None
    return xgrammar


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else type(e).__name__
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: "; keep the message
    return msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg


def _choice_ebnf(choice: Sequence[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


# What the grammar engine (xgrammar) cannot make the output obey. Its JSON-schema converter skips these without
# an error, so an output could break the schema with a 200: refused instead, naming where.
_UNENFORCED = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
    "dependencies", "if", "then", "else", "not", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor"})
# Beside "$ref", only these may stay (the converter drops the rest of the referring schema)
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$defs", "definitions"})
#: the widest [minimum, maximum] beside multipleOf that the grammar engine enforces (measured: 2,000 is,
#: 10,000 is not; without bounds it is)
_MULTIPLE_OF_SPAN = 2000
#: regex constructs the grammar engine's pattern conversion skips
_REGEX_UNENFORCED = ("(?=", "(?!", "(?<=", "(?<!", "\\b", "\\B")
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
              "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def unenforced_schema_keyword(schema: Any, path: str = "") -> str | None:
    """The first place in a JSON schema that the output could not be made to obey (a keyword the grammar engine
    skips, a remote or anchor `$ref`, keywords beside `$ref`, an `allOf` of several schemas, a non-integer
    `multipleOf`, a negative count), as a message naming its path; None when every keyword is enforced.
    Formats are annotations (docs/structured-outputs.md lists those enforced)."""
    if not isinstance(schema, dict):
        return None
    at = f"at {path}: " if path else ""
    for key in schema:
        if key in _UNENFORCED and not (key == "uniqueItems" and schema[key] is False):
            return (f"{at}{key!r} cannot be enforced while generating (the grammar engine does not support it); "
                    "remove it and check that part of the response yourself")
    ref = schema.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return (f"{at}$ref {ref!r}: only references inside the schema (\"#/$defs/...\") are supported; "
                    "put the referenced schema in $defs")
        extra = sorted(k for k in schema if k != "$ref" and k not in _ANNOTATIONS)
        if extra:
            return (f"{at}{', '.join(extra)} beside $ref would be ignored: move them into the referenced schema")
    all_of = schema.get("allOf")
    if all_of is not None:
        extra = sorted(k for k in schema if k != "allOf" and k not in _ANNOTATIONS)
        if not isinstance(all_of, list) or len(all_of) != 1 or extra:
            return (f"{at}allOf is supported only as one schema with nothing beside it but annotations; merge "
                    "the schemas into one")
    mult = schema.get("multipleOf")
    if mult is not None:
        if not (schema.get("type") == "integer" and isinstance(mult, int) and not isinstance(mult, bool)
                and mult > 0):
            return f"{at}multipleOf is enforced only as a positive integer on \"type\": \"integer\""
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if (lo is not None or hi is not None) and (lo is None or hi is None or not isinstance(lo, (int, float))
                                                   or not isinstance(hi, (int, float))
                                                   or hi - lo > _MULTIPLE_OF_SPAN):
            return (f"{at}multipleOf with a bound is enforced only between a lower and an upper bound at most "
                    f"{_MULTIPLE_OF_SPAN:,} apart (the grammar engine drops it otherwise); give both, or neither")
    if isinstance(schema.get("pattern"), str) and surrogate_escape(schema["pattern"]) is not None:
        return f"{at}pattern {surrogate_escape(schema['pattern'])}"
    if isinstance(schema.get("patternProperties"), dict):
        for key in schema["patternProperties"]:
            if isinstance(key, str) and surrogate_escape(key) is not None:
                return f"{at}patternProperties key {surrogate_escape(key)}"
    if isinstance(schema.get("pattern"), str) and any(t in schema["pattern"] for t in _REGEX_UNENFORCED):
        return (f"{at}pattern {schema['pattern']!r}: lookarounds and word boundaries "
                f"({', '.join(_REGEX_UNENFORCED)}) are not enforced by the grammar engine")
    if "minLength" in schema or "maxLength" in schema:
        if "pattern" in schema:
            return (f"{at}minLength/maxLength beside pattern would be ignored by the grammar engine: put the "
                    "length in the pattern (e.g. ^[a-z]{3,8}$)")
        if "format" in schema:
            return f"{at}minLength/maxLength beside format would be ignored by the grammar engine: drop one"
    for key in _COUNTS:
        v = schema.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"{at}{key} must be a non-negative integer (got {v!r})"
    sub = path + "." if path else ""
    for key in _SUBSCHEMA:
        found = unenforced_schema_keyword(schema.get(key), f"{sub}{key}")
        if found:
            return found
    items = schema.get("items")
    for i, s in enumerate(items if isinstance(items, list) else [items]):
        found = unenforced_schema_keyword(s, f"{sub}items" + (f".{i}" if isinstance(items, list) else ""))
        if found:
            return found
    for key in _SUBSCHEMA_MAPS:
        m = schema.get(key)
        for name, s in (m.items() if isinstance(m, dict) else ()):
            found = unenforced_schema_keyword(s, f"{sub}{key}.{name}")
            if found:
                return found
    for key in _SUBSCHEMA_LISTS:
        lst = schema.get(key)
        for i, s in enumerate(lst if isinstance(lst, list) else ()):
            found = unenforced_schema_keyword(s, f"{sub}{key}.{i}")
            if found:
                return found
    return None
