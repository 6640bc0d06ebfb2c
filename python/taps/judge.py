"""Whole generations judged against the decoder's own autoregressive decoding (:class:`GenerationJudge`).

The tuner (:mod:`taps.tuner`) chooses each step's draft from predicted costs and values; its predictions err
(a price measured at a slow moment of a shared machine, steps that pay for the one before them, a plan's own
time), and at a batch of 8 on a CPU without AMX the shipped drafters' trees cost about what they save: there
the tuned rows ran at 0.86-0.95x the decoder's autoregressive throughput while the same decoders held to plain
steps by their tuner ran at 0.94-0.98x (bf16, Zen 4; bench/RESULTS.md). The judge measures what no prediction
gives: how long a generation took against how long plain steps would have taken for the same tokens, and runs
the next generations of that batch size as autoregressive ones (no drafter started or kept current: the
decoder's lean plain steps) where drafting lost. :class:`WindowJudge` does the same for a continuous batch
(``taps.batching.ContinuousBatch``, the server's) over windows of steps.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

__all__ = ["GenerationJudge", "WindowJudge"]


@dataclass
class _Track:
    """One judgement's state (a GenerationJudge keeps one per verification mode and batch size, a WindowJudge one)."""

    #: plain step seconds by rows, from the reference runs: rows -> [running mean seconds, steps measured]
    reference: Dict[int, List[float]] = field(default_factory=dict)
    ratio: Optional[float] = None  # running ratio of tuned runs' seconds to their plain counterfactual
    plain_left: int = 0  # plain runs to make before the next tuned one
    losses: int = 0  # verdicts in a row that drafting lost (the plain run doubles with each)
    tuned: int = 0  # tuned runs since the last reference
    refresh: int = 0  # tuned runs between references
    waiting: List[Tuple[float, Dict[int, float]]] = field(default_factory=list)  # tuned runs not judged yet
    warm: bool = False  # a tuned run was made (the first is not judged: it pays one-off costs)
    doubled: bool = False  # the refresh interval doubled since the last reference
    judged: int = 0  # tuned runs judged


