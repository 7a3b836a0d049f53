"""Time spent in each named stage of the pipeline, for metrics and trace spans."""

from __future__ import annotations

import time

from ibex.assembly.structs import Lap, Stage

__all__ = ["StageTimer", "whole_ms"]


def whole_ms(seconds: float) -> int:
    """Seconds as whole milliseconds (the wire format's unit)."""
    return round(seconds * 1000.0)


class StageTimer:
    """Seconds spent in each named stage: one clock read per stage boundary."""

    __slots__ = ("_last", "seconds", "start")

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.seconds: dict[Lap, float] = {}

    def lap(self, lap: Lap) -> None:
        """Close `lap`: the time since the previous lap (or the start) is its own."""
        now = time.perf_counter()
        self.seconds[lap] = now - self._last
        self._last = now

    def restart(self) -> StageTimer:
        """Start again from now (a timer handed in before the work began)."""
        self.start = self._last = time.perf_counter()
        self.seconds.clear()
        return self

    def spans(self) -> list[tuple[Lap, float, float]]:
        """Each stage's (name, start, end) in perf_counter seconds: laps are back to back."""
        out, t = [], self.start
        for stage, seconds in self.seconds.items():
            out.append((stage, t, t + seconds))
            t += seconds
        return out

    def stage_ms(self, stage: Stage) -> int:
        """Whole milliseconds of a reported stage: the sum of its laps."""
        return whole_ms(sum(self.seconds.get(lap, 0.0) for lap in stage.laps))

    def total(self) -> float:
        return self._last - self.start
