"""Whole generations judged against the decoder's own autoregressive decoding (:class:`GenerationJudge`).

The tuner (:mod:`taps.tuner`) chooses each step's draft from predicted costs and values; its predictions err
(a price measured at a slow moment of a shared machine, steps that pay for the one before them, a plan's own
time), and at a batch of 8 on a CPU without AMX the shipped drafters' trees cost about what they save: there
the tuned rows ran at 0.86-0.95x the decoder's autoregressive throughput while the same decoders held to plain
steps by their tuner ran at 0.94-0.98x (bf16, Zen 4; bench/RESULTS.md). The judge measures what no prediction
gives: how long a generation took against how long plain steps would have taken for the same tokens, and runs
the next generations of that batch size as autoregressive ones (no drafter started or kept current: the
decoder's lean plain steps) where drafting lost.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

__all__ = ["GenerationJudge"]


@dataclass
class _Track:
    """One (verification mode, batch size)'s judgement: see :class:`GenerationJudge`."""

    #: plain step seconds by rows, from the reference generations: rows -> [weighted seconds, weight]
    reference: Dict[int, List[float]] = field(default_factory=dict)
    ratio: Optional[float] = None  # running ratio of tuned generations' seconds to their plain counterfactual
    plain_left: int = 0  # plain generations to run before the next tuned one
    losses: int = 0  # judgements in a row that drafting lost (the plain run doubles with each)
    tuned: int = 0  # tuned generations since the last reference generation
    refresh: int = 0  # tuned generations between reference generations (0: the judge's own refresh)
    waiting: List[Tuple[float, Tuple[int, ...]]] = field(default_factory=list)  # tuned ones not judged yet
    warm: bool = False  # a tuned generation ran (the first is not judged: see GenerationJudge.tuned)
    doubled: bool = False  # the refresh interval doubled since the last reference
    judged: int = 0  # tuned generations judged


