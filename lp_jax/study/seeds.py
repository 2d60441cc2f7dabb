"""The study across seeds: each run's gap to the BF16 run of the same seed, summarized with
a confidence interval and a verdict (lp_jax.study.stats), and the BF16 twin as the band
of "no effect".

Works on the per-seed numbers of ``report.collect_numbers`` (one dict per seed), so it
judges exactly the gaps the single-seed report prints.
"""
from __future__ import annotations

from typing import Mapping

from lp_jax.study import stats
from lp_jax.study.tables import table
from lp_jax.study.variants import REFERENCE, TARGETS, TWIN


def summarize(per_seed: Mapping[int, Mapping[str, dict]]) -> dict:
    """{run name: per-seed losses and gaps, their statistics and verdicts} for every run
    but BF16 itself; per_seed maps seed -> collect_numbers(...) of that seed's runs."""
    seeds = sorted(per_seed)
    names = [n for n in per_seed[seeds[0]] if n != REFERENCE] if seeds else []
    out = {}
    for name in names:
        rows = {s: per_seed[s].get(name) for s in seeds}
        first = next(r for r in rows.values() if r is not None)
        final = {s: r["final_val_loss"] for s, r in rows.items() if r is not None}
        reference = {s: per_seed[s].get(REFERENCE, {}).get("final_val_loss") for s in seeds}
        gaps = {s: r["val_gap_to_bf16"] for s, r in rows.items()
                if r is not None and r["val_gap_to_bf16"] is not None}
        late = {s: r["late_val_gap_to_bf16"] for s, r in rows.items()
                if r is not None and r["late_val_gap_to_bf16"] is not None}
        gap_stats, late_stats = stats.mean_ci(list(gaps.values())), stats.mean_ci(list(late.values()))
        target = TARGETS.get(first["recipe"]) if (first["group"] == "precisions"
                                                  and first["recipe"] == name) else None
        out[name] = {
            "label": first["label"], "group": first["group"], "recipe": first["recipe"],
            "final_val_loss": final, "bf16_final_val_loss": reference,
            "gap": gaps, "gap_stats": gap_stats,
            "late_gap": late, "late_gap_stats": late_stats,
            "verdict": stats.verdict(gap_stats),
            "target": target,
            "target_verdict": None if target is None else stats.target_verdict(gap_stats, target),
        }
    return out


def noise_band(summary: Mapping[str, dict]) -> tuple[float, float] | None:
    """The range of the BF16 twin's per-seed gaps: what "no effect" spans at this scale."""
    twin = summary.get(TWIN)
    if not twin or not twin["gap"]:
        return None
    values = list(twin["gap"].values())
    return min(values), max(values)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _mean_ci(s: Mapping) -> str:
    if s["mean"] is None:
        return "-"
    if s["ci"] is None:
        return f"{_pct(s['mean'])} (1 seed)"
    return f"{_pct(s['mean'])} [{_pct(s['ci'][0])}, {_pct(s['ci'][1])}]"


def markdown(summary: Mapping[str, dict], seeds: list[int], figure: str | None) -> list[str]:
    """The report's section on the seeds."""
    lines = ["## Across seeds", "",
             f"Seeds {', '.join(map(str, seeds))}, each gap against its own seed's BF16 run; "
             "mean over seeds with a 95% Student-t interval. A difference is claimed only "
             "where the interval excludes zero, a target met only where it lies below it.", ""]
    if TWIN in summary:
        lines += ["The **BF16 twin** is BF16 with its gradient summed in another FP32 order: "
                  "its gaps are noise alone.", ""]
    rows = []
    order = sorted(summary, key=lambda n: summary[n]["group"] != "twin")
    for name in order:
        n = summary[name]
        per_seed = ", ".join(f"{s}: {_pct(g)}" for s, g in n["gap"].items()) or "-"
        # The interval is in the columns beside it; the verdicts need only their words.
        target = "-" if n["target"] is None else stats.target_verdict(n["gap_stats"], n["target"],
                                                                      detail=False)
        rows.append([n["label"], per_seed, _mean_ci(n["gap_stats"]), _mean_ci(n["late_gap_stats"]),
                     stats.verdict(n["gap_stats"], detail=False), target])
    lines += [table(["run", "gap to BF16 per seed", "mean gap [95% CI]",
                     "mean 2nd-half gap [95% CI]", "verdict", "target"], rows), ""]
    band = noise_band(summary)
    if band:
        lines += [f"The BF16 twin's gaps span {_pct(band[0])} to {_pct(band[1])} over the seeds.", ""]
    if figure:
        lines += [f"![Gap to BF16 by seed]({figure})", ""]
    return lines
