"""Rank 0's progress display: a tqdm bar on a terminal, plain log lines elsewhere.

The display counts the global examples (and batches) of the whole job, starting at what is already
committed on a resume. On a terminal it is a tqdm bar with examples/s and the ETA; when the output
is not a terminal (a log file, CI, Slurm), it is one plain INFO line every ``progress_interval``
seconds and never a carriage return. The caller (:class:`~torch_batch_process.observe.JobObserver`)
decides how often to call :meth:`ProgressDisplay.show`; the display itself does no I/O otherwise.

Rates and the ETA come from steady-state steps only: the caller calls
:meth:`ProgressDisplay.start_clock` when the attempt's first step is done, and the display measures
from there. The first step carries the start-up (DataLoader workers, the first batch's warm-up,
lazy CUDA initialisation), which can be longer than the whole rest of a short job; counted in, it
made the first ETA minutes long for a job of seconds. The plain lines' ``elapsed`` still counts from
the display's creation; the bar's clock (its elapsed time) starts with the steady state.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

logger = logging.getLogger(__name__)

BAR_REFRESH_S = 0.5
"""How often the observer updates the bar (tqdm redraws at most this often too)."""


def pick_mode(mode: str, stream: TextIO) -> str:
    """``"auto"`` becomes ``"bar"`` on a terminal and ``"log"`` elsewhere; other modes are kept."""
    if mode != "auto":
        return mode
    try:
        return "bar" if stream.isatty() else "log"
    except (AttributeError, ValueError):  # closed or exotic stream
        return "log"


class ProgressDisplay:
    """Shows the job's progress; :meth:`show` is called every :attr:`refresh_s` seconds at most."""

    refresh_s: float = BAR_REFRESH_S
    extra: Callable[[], str | None] | None = None
    """What the display adds after the counts, when it says something (a generation job's prompts and tokens per
    second: :class:`~torch_batch_process.observe.token_rates.TokenRates`)."""

    def _extra(self) -> str | None:
        return self.extra() if self.extra is not None else None

    def start_clock(self, examples: int, batches: int) -> None:
        """The attempt's first step is done, with ``examples`` and ``batches`` done: rates count from now."""

    def show(self, examples: int, batches: int) -> None:
        """Shows ``examples`` and ``batches`` done out of the job's totals."""

    def close(self) -> None:
        """Ends the display (the bar stays on screen with its last state)."""


class BarDisplay(ProgressDisplay):
    """A tqdm bar over examples, with the batches in its postfix."""

    def __init__(
        self,
        *,
        name: str,
        total_examples: int,
        total_batches: int,
        initial_examples: int,
        initial_batches: int,
        stream: TextIO | None = None,
    ) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.total_batches = total_batches
        self._bar = tqdm(
            total=total_examples,
            initial=initial_examples,
            desc=name,
            unit=" examples",
            unit_scale=total_examples >= 100_000,  # 1.23M/4.56M; small counts stay exact integers
            dynamic_ncols=True,
            mininterval=BAR_REFRESH_S,
            smoothing=0.1,
            file=stream if stream is not None else sys.stderr,
        )
        self._bar.set_postfix_str(self._batches(initial_batches), refresh=False)
        self._last_batches = initial_batches
        # Log records (warnings, stragglers...) are printed above the bar instead of through it.
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(
            logging_redirect_tqdm(loggers=[logging.getLogger("torch_batch_process"), logging.getLogger()])
        )

    def _batches(self, batches: int) -> str:
        extra = self._extra()
        return f"{batches}/{self.total_batches} batches" + (f", {extra}" if extra else "")

    def start_clock(self, examples: int, batches: int) -> None:
        """Moves the bar to ``examples`` without counting them in its rate, and restarts its clock.

        tqdm's rate is an average of ``(n - initial) / elapsed`` smoothed over the intervals between
        its redraws; setting ``n``, ``initial`` and the times together starts both afresh from here.
        """
        bar = self._bar
        bar.n = bar.last_print_n = bar.initial = max(bar.n, examples)
        bar.start_t = bar.last_print_t = bar._time()
        self._last_batches = batches
        bar.set_postfix_str(self._batches(batches), refresh=False)
        bar.refresh()

    def show(self, examples: int, batches: int) -> None:
        if batches != self._last_batches or self.extra is not None:
            self._bar.set_postfix_str(self._batches(batches), refresh=False)
            self._last_batches = batches
        delta = examples - self._bar.n
        if delta > 0:
            self._bar.update(delta)

    def close(self) -> None:
        self._redirect.close()
        self._bar.close()


class LogDisplay(ProgressDisplay):
    """One INFO line every ``interval`` seconds: done, percent, examples/s, elapsed and ETA.

    ``clock`` (seconds, monotonic) is for tests; the rate counts from :meth:`start_clock` on (from the
    creation until it is called).
    """

    def __init__(
        self,
        *,
        interval: float,
        total_examples: int,
        total_batches: int,
        initial_examples: int,
        initial_batches: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh_s = interval
        self.total_examples = total_examples
        self.total_batches = total_batches
        self._clock = clock
        self._started = clock()
        self._rate_base = initial_examples
        self._rate_started = self._started

    def start_clock(self, examples: int, batches: int) -> None:
        self._rate_base = examples
        self._rate_started = self._clock()

    def show(self, examples: int, batches: int) -> None:
        now = self._clock()
        elapsed = now - self._started
        measured = now - self._rate_started
        rate = (examples - self._rate_base) / measured if measured > 0 else 0.0
        left = max(0, self.total_examples - examples)
        eta = format_duration(left / rate) if rate > 0 else "?"
        extra = self._extra()
        logger.info(
            "progress: %s | %d/%d examples, %d/%d batches | %.1f examples/s%s | elapsed %s, ETA %s",
            format_percent(examples, self.total_examples),
            examples,
            self.total_examples,
            batches,
            self.total_batches,
            rate,
            f" | {extra}" if extra else "",
            format_duration(elapsed),
            eta,
        )


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (or ``D days, H:MM:SS``) rounded to the second."""
    seconds = int(round(max(0.0, seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days} day{'s' if days != 1 else ''}, {text}" if days else text


def format_percent(done: int, total: int) -> str:
    return f"{100.0 * done / total:.1f}%" if total else "100.0%"
