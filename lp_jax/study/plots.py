"""The loss figures: per set of variants, training and validation loss against tokens, and
below each the relative gap to BF16 in percent (as Figures 2-4 of NVIDIA's "Pretraining Large
Language Models with NVFP4"); and the figure of the gaps by seed."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lp_jax.study import curves  # noqa: E402
from lp_jax.study.variants import RECIPES, recipe_format  # noqa: E402

# Each recipe's colour is its format object's; BF16, the reference, is black.
COLORS = {r: getattr(recipe_format(r), "color", "black") for r in RECIPES}
EXTRA_COLORS = ("tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:gray")


def assign_colors(runs: list[dict]) -> dict[str, str]:
    """A run named after its recipe gets the recipe's colour; another run (a policy or an
    ablation) gets its recipe's colour if no run in the figure has it yet, else a spare."""
    colors, used, spare = {}, set(), iter(EXTRA_COLORS * 4)
    for run in sorted(runs, key=lambda r: r["name"] not in COLORS):
        color = COLORS.get(run["name"]) or COLORS.get(run.get("recipe", ""))
        if color is None or color in used:
            color = next(spare)
        colors[run["name"]] = color
        used.add(color)
    return colors


def loss_figure(path: str | os.PathLike, title: str, runs: list[dict], reference: dict | None,
                tokens_per_step: int) -> None:
    """runs: [{"name", "label", "recipe", "metrics", "note"}] (note: "" for a finished run,
    else "failed" or "unfinished": drawn dashed); reference: the BF16 one of them.

    Training loss is smoothed (trailing mean over ~2% of the steps) so the curves and
    their gaps show trends rather than batch noise; validation loss is drawn as measured.
    """
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex="col",
                             gridspec_kw={"height_ratios": [3, 2]})
    scale = tokens_per_step / 1e6
    window = max([1] + [curves.smoothing_window(len(r["metrics"])) for r in runs])
    ref_train = ref_val = None
    if reference is not None and reference["metrics"]:
        s, l = curves.train_curve(reference["metrics"])
        ref_train = (s, curves.smooth(l, window))
        ref_val = curves.val_curve(reference["metrics"])
    colors = assign_colors(runs)
    for run in runs:
        if not run["metrics"]:
            continue
        color = colors[run["name"]]
        label = run["label"] + (f" ({run['note']})" if run.get("note") else "")
        style = "--" if run.get("note") else "-"
        steps, loss = curves.train_curve(run["metrics"])
        smoothed = curves.smooth(loss, window)
        axes[0, 0].plot(steps * scale, smoothed, style, color=color, lw=1.2, label=label)
        v_steps, v_loss = curves.val_curve(run["metrics"])
        axes[0, 1].plot(v_steps * scale, v_loss, style, color=color, marker="o", ms=3,
                        lw=1.2, label=label)
        if run is reference or ref_train is None:
            continue
        g_steps, g = curves.relative_gap(steps, smoothed, *ref_train)
        axes[1, 0].plot(g_steps * scale, 100 * g, style, color=color, lw=1.0, label=label)
        g_steps, g = curves.relative_gap(v_steps, v_loss, *ref_val)
        axes[1, 1].plot(g_steps * scale, 100 * g, style, color=color, marker="o", ms=3,
                        lw=1.0, label=label)
    axes[0, 0].set_title("training loss" + (f" (mean over {window} steps)" if window > 1 else ""))
    axes[0, 1].set_title("validation loss")
    for ax in axes[0]:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        _clip_warmup(ax)
    for ax in axes[1]:
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_ylabel("relative gap to BF16 (%)")
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
    axes[0, 1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clip_warmup(ax) -> None:
    """The first steps' losses (ln(vocab) and above) would flatten every later difference:
    the y range starts from the lowest curve and shows a fixed band above it."""
    lows, highs = [], []
    for line in ax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        y = y[np.isfinite(y)]
        if len(y):
            lows.append(y.min())
            highs.append(np.percentile(y, 90))
    if lows:
        low = min(lows)
        high = max(min(max(highs), low * 1.6), low * 1.05)
        ax.set_ylim(low - 0.02 * (high - low), high)


def gaps_figure(path: str | os.PathLike, summary: dict, band: tuple[float, float] | None) -> None:
    """Gap to BF16 per seed (dots) for each run, with the mean and its 95% interval (bar),
    and the range of the BF16 twin's gaps shaded: where "no effect" lies at this scale."""
    names = sorted(summary, key=lambda n: summary[n]["group"] != "twin")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4))
    if band is not None:
        ax.axhspan(100 * band[0], 100 * band[1], color="0.85", zorder=0,
                   label="BF16 twin's range over seeds")
    colors = assign_colors([{"name": n, "recipe": summary[n]["recipe"]} for n in names])
    for x, name in enumerate(names):
        n = summary[name]
        gaps = list(n["gap"].values())
        jitter = np.linspace(-0.12, 0.12, len(gaps)) if len(gaps) != 1 else [0.0]
        ax.scatter(x + np.asarray(jitter), 100 * np.asarray(gaps), s=16, alpha=0.7,
                   color=colors[name], zorder=2)
        s = n["gap_stats"]
        if s["mean"] is None:
            continue
        if s["ci"] is not None:
            low, high = 100 * (s["mean"] - s["ci"][0]), 100 * (s["ci"][1] - s["mean"])
            ax.errorbar(x + 0.3, 100 * s["mean"], yerr=[[low], [high]], fmt="D", ms=6,
                        color=colors[name], capsize=4, zorder=3)
        else:
            ax.scatter(x + 0.3, 100 * s["mean"], marker="D", s=36, color=colors[name], zorder=3)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), [summary[n]["label"] for n in names], rotation=20, ha="right")
    ax.set_ylabel("final validation gap to BF16 (%)")
    ax.set_title("gap to BF16: each seed (dots), mean and 95% CI (diamond)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    if band is not None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
