"""Tables 1-3 of the report as Markdown, from study.json's per-run numbers."""
from __future__ import annotations

from lp_jax.study import throughput
from lp_jax.study.memory_table import MEMORY_METHOD, memory_columns, memory_rows


def fmt(value, spec=".4f", missing="-"):
    return missing if value is None else format(value, spec)


def pct(value, missing="-"):
    return missing if value is None else f"{100 * value:+.2f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def table1(numbers, options) -> list[str]:
    tasks = list(options.tasks)
    if not tasks:
        return []
    head = ["run"]
    metric = {}
    for n in numbers.values():
        for task, r in ((n["eval"] or {}).get("results") or {}).items():
            if task in tasks and task not in metric:
                metric[task] = "acc" if task in ("mmlu", "winogrande", "boolq") else "acc_norm"
    head += [f"{t} ({metric.get(t, 'acc')})" for t in tasks]
    rows = []
    for n in numbers.values():
        results = (n["eval"] or {}).get("results") or {}
        cells = [n["label"]]
        for t in tasks:
            r, m = results.get(t), metric.get(t, "acc")
            cells.append("-" if not r or r.get(m) is None else
                         f"{100 * r[m]:.1f} ± {100 * (r.get(m + '_stderr') or 0):.1f}")
        rows.append(cells)
    n_docs = {t: r.get("n") for n in numbers.values()
              for t, r in ((n["eval"] or {}).get("results") or {}).items() if t in tasks}
    return ["## Table 1: downstream accuracy (%)", "",
            f"Final checkpoints evaluated in BF16 (no recipe), {options.shots}-shot, the first "
            f"{options.limit} documents of each task (MMLU: of each subject); documents scored: "
            f"{', '.join(f'{t} {k}' for t, k in n_docs.items()) or 'none'}. "
            "± is the standard error.", "", table(head, rows), ""]


def table2(numbers) -> list[str]:
    rows = []
    for n in numbers.values():
        t = n["throughput"]
        rows.append([n["label"], fmt(t["tokens_per_sec"], ",.0f"),
                     fmt(t["tflops_per_device"], ".4g"),
                     fmt(t["speedup_over_bf16"], ".2f") + ("x" if t["speedup_over_bf16"] else ""),
                     fmt(t["step_time_s"] and 1e3 * t["step_time_s"], ".1f"),
                     t["steps_timed"], t["compile_steps_dropped"]])
    return ["## Table 2: throughput", "",
            "From each run's metrics.jsonl, without step 1 and steps over "
            f"{throughput.COMPILE_FACTOR:g}x the median (compilations). Other jobs on the "
            "machine move these numbers; a CPU emulates every format.", "",
            table(["run", "tokens/s", "model TFLOP/s per device", "speed-up over BF16",
                    "mean step (ms)", "steps timed", "compile steps left out"], rows), ""]


def table3(numbers) -> list[str]:
    rows = memory_rows(numbers)
    if not rows:
        return []
    return ["## Table 3: memory per component (MiB)", "", table(memory_columns(numbers), rows), "",
            MEMORY_METHOD, ""]
