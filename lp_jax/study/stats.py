"""Statistics of a multi-seed study: paired gaps to BF16, Student-t intervals, verdicts.

Gaps are paired by seed (same initial weights, same batches); the 95% interval of their mean
uses Student's t with n - 1 degrees of freedom, since with a few seeds the normal quantile
(1.96) would claim far more certainty than the data hold (t is 4.30 for 3 seeds, 2.57 for 6).
No SciPy: the t quantile is computed here (regularized incomplete beta by its continued
fraction, inverted by bisection) and checked against published tables in the tests.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0.5 < p < 1), by bisection on the CDF."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired_gaps(reference: Mapping[int, float | None], other: Mapping[int, float | None]
                ) -> dict[int, float]:
    """Relative gap (other - reference) / reference per seed both have a value for."""
    out = {}
    for seed, ref in reference.items():
        value = other.get(seed)
        if ref is None or value is None or not math.isfinite(ref) or not math.isfinite(value) or ref == 0:
            continue
        out[seed] = (value - ref) / ref
    return dict(sorted(out.items()))


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """Mean, sample standard deviation, standard error and the Student-t interval of the
    mean; with fewer than two values there is no interval (``ci`` None)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "stderr": None, "ci": None}
    mean = sum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "sd": None, "stderr": None, "ci": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    stderr = sd / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * stderr
    return {"n": n, "mean": mean, "sd": sd, "stderr": stderr, "ci": [mean - half, mean + half]}


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def verdict(stats: Mapping, reference_label: str = "BF16", detail: bool = True) -> str:
    """Words for a paired gap: a difference is claimed only where the interval excludes 0.
    ``detail``: with the interval and the number of seeds."""
    n, mean, ci = stats["n"], stats["mean"], stats["ci"]
    if n == 0:
        return "no paired seeds: nothing to compare"
    if ci is None:
        return (f"one seed only (gap {_pct(mean)}): no confidence interval, so no verdict; "
                f"run more seeds")
    interval = f"95% CI [{_pct(ci[0])}, {_pct(ci[1])}], {n} seeds"
    if ci[0] > 0:
        words, more = f"worse than {reference_label} by {_pct(mean)[1:]}", interval
    elif ci[1] < 0:
        words, more = f"better than {reference_label} by {_pct(-mean)[1:]}", interval
    else:
        words, more = f"no difference from {reference_label} detected", f"gap {_pct(mean)}, {interval}"
    return f"{words} ({more})" if detail else words


def target_verdict(stats: Mapping, cap: float, detail: bool = True) -> str:
    """A target 'gap <= cap' is met only when the whole interval is below the cap.
    ``detail``: with the bound of the interval that decides it, else with the cap only."""
    if stats["n"] == 0:
        return "no data"
    if stats["ci"] is None:
        return f"undecided with one seed (gap {_pct(stats['mean'])}, target <= {_pct(cap)})"
    upper, lower = stats["ci"][1], stats["ci"][0]
    if upper <= cap:
        word, why = "met", f"the 95% CI's upper bound {_pct(upper)} <= {_pct(cap)}"
    elif lower > cap:
        word, why = "missed", f"even the 95% CI's lower bound {_pct(lower)} > {_pct(cap)}"
    else:
        word, why = "not shown", f"the 95% CI reaches {_pct(upper)} > {_pct(cap)}"
    return f"{word}: {why}" if detail else f"{word} (<= {_pct(cap)})"
