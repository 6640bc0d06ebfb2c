"""Generated tokens to text, incrementally, with stop strings.

:class:`TextStream` takes a request's tokens one at a time and returns the text that may be sent so far.
Decoding is incremental over a short window (the text of ``ids[prefix:]`` minus that of
``ids[prefix:read]``), so a token whose text depends on its neighbours (a leading space, a multi-byte
character split over tokens, shown as U+FFFD until it is complete) comes out right and each token costs
a decode of a few tokens, not of the whole answer. Special tokens (EOS) are left out of the text.

Stop strings: the text is searched for each stop string across token boundaries; at the first match the
stream stops, the text before the match is the end of the answer and the tokens up to the one that
completed the match are the ones counted. Text that could be the start of a stop string is held back
until the next tokens show whether it is one (:meth:`finish` releases it when the answer ends otherwise).
"""

from __future__ import annotations

from typing import Callable, List, Sequence

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"


class TextStream:
    """One request's text.

    Args:
        decode: ``decode(ids) -> str`` with special tokens skipped.
        stop: stop strings (non-empty).
    """

    def __init__(self, decode: Callable[[List[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: List[int] = []
        self.prefix = 0  # window start: ids[prefix:read] is text already produced
        self.read = 0
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of self.text already returned
        self.stopped = False
        #: tokens consumed: all fed ones, or those up to the one that completed a stop string
        self.num_tokens = 0

    def _decode_new(self) -> str:
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""  # nothing visible yet, or a character still incomplete
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.sent), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def feed(self, tokens: Sequence[int]) -> str:
        """Add generated tokens; returns the new text that may be sent (empty when nothing new, or after
        a stop string: then :attr:`stopped` is set)."""
        out = []
        for t in tokens:
            if self.stopped:
                break
            self.ids.append(int(t))
            self.num_tokens += 1
            new = self._decode_new()
            if not new:
                continue
            start = max(self.sent, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
            self.text += new
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        end = len(self.text) if self.stopped else len(self.text) - self._held()
        if end > self.sent:
            out.append(self.text[self.sent:end])
            self.sent = end
        return "".join(out)

    def finish(self) -> str:
        """The answer ended (EOS, length): the text still held back, and any incomplete character."""
        if not self.stopped:
            tail = self.decode(self.ids[self.prefix:])
            before = self.decode(self.ids[self.prefix:self.read])
            if len(tail) > len(before):
                self.text += tail[len(before):]
                self.prefix = self.read = len(self.ids)
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return rest
