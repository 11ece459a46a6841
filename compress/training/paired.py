"""Two models compared image by image on the same images: how many each alone gets right, and the exact
two-sided McNemar p of that difference (only the images they disagree on carry evidence; p near 1: the
accuracies differ by chance alone; below 0.05: a difference beyond noise on these images)."""

import math


def paired(first, second):
    """Two per-image correctness arrays (numpy bools) compared: {"only_first", "only_second", "p"}."""
    only_first, only_second = int((first & ~second).sum()), int((second & ~first).sum())
    return {"only_first": only_first, "only_second": only_second, "p": mcnemar_p(only_first, only_second)}


def mcnemar_p(only_first, only_second):
    """The exact two-sided McNemar p of `only_first` images right only with one model and `only_second` only with
    the other (4 significant digits)."""
    n, k = only_first + only_second, min(only_first, only_second)
    # the binomial(n, 1/2) tail in logs: exact to float precision, and milliseconds even for n in the tens of
    # thousands (big-integer binomials took minutes there)
    log_half_n = n * math.log(2)
    tail = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - log_half_n)
               for i in range(k + 1))
    p = min(1.0, 2 * tail) if n else 1.0
    return float(f"{p:.4g}")


def p_text(p):
    """A p-value as the report prints it: '= 0.25', '= 0.0032', '< 0.0001'."""
    return "< 0.0001" if p < 1e-4 else f"= {p:.2g}"
