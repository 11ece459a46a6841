"""Progress for rank 0: a one-line bar on stderr when it is a terminal; otherwise (nohup, CI, a file) a log line
every PLAIN_EVERY_S seconds, so a long epoch never looks like a hang."""

import logging
import sys
import time

log = logging.getLogger(__name__)
PLAIN_EVERY_S = 30.0


class Progress:
    """`total` steps of which `done` were done before (a resumed epoch: the bar reads 8/74, not 1/67); the speed
    and the time left are this run's."""

    def __init__(self, total, label, enabled=True, stream=None, done=0, plain_every_s=PLAIN_EVERY_S):
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.plain = enabled and not self.enabled
        self.total, self.label, self.done, self.first = max(total, 1), label, done, done
        self.start = time.perf_counter()
        self.last_draw = self.start - 1.0  # the first step draws at once: the bar shows where it starts
        self.last_line, self.plain_every_s = self.start, plain_every_s

    def update(self, n=1, **values):
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last_draw > 0.1 or self.done >= self.total):
            self.last_draw = now
            self._draw(now, values)
        elif self.plain and now - self.last_line >= self.plain_every_s and self.done < self.total:
            self.last_line = now
            rate, eta = self._speed(now)
            log.info("%s: step %d/%d, %.1f it/s, about %.0f s left in this pass", self.label, self.done, self.total,
                     rate, eta)

    def _speed(self, now):
        rate = (self.done - self.first) / max(now - self.start, 1e-9)
        return rate, (self.total - self.done) / rate if rate > 0 else 0

    def _draw(self, now, values):
        width = 24
        filled = int(width * self.done / self.total)
        rate, eta = self._speed(now)
        extra = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        line = (f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{rate:.1f} it/s eta {eta:.0f}s {extra}")
        self.stream.write(line[:160].ljust(80))
        self.stream.flush()

    def close(self):
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
