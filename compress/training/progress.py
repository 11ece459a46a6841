"""A one-line progress bar for rank 0 (stderr, only when it is a terminal); silent otherwise."""

import sys
import time


class Progress:
    def __init__(self, total, label, enabled=True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total, self.label, self.done = max(total, 1), label, 0
        self.start = self.last_draw = time.perf_counter()

    def update(self, n=1, **values):
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last_draw > 0.1 or self.done >= self.total):
            self.last_draw = now
            self._draw(now, values)

    def _draw(self, now, values):
        width = 24
        filled = int(width * self.done / self.total)
        rate = self.done / max(now - self.start, 1e-9)
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
