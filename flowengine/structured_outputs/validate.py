"""The frontend's check of a constraint, before a request enters the engine.

Tokenizer-free and fast (the grammar is parsed, not compiled against the vocabulary),
so an invalid schema, regex or grammar is a ValueError (HTTP 400) before anything is
generated. The engine compiles the same (kind, spec) with the same backend choice
(`select_backend`), so a constraint that passes here compiles there.
"""

from __future__ import annotations

import functools
import json

from flowengine.errors import RequestValidationError
from flowengine.sampling_params import StructuredOutputsParams
from flowengine.structured_outputs.backend import BACKEND_NAMES, GrammarOptions, select_backend
from flowengine.structured_outputs.schema_check import unsatisfiable_json_schema


def grammar_options(params: StructuredOutputsParams) -> GrammarOptions:
    return GrammarOptions(params.disable_any_whitespace, params.disable_additional_properties)


def validate_structured_outputs(params: StructuredOutputsParams, backend: str = "auto",
                                *, field: str | None = None) -> str:
    """Check that `params` compiles with `backend` ("auto", "xgrammar", "guidance").

    Returns the backend that will compile it. Raises RequestValidationError (a
    ValueError) naming the field
    (`field` replaces "structured_outputs.<kind>" in the message, e.g. with an HTTP
    request's "response_format.json_schema.schema") and the reason: a syntax error, or
    the unsupported schema keyword by name, or why a JSON schema is unsatisfiable (the
    cases `schema_check.unsatisfiable_json_schema` detects).
    """
    if backend not in BACKEND_NAMES:
        raise RequestValidationError(f"structured outputs backend must be one of {BACKEND_NAMES}, "
                         f"got {backend!r}")
    kind, spec = params.kind, params.spec
    check = _check if len(spec) <= _CACHED_SPEC_CHARS else _check.__wrapped__
    chosen, error = check(backend, kind, spec, grammar_options(params))
    if error is not None:
        if field is not None:
            error = error.replace(f"structured_outputs.{kind}", field, 1)
        raise RequestValidationError(error)
    return chosen


# Clients send the same schema with every request (an agent's tool set, a batch of
# extractions): parsing it costs ~0.2 ms, which 128 concurrent requests would pay one
# after another on the frontend's loop. The check depends only on these four values.
# Specs longer than _CACHED_SPEC_CHARS are checked every time, so the cache holds at
# most 256 x 64 KiB whatever clients send.
_CACHED_SPEC_CHARS = 64 * 1024


@functools.lru_cache(maxsize=256)
def _check(backend: str, kind: str, spec: str,
           options: GrammarOptions) -> tuple[str, str | None]:
    """(the backend that compiles (kind, spec), None) or (that backend, the error)."""
    chosen = select_backend(backend, kind, spec)
    if kind == "json":
        # Before the backend: xgrammar compiles some impossible schemas (const 5 with type
        # string becomes the grammar `5`), and the reason reads the same on both backends.
        reason = unsatisfiable_json_schema(json.loads(spec))
        if reason is not None:
            return chosen, (f"structured_outputs.json is unsatisfiable, no JSON value can "
                            f"match it: {reason}")
    try:
        if chosen == "xgrammar":
            from flowengine.structured_outputs.xgrammar_backend import validate_xgrammar

            validate_xgrammar(kind, spec, options)
        else:
            from flowengine.structured_outputs.guidance_backend import validate_guidance

            validate_guidance(kind, spec, options)
    except ValueError as exc:
        return chosen, str(exc)
    return chosen, None
