"""Structured outputs: output constrained by a JSON schema, regex, choice or grammar.

- backend.py: the interface (compile (kind, spec) -> grammar -> per-request matcher),
  bitmask layout, backend selection;
- xgrammar_backend.py (default), guidance_backend.py (llguidance);
- validate.py: the frontend's tokenizer-free check (ValueError naming the field);
- manager.py: compiling off the step loop, the cache, one matcher per sequence.

The bitmask is applied on the device by flowengine/sample/grammar_bitmask.py.
"""

from flowengine.structured_outputs.backend import BACKEND_NAMES, select_backend
from flowengine.structured_outputs.validate import validate_structured_outputs

__all__ = ["BACKEND_NAMES", "select_backend", "validate_structured_outputs"]