class GenerationJudge:
    """Judges a decoder's tuned generations (``SpeculativeDecoder.generate`` with a tuner) against its own
    autoregressive decoding, per verification mode (greedy, sampled) and batch size (of `min_batch` requests or
    more).

    Each tuned generation's decoding seconds (after the prefill, to its last step) are compared with its
    *counterfactual* (the first tuned generation of each is not judged: it pays one-off costs): its requests'
    emitted token counts replayed as autoregressive steps (one token for each unfinished request a step, finished
    requests dropped as the decoder drops them, ``taps.decoder.DROP_SHARE``), each step at the measured seconds of
    a plain step over that many rows. Those come from *reference* generations, which run every step plain with no
    drafter started (what ``strategy="autoregressive"`` runs): the second generation of a batch size, then one after
    every `refresh` tuned ones (the interval doubling after each reference, up to `most_refresh`, while drafting
    wins by more than `clear_win`); each row count's seconds are a running mean over them (weight `alpha_reference`
    for the newest). The ratio (tuned / counterfactual) is a running mean too (weight `alpha`); from the
    `min_judged`-th judged generation on, unless it is below ``1 - margin`` (drafting won by more than `margin`),
    drafting lost, and the next 1, 2, 4, ... up to `most`
    generations of that batch size run plain (each a reference too), then a tuned one is judged again.

    Whole generations on a shared machine vary by ~10% from one to the next: a verdict rests on running means,
    a draw that loses runs as plain (a tie is no reason to pay for drafting), and a loss costs one plain
    generation at first. Verification is the same either way: the tokens at temperature 0 (and the distribution at
    any temperature) do not depend on the judge.

    Args:
        margin: how far below its counterfactual the running ratio must be for drafting to stay.
        most: the most plain generations in a row between two tuned ones.
        refresh: tuned generations between two reference generations while drafting does not win clearly.
        most_refresh: the most tuned generations between two reference generations.
        clear_win: a running ratio below ``1 - clear_win`` doubles the refresh interval at each reference.
        alpha: the weight of the newest ratio in the running one.
        alpha_reference: the weight of the newest reference in each row count's plain step seconds.
        min_batch: the smallest batch judged (at a batch of 1 the tuner's plain steps and drafts are priced well
            enough, and a reference generation costs the drafts' whole gain: prompt lookup's 1.5-1.7x).
        min_judged: tuned generations judged before the first verdict (one generation's ratio alone misjudged
            both ways in some runs: prompt lookup at 1.1x autoregressive as a loss, the store at 0.9x as a win).
    """

    def __init__(self, margin: float = 0.02, most: int = 16, refresh: int = 4, most_refresh: int = 64,
                 clear_win: float = 0.15, alpha: float = 0.5, alpha_reference: float = 0.3, min_batch: int = 2,
                 min_judged: int = 2):
        for name, value, low in (("most", most, 1), ("refresh", refresh, 1), ("most_refresh", most_refresh, 1),
                                 ("min_batch", min_batch, 1), ("min_judged", min_judged, 1)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"GenerationJudge: {name} must be an integer >= {low}, got {value!r}")
        for name, value in (("alpha", alpha), ("alpha_reference", alpha_reference)):
            if not 0 < value <= 1:
                raise ValueError(f"GenerationJudge: {name} must be in (0, 1], got {value!r}")
        if not 0 <= margin < 1 or not 0 <= clear_win < 1:
            raise ValueError(f"GenerationJudge: margin and clear_win must be in [0, 1), got {margin!r}, {clear_win!r}")
        self.margin, self.most, self.refresh = float(margin), int(most), int(refresh)
        self.most_refresh, self.clear_win = max(int(most_refresh), int(refresh)), float(clear_win)
        self.alpha, self.alpha_reference, self.min_batch = float(alpha), float(alpha_reference), int(min_batch)
        self.min_judged = int(min_judged)
        self.tracks: Dict[Hashable, _Track] = {}

    def judges(self, batch: int) -> bool:
        """Whether generations of `batch` requests are judged (`min_batch`)."""
        return batch >= self.min_batch

    def _track(self, key: Hashable) -> _Track:
        track = self.tracks.get(key)
        if track is None:
            track = self.tracks[key] = _Track(refresh=self.refresh)
        return track

    def plain(self, key: Hashable) -> bool:
        """Whether the next generation of `key` (verification mode, batch size) runs plain (a reference); call once
        per generation, before it runs."""
        track = self._track(key)
        if track.plain_left > 0:
            track.plain_left -= 1
            return True
        # the first reference after the first tuned generation (a single generate() call stays tuned), then one
        # every `refresh` tuned ones
        return track.tuned >= (1 if not track.reference else track.refresh)

    def tuned(self, key: Hashable, seconds: float, lengths: Sequence[int]) -> Optional[float]:
        """A tuned generation of `key` took `seconds` to decode its requests' `lengths` tokens (each request's
        emitted tokens, the prefill's first one included). Returns its ratio to the counterfactual, or None while
        there is no reference yet (it is judged when one comes)."""
        track = self._track(key)
        track.tuned += 1
        if not track.warm:
            # the first is not judged: its steps paid the one-off costs (the drafters' starts and calibration, the
            # kernels a CPU library builds for each new product shape: 3x its later generations' decoding here)
            track.warm = True
            return None
        if not track.reference:
            track.waiting = (track.waiting + [(float(seconds), tuple(int(n) for n in lengths))])[-4:]
            return None
        return self._judge(track, seconds, lengths)

    def reference(self, key: Hashable, steps: Sequence[Tuple[int, float]]) -> None:
        """A plain generation of `key` ran `steps`: (rows, seconds) per step."""
        track = self._track(key)
        track.tuned = 0
        track.doubled = False
        sums: Dict[int, List[float]] = {}
        for rows, seconds in steps:
            s = sums.setdefault(int(rows), [0.0, 0])
            s[0] += seconds
            s[1] += 1
        for rows, (total, count) in sums.items():
            mean = total / count
            old = track.reference.get(rows)
            track.reference[rows] = [mean, count] if old is None else \
                [old[0] + self.alpha_reference * (mean - old[0]), old[1] + count]
        waiting, track.waiting = track.waiting, []
        for seconds, lengths in waiting:
            self._judge(track, seconds, lengths)

    def counterfactual(self, key: Hashable, lengths: Sequence[int]) -> Optional[float]:
        """Seconds the plain steps of `key`'s reference would take to emit `lengths` tokens (None: no reference)."""
        track = self.tracks.get(key)
        if track is None or not track.reference:
            return None
        return _replay(track.reference, lengths)

    def _judge(self, track: _Track, seconds: float, lengths: Sequence[int]) -> Optional[float]:
        plain = _replay(track.reference, lengths)
        if plain <= 0:
            return None
        ratio = seconds / plain
        track.ratio = ratio if track.ratio is None else track.ratio + self.alpha * (ratio - track.ratio)
        track.judged += 1
        if track.judged < self.min_judged:
            return ratio
        if track.ratio > 1.0 - self.margin:
            track.plain_left = min(2 ** track.losses, self.most)
            track.losses += 1
            track.refresh = self.refresh
        else:
            track.losses = 0
            if track.ratio < 1.0 - self.clear_win:
                if not track.doubled:  # (once per reference)
                    track.refresh = min(track.refresh * 2, self.most_refresh)
                    track.doubled = True
            else:
                track.refresh = self.refresh
        return ratio

    def state(self, key: Hashable) -> dict:
        """What the judge holds for `key`: the running ratio, the plain generations left, the reference rows."""
        track = self.tracks.get(key)
        if track is None:
            return {}
        return {"ratio": track.ratio, "plain_left": track.plain_left, "refresh": track.refresh,
                "reference": {rows: v[0] for rows, v in sorted(track.reference.items())}}


def _replay_rows(lengths: Sequence[int]) -> List[int]:
    """The rows of each autoregressive step for requests that emit `lengths` tokens each (the first from the
    prefill): a step per token after the first, over the unfinished requests' rows, finished ones dropped once they
    are 1 / DROP_SHARE of the rows (as SpeculativeDecoder._drop_finished drops them)."""
    from .decoder import DROP_SHARE

    lengths = [max(int(n), 1) for n in lengths]
    rows = list(range(len(lengths)))
    out = []
    for step in range(1, max(lengths, default=1)):
        out.append(len(rows))
        # after this step every request has emitted min(step + 1, its length) tokens
        done = [b for b in rows if lengths[b] <= step + 1]
        if DROP_SHARE is not None and done and len(done) < len(rows) and len(done) * DROP_SHARE >= len(rows):
            gone = set(done)
            rows = [b for b in rows if b not in gone]
    return out


def _replay(reference: Dict[int, List[float]], lengths: Sequence[int]) -> float:
    """Autoregressive decoding's seconds for requests that emit `lengths` tokens each: its steps
    (:func:`_replay_rows`), each at the reference's seconds for its rows (interpolated between the measured row
    counts, the nearest beyond them)."""
    measured = sorted(reference)
    seconds = [reference[r][0] for r in measured]

    def cost(rows: int) -> float:
        i = bisect.bisect_left(measured, rows)
        if i < len(measured) and measured[i] == rows:
            return seconds[i]
        if i == 0:
            return seconds[0]
        if i == len(measured):
            return seconds[-1]
        r0, r1 = measured[i - 1], measured[i]
        return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (rows - r0) / (r1 - r0)

    return sum(cost(rows) for rows in _replay_rows(lengths))
