"""Stop strings, found across token boundaries.

Text arrives in pieces. A piece may end with the start of a stop string ("\\n\\nUs" of
"\\n\\nUser:"), so that tail is held back until the next piece shows whether the stop
string completes (then the text ends before it) or not (then the tail is released).

Cost is linear in the text: per stop string, the length of the text's longest suffix that
begins it is carried from piece to piece by the Knuth-Morris-Pratt automaton (amortized
O(1) a character), and the held tail is the longest of those, so it is shorter than the
longest stop string (which the API caps, openai_schema.MAX_STOP_CHARS). A piece is searched
for whole stop strings together with that tail only: a stop string that starts before the
tail cannot complete.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.is_stopped = False
        self._failure = [_prefix_function(s) for s in self.stops]
        # Per stop: the length of the longest suffix of the text so far that is a proper
        # prefix of it (the automaton's state). `held` is the longest of them.
        self._matched = [0] * len(self.stops)

    def push(self, text: str) -> str:
        """Add text; return what is safe to emit. Sets `is_stopped` when a stop string
        completes (the returned text then ends just before it)."""
        if self.is_stopped:
            return ""
        if not self.stops:
            return text
        buffer = self.held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.is_stopped = True
            self.held = ""
            return buffer[:cut]
        keep = self._advance(text)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The stream ended without a stop string: release the held tail."""
        out, self.held = self.held, ""
        return "" if self.is_stopped else out

    def _advance(self, text: str) -> int:
        """Feed text to every stop's automaton; the longest partial match after it. (No
        stop completes here: push found none in the held tail plus text.)"""
        best = 0
        for j, stop in enumerate(self.stops):
            failure, q, last = self._failure[j], self._matched[j], len(stop) - 1
            for ch in text:
                while q and stop[q] != ch:
                    q = failure[q - 1]
                if stop[q] == ch:
                    q += 1
                    if q > last:  # a whole match (push rules it out): stay a proper prefix
                        q = failure[q - 1]
            self._matched[j] = q
            best = max(best, q)
        return best


def _prefix_function(s: str) -> list[int]:
    """KMP: failure[i] = the length of the longest proper prefix of s[:i + 1] that is also
    a suffix of it."""
    failure = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = failure[q - 1]
        if s[i] == s[q]:
            q += 1
        failure[i] = q
    return failure
