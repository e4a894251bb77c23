"""Stop strings, found across token boundaries.

Text arrives in pieces. A piece may end with the start of a stop string ("\\n\\nUs" of
"\\n\\nUser:"), so that tail is held back until the next piece shows whether the stop
string completes (then the text ends before it) or not (then the tail is released).
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.is_stopped = False

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
        keep = self._partial_match_len(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The stream ended without a stop string: release the held tail."""
        out, self.held = self.held, ""
        return "" if self.is_stopped else out

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:k]):
                    best = k
                    break
        return best
