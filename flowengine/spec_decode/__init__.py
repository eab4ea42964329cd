"""Speculative decoding: proposers of draft tokens and their configuration.

`SpeculativeConfig` (config.py) parses vLLM's `--speculative-config` JSON; the n-gram
proposer (ngram.py) is pure logic that the scheduler runs on token ids; verification
of the drafts runs in the executor (flowengine/executor/spec_verify.py). See
docs/design.md, "Speculative decoding".
"""

from flowengine.spec_decode.config import SpeculativeConfig
from flowengine.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