class _Judge:
    """The verdicts both judges reach over their *runs* (whole generations, or windows of steps): see
    :class:`GenerationJudge`."""

    def __init__(self, margin: float = 0.02, most: int = 16, refresh: int = 4, most_refresh: int = 64,
                 clear_win: float = 0.15, alpha: float = 0.5, alpha_reference: float = 0.3, min_judged: int = 2,
                 clear_loss: float = 0.05):
        for name, value, low in (("most", most, 1), ("refresh", refresh, 1), ("most_refresh", most_refresh, 1),
                                 ("min_judged", min_judged, 1)):
            _check_int(name, value, low, type(self).__name__)
        for name, value in (("alpha", alpha), ("alpha_reference", alpha_reference)):
            if not 0 < value <= 1:
                raise ValueError(f"{type(self).__name__}: {name} must be in (0, 1], got {value!r}")
        if not 0 <= margin < 1 or not 0 <= clear_win < 1 or not 0 <= clear_loss < 1:
            raise ValueError(f"{type(self).__name__}: margin, clear_win and clear_loss must be in [0, 1), got "
                             f"{margin!r}, {clear_win!r}, {clear_loss!r}")
        self.margin, self.most, self.refresh = float(margin), int(most), int(refresh)
        self.most_refresh, self.clear_win = max(int(most_refresh), int(refresh)), float(clear_win)
        self.alpha, self.alpha_reference, self.min_judged = float(alpha), float(alpha_reference), int(min_judged)
        self.clear_loss = float(clear_loss)

    def _new_track(self) -> _Track:
        return _Track(refresh=self.refresh)

    def _next_plain(self, track: _Track) -> bool:
        """Whether the next run is plain (a reference): while a verdict's plain runs last; the first reference after
        the first tuned run (a single run stays tuned), then one every `refresh` tuned ones."""
        if track.plain_left > 0:
            track.plain_left -= 1
            return True
        return track.tuned >= (1 if not track.reference else track.refresh)

    def _tuned(self, track: _Track, seconds: float, weights: Dict[int, float]) -> Optional[float]:
        """A tuned run took `seconds` for what plain steps would have done in ``weights[rows]`` steps over each
        number of rows: its ratio to that counterfactual, or None (the first run; no reference yet: judged when one
        comes)."""
        track.tuned += 1
        if not track.warm:
            # the first is not judged: its steps paid the one-off costs (the drafters' starts and calibration, the
            # kernels a CPU library builds for each new product shape: 3x the later generations' decoding here)
            track.warm = True
            return None
        if not track.reference:
            track.waiting = (track.waiting + [(float(seconds), dict(weights))])[-4:]
            return None
        return self._judge(track, seconds, weights)

    def _reference(self, track: _Track, steps: Sequence[Tuple[int, float]]) -> None:
        """A plain run's steps: (rows, seconds) each."""
        track.tuned = 0
        track.doubled = False
        sums: Dict[int, List[float]] = {}
        for rows, seconds in steps:
            total = sums.setdefault(int(rows), [0.0, 0])
            total[0] += seconds
            total[1] += 1
        for rows, (total, count) in sums.items():
            mean = total / count
            old = track.reference.get(rows)
            track.reference[rows] = [mean, count] if old is None else \
                [old[0] + self.alpha_reference * (mean - old[0]), old[1] + count]
        waiting, track.waiting = track.waiting, []
        for seconds, weights in waiting:
            self._judge(track, seconds, weights)

    def _judge(self, track: _Track, seconds: float, weights: Dict[int, float]) -> Optional[float]:
        plain = _plain_seconds(track.reference, weights)
        if plain <= 0:
            return None
        ratio = seconds / plain
        track.ratio = ratio if track.ratio is None else track.ratio + self.alpha * (ratio - track.ratio)
        track.judged += 1
        if track.judged < self.min_judged:
            return ratio
        if track.ratio > 1.0 - self.margin:
            track.plain_left = min(2 ** track.losses, self.most)
            if track.ratio > 1.0 + self.clear_loss:  # (a tie or a small loss: one plain run, then a tuned one again)
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

    @staticmethod
    def _state(track: Optional[_Track]) -> dict:
        if track is None:
            return {}
        return {"ratio": track.ratio, "plain_left": track.plain_left, "refresh": track.refresh,
                "reference": {rows: v[0] for rows, v in sorted(track.reference.items())}}

    @staticmethod
    def _saved(track: _Track) -> dict:
        """A track as plain values (:meth:`GenerationJudge.state_dict`; :meth:`_loaded` checks their kinds)."""
        return asdict(track)

    @staticmethod
    def _loaded(values: dict) -> _Track:
        """A track from :meth:`_saved`'s values, its next tuned run not judged (``warm`` False: a new process pays
        the one-off costs again, the drafters' starts and the kernels built for each product shape); a value it
        lacks keeps its default. ValueError for values of the wrong kind."""
        if not isinstance(values, dict):
            raise ValueError(f"judge state: a track must be a dict, got {type(values).__name__}")
        known = {f.name for f in fields(_Track)}
        track = _Track(**{k: v for k, v in values.items() if k in known})
        try:
            track.reference = {int(rows): [float(v[0]), int(v[1])] for rows, v in dict(track.reference).items()}
            track.waiting = [(float(t), {int(r): float(w) for r, w in dict(weights).items()})
                             for t, weights in track.waiting]
            track.ratio = None if track.ratio is None else float(track.ratio)
            for name in ("plain_left", "losses", "tuned", "refresh", "judged"):
                setattr(track, name, int(getattr(track, name)))
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"judge state: a track holds a value of the wrong kind ({e})") from None
        track.warm = False
        return track


