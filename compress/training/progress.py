"""A one-line progress bar for rank 0 (stderr, only when it is a terminal); silent otherwise."""

import sys
import time


class Progress:
    """`total` steps of which `done` were done before (a resumed epoch: the bar reads 8/74, not 1/67); the speed
    and the time left are this run's."""

    def __init__(self, total, label, enabled=True, stream=None, done=0):
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total, self.label, self.done, self.first = max(total, 1), label, done, done
        self.start = time.perf_counter()
        self.last_draw = self.start - 1.0  # the first step draws at once: the bar shows where it starts

    def update(self, n=1, **values):
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last_draw > 0.1 or self.done >= self.total):
            self.last_draw = now
            self._draw(now, values)

    def _draw(self, now, values):
        width = 24
        filled = int(width * self.done / self.total)
        rate = (self.done - self.first) / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0
        extra = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        line = (f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{rate:.1f} it/s eta {eta:.0f}s {extra}")
        self.stream.write(line[:160].ljust(80))
        self.stream.flush()

    def close(self):
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
