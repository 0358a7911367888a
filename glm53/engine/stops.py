"""Stop strings over streamed text.

Text that might be the beginning of a stop string is held back until it either completes the stop string
(the completion ends there, the stop string itself is not part of the output) or cannot anymore.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add generated text. Returns (text safe to emit, the stop string that matched or None)."""
        if not self._stops:
            return text, None
        buf = self._held + text
        hit = min(((buf.find(s), s) for s in self._stops if s in buf), default=None)
        if hit is not None:
            self._held = ""
            return buf[: hit[0]], hit[1]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