class GenerationJudge(_Judge):
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
    drafting lost, and the next generation of that batch size runs plain (a reference too); where it lost by more
    than `clear_loss`, the next 1, 2, 4, ... up to `most` in a row (doubling with each such verdict), then a tuned
    one is judged again.

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
        clear_loss: a running ratio above ``1 + clear_loss`` doubles the plain run at each verdict (a tie or a
            smaller loss runs one plain generation: fp32 prompt lookup, 1.01-1.03x taps autoregressive, had run 26
            of 32 rounds plain, at 0.95x).
        min_judged: tuned generations judged before the first verdict (one generation's ratio alone misjudged
            both ways in some runs: prompt lookup at 1.1x autoregressive as a loss, the store at 0.9x as a win).
    """

    def __init__(self, min_batch: int = 2, **settings):
        super().__init__(**settings)  # (the settings above but min_batch: _Judge's, its defaults)
        _check_int("min_batch", min_batch, 1, type(self).__name__)
        self.min_batch = int(min_batch)
        self.tracks: Dict[Hashable, _Track] = {}

    def judges(self, batch: int) -> bool:
        """Whether generations of `batch` requests are judged (`min_batch`)."""
        return batch >= self.min_batch

    def _track(self, key: Hashable) -> _Track:
        track = self.tracks.get(key)
        if track is None:
            track = self.tracks[key] = self._new_track()
        return track

    def plain(self, key: Hashable) -> bool:
        """Whether the next generation of `key` (verification mode, batch size) runs plain (a reference); call once
        per generation, before it runs."""
        return self._next_plain(self._track(key))

    def tuned(self, key: Hashable, seconds: float, lengths: Sequence[int]) -> Optional[float]:
        """A tuned generation of `key` took `seconds` to decode its requests' `lengths` tokens (each request's
        emitted tokens, the prefill's first one included). Returns its ratio to the counterfactual, or None (the
        first generation of `key`; no reference yet: it is judged when one comes)."""
        return self._tuned(self._track(key), seconds, _step_counts(lengths))

    def reference(self, key: Hashable, steps: Sequence[Tuple[int, float]]) -> None:
        """A plain generation of `key` ran `steps`: (rows, seconds) per step."""
        self._reference(self._track(key), steps)

    def counterfactual(self, key: Hashable, lengths: Sequence[int]) -> Optional[float]:
        """Seconds the plain steps of `key`'s reference would take to emit `lengths` tokens (None: no reference)."""
        track = self.tracks.get(key)
        if track is None or not track.reference:
            return None
        return _replay(track.reference, lengths)

    def state(self, key: Hashable) -> dict:
        """What the judge holds for `key`: the running ratio, the plain generations left, the reference rows."""
        return self._state(self.tracks.get(key))

    def state_dict(self) -> dict:
        """Every track (verification mode and batch size: its reference, running ratio and schedule) as plain
        values, for :meth:`load_state_dict` in a later process (``SpeculativeDecoder.save_tuner`` keeps it beside
        the tuner's state): a decoder that starts from it does not learn again, at the cost of tuned generations,
        that drafting loses at a batch size."""
        return {"tracks": {key: self._saved(track) for key, track in self.tracks.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take what :meth:`state_dict` gave: its tracks replace this judge's (the settings given to the
        constructor stay); each one's next tuned generation is not judged (see :meth:`_loaded`)."""
        tracks = state.get("tracks") if isinstance(state, dict) else None
        if not isinstance(tracks, dict):
            raise ValueError("GenerationJudge.load_state_dict: not a judge state (no tracks)")
        self.tracks = {key: self._loaded(values) for key, values in tracks.items()}


class WindowJudge(_Judge):
    """A continuous batch's judge (``taps.batching.ContinuousBatch(judge=)``; the server's): :class:`GenerationJudge`'s
    verdicts over *windows* of `window` steps instead of generations. In a plain window every step is a plain one
    outside the tuner's plans (``SpeculativeDecoder.plain_step``: the groups' appends still queued or kept
    current, so that a tuned window resumes where it left); its steps' seconds by rows are the reference. A tuned
    window's counterfactual is what plain steps would take for the tokens it emitted: each step's tokens at the
    reference's seconds for its rows over its requests (a plain step emits one token for each). Requests join and
    leave a continuous batch between steps, so tokens a second is the measure (no batch ends with its last
    request). The first tuned window is not judged (calibration, the groups' starts).

    Args:
        window: steps a window.
        (the others: :class:`GenerationJudge`'s)
    """

    def __init__(self, window: int = 32, **settings):
        super().__init__(**settings)  # (GenerationJudge's settings but min_batch)
        _check_int("window", window, 1, type(self).__name__)
        self.window = int(window)
        self.track = self._new_track()
        self._plain = False  # the current window's kind
        self._left = 0  # its steps still to run
        self._steps: List[Tuple[int, float]] = []  # a plain window's (rows, seconds)
        self._seconds = 0.0  # a tuned window's seconds
        self._weights: Dict[int, float] = {}  # a tuned window's plain-step equivalents per rows
        #: windows run plain and tuned so far
        self.windows = {"plain": 0, "tuned": 0}

    def plain(self) -> bool:
        """Whether the next step is a plain one (call once per step, then :meth:`record` it)."""
        if self._left <= 0:
            self._plain = self._next_plain(self.track)
            self._left = self.window
        return self._plain

    def record(self, rows: int, active: int, tokens: int, seconds: float) -> None:
        """The step :meth:`plain` was asked for ran over `rows` rows with `active` unfinished requests, emitted
        `tokens` tokens and took `seconds`."""
        if self._plain:
            self._steps.append((rows, seconds))
        else:
            self._seconds += seconds
            if active > 0:
                self._weights[rows] = self._weights.get(rows, 0.0) + tokens / active
        self._left -= 1
        if self._left > 0:
            return
        if self._plain:
            self._reference(self.track, self._steps)
            self.windows["plain"] += 1
        else:
            self._tuned(self.track, self._seconds, self._weights)
            self.windows["tuned"] += 1
        self._steps, self._seconds, self._weights = [], 0.0, {}

    def state(self) -> dict:
        """The running ratio, the plain windows left, the reference rows, the windows run of each kind."""
        return dict(self._state(self.track), windows=dict(self.windows))

    def state_dict(self) -> dict:
        """The track (reference, running ratio, schedule) as plain values, for :meth:`load_state_dict` in a later
        process (``taps serve --tuner-dir`` keeps it with the decoder's tuner); the window under way is not
        kept."""
        return {"track": self._saved(self.track)}

    def load_state_dict(self, state: dict) -> None:
        """Take what :meth:`state_dict` gave; the next window starts afresh, and a tuned one is not judged (the
        new process's one-off costs, :meth:`GenerationJudge.load_state_dict`)."""
        if not isinstance(state, dict) or "track" not in state:
            raise ValueError("WindowJudge.load_state_dict: not a window judge state (no track)")
        self.track = self._loaded(state["track"])
        self._plain, self._left, self._steps, self._seconds, self._weights = False, 0, [], 0.0, {}


def _check_int(name: str, value, low: int, owner: str = "judge") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < low:
        raise ValueError(f"{owner}: {name} must be an integer >= {low}, got {value!r}")


def _step_counts(lengths: Sequence[int]) -> Dict[int, float]:
    """Autoregressive steps per rows for requests that emit `lengths` tokens each (:func:`_replay_rows`)."""
    counts: Dict[int, float] = {}
    for rows in _replay_rows(lengths):
        counts[rows] = counts.get(rows, 0.0) + 1.0
    return counts


def _cost(reference: Dict[int, List[float]], rows: int) -> float:
    """The reference's seconds for a plain step over `rows` rows: interpolated between the measured row counts, the
    nearest beyond them."""
    measured = sorted(reference)
    i = bisect.bisect_left(measured, rows)
    if i < len(measured) and measured[i] == rows:
        return reference[rows][0]
    if i == 0:
        return reference[measured[0]][0]
    if i == len(measured):
        return reference[measured[-1]][0]
    r0, r1 = measured[i - 1], measured[i]
    t0, t1 = reference[r0][0], reference[r1][0]
    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


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


def _plain_seconds(reference: Dict[int, List[float]], weights: Dict[int, float]) -> float:
    """Seconds of ``weights[rows]`` plain steps over each number of rows, at the reference's seconds for them
    (:func:`_cost`)."""
    return sum(_cost(reference, rows) * w for rows, w in weights.items())


def _replay(reference: Dict[int, List[float]], lengths: Sequence[int]) -> float:
    """Autoregressive decoding's seconds for requests that emit `lengths` tokens each: its steps
    (:func:`_replay_rows`), each at the reference's seconds for its rows."""
    return _plain_seconds(reference, _step_counts(lengths))
