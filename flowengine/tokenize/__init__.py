"""Text side of the engine: tokenizer loading, chat templates, incremental
detokenization and stop strings (DESIGN.md §7)."""

from flowengine.tokenize.chat import apply_chat_template, validate_messages
from flowengine.tokenize.detokenizer import IncrementalDetokenizer
from flowengine.tokenize.stop_checker import StopStringChecker
from flowengine.tokenize.text_state import IncrementalTextState
from flowengine.tokenize.tokenizer import TokenizerInfo, encode, load_tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "IncrementalTextState",
    "StopStringChecker",
    "TokenizerInfo",
    "apply_chat_template",
    "encode",
    "load_tokenizer",
    "validate_messages",
]
