"""Stop strings matched on characters, across token boundaries, in a text stream.

A stop string may span several tokens or sit inside one, so matching works on the
text deltas, not on tokens. Text that could be the start of a stop string is held
back until the next delta decides, so nothing after a stop string is ever emitted.
"""

from __future__ import annotations


class StopStringChecker:
    """Cuts a stream of text deltas at the first stop string.

    Args:
        stop: non-empty strings (SamplingParams validates them).
        include_stop_str_in_output: keep the matched stop string at the end of the
            text (vLLM's option); otherwise the text ends just before it.

    "First" means the match that completes earliest in the text, which does not
    depend on how the text was split into deltas; among matches completing at the
    same character, the one starting earliest (the longest) wins.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty; remove the empty string")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._pending = ""
        self.matched: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.matched is not None

    def _first_match(self, min_end: int) -> tuple[int, int, str] | None:
        """The first match ending after character `min_end` of the pending text."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = self._pending.find(s, max(0, min_end - len(s) + 1))
            if start < 0:
                continue
            end = start + len(s)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, s)
        return best

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the pending text that a stop string starts with.

        For each stop string, candidate suffixes begin at an occurrence of its first
        character among the last len(stop) - 1 characters (found by `str.find`, in C);
        the earliest one that starts the stop string is that string's longest. A suffix
        as long as the stop string itself is a match, found before this is called (or
        not allowed to match, `process(can_match=False)`, and emitted).
        """
        pending = self._pending
        num_pending = len(pending)
        longest = 0
        for stop in self.stop:
            first = stop[0]
            start = num_pending - len(stop) + 1
            i = pending.find(first, start if start > 0 else 0)
            while i >= 0 and num_pending - i > longest:
                if stop.startswith(pending[i:]):
                    longest = num_pending - i
                    break
                i = pending.find(first, i + 1)
        return longest

    def process(self, delta: str, can_match: bool = True) -> tuple[str, str | None]:
        """Feed a text delta. Returns (text safe to emit now, matched stop string or None).

        can_match False: the delta may start a stop string but not end one (the text
        of the first min_tokens tokens); what could start one is held back all the same.
        A match must end in the delta (one ending before it was found, or not allowed,
        then). After a match, the text is final: later deltas return ("", None).
        """
        if self.matched is not None:
            return "", None
        num_old = len(self._pending)
        self._pending += delta
        match = self._first_match(num_old) if can_match else None
        if match is not None:
            end, start, stop = match
            text = self._pending[: end if self.include_stop_str_in_output else start]
            self._pending = ""
            self.matched = stop
            return text, stop
        hold = self._held_back_length()
        cut = len(self._pending) - hold
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, None

    def flush(self) -> str:
        """At the end of the request (no stop string matched): release held-back text."""
        text, self._pending = self._pending, ""
        return text
