"""The report folder: figures, report.md with Tables 1-3, and study.json with every number."""
from __future__ import annotations

import json
import math
import os
import pathlib
import time

import lp_jax
from lp_jax.config.yaml_io import to_dict
from lp_jax.evaluation.mmlu import SUBJECTS
from lp_jax.study import curves, plots, provenance, seeds, throughput, verify
from lp_jax.study.tables import fmt as _fmt
from lp_jax.study.tables import pct as _pct
from lp_jax.study.tables import table as _table
from lp_jax.study.tables import table1, table2, table3
from lp_jax.study.variants import REFERENCE, TARGETS
from lp_jax.training.validate import resolve

CURVE_POINTS = 200  # smoothed training-loss points per run kept in study.json


def _policy(variant) -> str:
    if variant.recipe == "bf16":
        return "-"
    try:
        return lp_jax.get_recipe(variant.recipe, **variant.precision).policy
    except Exception:  # noqa: BLE001 - only a label
        return "?"


def _downsample(steps, values, points: int) -> list[list[float]]:
    stride = max(1, len(steps) // points)
    idx = list(range(len(steps) - 1, -1, -stride))[::-1]
    return [[int(steps[i]), None if values[i] != values[i] else float(values[i])] for i in idx]


def report_path(path, out) -> str:
    """``path`` as the report records it: relative to the report folder ``out``, with '/'
    separators. A report folder is moved, copied and committed (docs/study_tiny/), so it
    must not name the folders of the machine that wrote it; a run folder outside the
    report folder (``--runs-dir``) comes out with '..'."""
    return pathlib.Path(os.path.relpath(os.path.abspath(path), os.path.abspath(out))).as_posix()


def resolve_report_path(out, recorded: str) -> pathlib.Path:
    """The folder a path recorded by ``report_path`` names, seen from the report folder."""
    return pathlib.Path(out) / recorded


def collect_numbers(entries: list[dict], out) -> dict:
    """study.json's per-run section: statuses, final losses and gaps, curves, Tables 1-3.
    Run folders and checkpoints are named relative to the report folder ``out``."""
    ref = next((e for e in entries if e["variant"].name == REFERENCE), None)
    nvfp4 = next((e for e in entries if e["variant"].name == "nvfp4"), None)

    def gap(summary, other, key, step_key):
        """Relative gap, only between runs that ended at the same step (a run that
        failed half way is not compared with a finished one)."""
        if other is None or summary[step_key] != other["summary"][step_key]:
            return None
        return curves.gap(summary[key], other["summary"][key])

    def late_gap(entry):
        """Mean relative gap of the validation losses measured in the second half of the
        run: less at the mercy of one evaluation than the final gap alone."""
        if ref is None or entry["summary"]["final_val_step"] != ref["summary"]["final_val_step"]:
            return None
        steps, gaps = curves.relative_gap(*curves.val_curve(entry["metrics"]),
                                          *curves.val_curve(ref["metrics"]))
        late = gaps[steps > entry["status"].target_step / 2]
        return float(late.mean()) if len(late) else None

    numbers = {}
    for e in entries:
        v, s, status = e["variant"], e["summary"], e["status"]
        run_dir = report_path(e["config"].run_dir, out)
        steps, loss = curves.train_curve(e["metrics"])
        smoothed = curves.smooth(loss, curves.smoothing_window(len(loss)))
        v_steps, v_loss = curves.val_curve(e["metrics"])
        numbers[v.name] = {
            "label": v.label, "group": v.group, "recipe": v.recipe, "policy": _policy(v),
            "precision": _json_ready(e["config"].precision.__dict__), "run_dir": run_dir,
            "status": status.state, "message": status.message,
            "target_step": status.target_step, **s,
            "val_gap_to_bf16": gap(s, ref, "final_val_loss", "final_val_step"),
            "train_gap_to_bf16": gap(s, ref, "final_train_loss", "last_step"),
            "val_gap_to_nvfp4": gap(s, nvfp4, "final_val_loss", "final_val_step"),
            "late_val_gap_to_bf16": late_gap(e),
            "val_curve": [[int(a), float(b)] for a, b in zip(v_steps, v_loss)],
            "train_curve_smoothed": _downsample(steps, smoothed, CURVE_POINTS),
            "throughput": {**e["throughput"],
                           "speedup_over_bf16": throughput.speedup(
                               e["throughput"], ref["throughput"] if ref else None)},
            "memory_bytes": e["memory"], "eval": _eval_summary(e["eval"], run_dir),
            "errors": e["errors"], "recorded": status.recorded, "made_by": _made_by(e),
        }
    return numbers


def _made_by(entry: dict) -> dict | None:
    """The commit and JAX version that trained the run (its machine.json), if noted."""
    machine = entry.get("machine")
    return None if not machine else {"commit": machine.get("commit"), "jax": machine.get("jax")}


def trained_by(all_entries: list[dict]) -> list[dict]:
    """[{"commit", "jax", "runs"}] for each code that trained some of the runs, most runs
    first; a run with no machine.json counts under commit and JAX None."""
    groups: dict[tuple, int] = {}
    for e in all_entries:
        made_by = _made_by(e) or {}
        key = (made_by.get("commit"), made_by.get("jax"))
        groups[key] = groups.get(key, 0) + 1
    return [{"commit": c, "jax": j, "runs": n}
            for (c, j), n in sorted(groups.items(), key=lambda kv: -kv[1])]


def _trained_by_line(groups: list[dict]) -> str:
    total = sum(g["runs"] for g in groups)
    if len(groups) == 1 and groups[0]["commit"] is None and groups[0]["jax"] is None:
        return "- Trained by: not noted (no run folder has a machine.json)."
    parts = [("no machine.json" if g["commit"] is None and g["jax"] is None else
              provenance.describe(g)) + (f" ({g['runs']} runs)" if len(groups) > 1 else "")
             for g in groups]
    every = f"all {total} runs" if total > 1 else "the run"
    return (f"- Trained by: {'; '.join(parts)}"
            + (f" ({every}; each run's machine.json)." if len(groups) == 1 else "."))


def _tokens(count: float) -> str:
    return f"{count / 1e6:.1f} M" if count >= 1e5 else f"{count:,.0f}"


def _param_count(model_type: str, model) -> int:
    """The parameters of the run's model as its family builds it (any model.type): their
    shapes, traced without allocating."""
    import jax
    from flax import nnx

    from lp_jax.model_registry import build_model
    abstract = nnx.eval_shape(lambda: build_model(model_type, model, nnx.Rngs(0)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def _model_line(model_type: str, model) -> str:
    mlp = (f"{model.num_experts} experts of width {model.moe_ffn_hidden_size or model.intermediate_size}, "
           f"{model.moe_router_topk} per token" if model.num_experts else f"FFN {model.intermediate_size}")
    return (f"- Model: {model.num_layers} layers, hidden {model.hidden_size}, {mlp}, {model.num_heads} "
            f"heads ({model.num_kv_heads} KV), vocab {model.vocab_size}; "
            f"{_param_count(model_type, model) / 1e6:.2f} M parameters.")


def _setup_lines(entries: list[dict], options, groups: list[dict]) -> list[str]:
    config = entries[0]["config"]
    model = resolve(config).model_config
    tokens = config.steps * config.data.global_batch_size * config.data.seq_len
    return [
        f"Command: `{_command(options)}`", "",
        _model_line(config.model.type, model),
        f"- Data: `{config.data.source}` ({config.data.tokenizer} tokenizer), sequence "
        f"{config.data.seq_len}, global batch {config.data.global_batch_size}, "
        f"{config.steps} steps = {_tokens(tokens)} tokens, seed {config.seed}; every run "
        "reads the same batches in the same order.",
        f"- Validation: {config.logging.val_batches} fixed batch(es) every "
        f"{config.logging.val_every} steps and at the end.",
        _trained_by_line(groups),
    ]


def _compact_json(data, depth: int = 0) -> str:
    """Indented JSON, except that a list of plain values ([step, loss]) stays on one line:
    a curve takes a few hundred short lines, not a thousand one-number lines."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(data, dict) and data:
        items = [f"{inner}{json.dumps(str(k))}: {_compact_json(v, depth + 1)}"
                 for k, v in data.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(data, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in data):
        items = [inner + _compact_json(v, depth + 1) for v in data]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    if isinstance(data, (list, tuple)):
        return "[" + ",".join(_compact_json(v) for v in data) + "]"
    if isinstance(data, float) and not math.isfinite(data):
        return "null"  # JSON has no NaN (a run's non-finite loss)
    return json.dumps(data, default=str, separators=(",", ":"))


def _eval_summary(result: dict | None, run_dir: str) -> dict | None:
    """Table 1's results without MMLU's 57 subjects (they stay in RUN_DIR/study_eval.json).

    The evaluated checkpoint is named as ``checkpoint:<run_dir>@<step>`` with the run folder
    relative to the report folder: the cache in the run folder holds the absolute path the
    evaluation loaded (``LoadedModel.source``), which must not reach the report."""
    if not result:
        return result

    subjects = {f"mmlu_{s}" for s in SUBJECTS}
    kept = {k: v for k, v in result.get("results", {}).items() if k not in subjects}
    model = f"checkpoint:{run_dir}@{result['step']}" if "step" in result else result.get("model")
    return {**result, "model": model, "results": kept}


def _note(status) -> str:
    return "" if status.ok else "failed" if status.state == "failed" else "unfinished"


def _command(options) -> str:
    if options.command:
        return options.command
    parts = ["python -m lp_jax.study", f"--config {options.config}",
             f"--precisions {options.precisions}"] + (["--ablations"] if options.ablations else [])
    return " ".join(parts + list(options.overrides))


def write_report(out: pathlib.Path, entries: list[dict], options, interrupted: str | None,
                 seconds: float, by_seed: dict | None = None) -> dict:
    """``entries``: the runs shown in detail (the first seed's); ``by_seed``: {seed: its
    entries} for a multi-seed study, which adds the statistics across seeds."""
    numbers = collect_numbers(entries, out)
    config = entries[0]["config"]
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    figures = []
    for group, title in (("precisions", "Loss by training precision"),
                         ("ablations", "NVFP4 ablations")):
        members = [e for e in entries if e["variant"].group == group or
                   (group == "ablations" and e["variant"].name in (REFERENCE, "nvfp4"))]
        if group == "ablations" and not any(e["variant"].group == "ablations" for e in entries):
            continue
        runs = [{"name": e["variant"].name, "label": e["variant"].label, "metrics": e["metrics"],
                 "recipe": e["variant"].recipe, "note": _note(e["status"])} for e in members]
        reference = next((r for r in runs if r["name"] == REFERENCE), None)
        name = f"loss_{group}.png"
        plots.loss_figure(out / name, title, runs, reference, tokens_per_step)
        figures.append((title, name))
    all_entries = [e for group in (by_seed or {None: entries}).values() for e in group]
    groups = trained_by(all_entries)
    summary = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(seconds, 1),
               "command": _command(options), **provenance.current(), "trained_by": groups,
               "precisions": options.precisions,
               "ablations": options.ablations, "overrides": list(options.overrides),
               "interrupted": interrupted, "reference": REFERENCE,
               "eval_settings": {"tasks": list(options.tasks), "limit": options.limit,
                                 "shots": options.shots},
               "targets": TARGETS, "runs": numbers, "figures": [f for _, f in figures]}
    seed_lines = []
    if by_seed:
        # The detailed seed's numbers are already collected; the others only for their losses.
        across = seeds.summarize({s: numbers if e is entries else collect_numbers(e, out)
                                  for s, e in by_seed.items()})
        band = seeds.noise_band(across)
        figure = None
        if across:
            figure = "gaps_by_seed.png"
            plots.gaps_figure(out / figure, across, band)
            summary["figures"].append(figure)
        summary["seeds"] = {"seeds": sorted(by_seed), "runs": across,
                            "twin_band": None if band is None else list(band)}
        seed_lines = seeds.markdown(across, sorted(by_seed), figure)
    (out / "study.json").write_text(_compact_json(summary) + "\n")
    checked = verify.read(options.records) if options.records else None
    (out / "report.md").write_text(_markdown(entries, numbers, figures, options, interrupted,
                                             seed_lines, groups, checked))
    return summary


def _markdown(entries, numbers, figures, options, interrupted, seed_lines=(), groups=(),
              checked=None) -> str:
    lines = ["# Training-precision study", ""]
    if interrupted:
        lines += [f"**Interrupted ({interrupted}): partial report; re-run the same command to "
                  "resume.**", ""]
    lines += _setup_lines(entries, options, list(groups)) + [""]
    if checked:
        lines += verify.markdown(checked)
    heading = "## Final losses"
    if seed_lines:
        heading += f" (seed {entries[0]['config'].seed}, shown in detail; every seed: Across seeds)"
    lines += [heading, "",
              "Validation loss at the last step (± its standard error over the shared "
              "validation batches); training loss averaged over the last 2% of steps; gaps "
              "(x - BF16) / BF16; the mean validation gap over the run's second half.", ""]
    rows = []
    for name, n in numbers.items():
        target = TARGETS.get(n["recipe"]) if n["group"] == "precisions" and \
            n["recipe"] == name else None
        verdict = "-" if target is None or n["val_gap_to_bf16"] is None else (
            f"{'met' if n['val_gap_to_bf16'] <= target else 'missed'} (gap <= +{100 * target:.0f}%)")
        loss = _fmt(n["final_val_loss"])
        if n.get("final_val_loss_stderr") is not None and n["final_val_loss"] is not None:
            loss += f" ± {n['final_val_loss_stderr']:.4f}"
        rows.append([n["label"], n["policy"], _quantized(n), _status(n),
                     loss, _pct(n["val_gap_to_bf16"]),
                     _pct(n["late_val_gap_to_bf16"]), _fmt(n["final_train_loss"]),
                     _pct(n["train_gap_to_bf16"]), verdict])
    lines += [_table(["run", "policy", "quantized linears", "status", "final val loss",
                      "gap to BF16", "mean val gap, 2nd half", "final train loss",
                      "gap to BF16", "target (final val gap)"], rows), ""]
    for title, name in figures:
        lines += [f"![{title}]({name})", ""]
    lines += list(seed_lines)
    lines += table1(numbers, options) + table2(numbers) + table3(numbers)
    ablations = {k: n for k, n in numbers.items() if n["group"] == "ablations" and k != "nvfp4"}
    if ablations:
        rows = [[n["label"], n["policy"], _status(n), _fmt(n["final_val_loss"]),
                 _pct(n["val_gap_to_nvfp4"]), _pct(n["val_gap_to_bf16"])]
                for n in ablations.values()]
        lines += ["## NVFP4 ablations", "",
                  "Each row switches one thing off the NVFP4 run (or quantizes every layer).", "",
                  _table(["run", "policy", "status", "final val loss", "gap to NVFP4",
                          "gap to BF16"], rows), ""]
    problems = [(n["label"], n["message"], n["errors"]) for n in numbers.values()
                if n["message"] or n["errors"]]
    if problems:
        lines += ["## Problems", ""]
        for label, message, errors in problems:
            for text in filter(None, [message, *(f"{k}: {v}" for k, v in errors.items())]):
                lines.append(f"- **{label}**: {text}")
        lines.append("")
    return "\n".join(lines)


def _quantized(n) -> str:
    m = n.get("memory_bytes") or {}
    return f"{m['quantized_linears']}/{m['linears']}" if "linears" in m else "-"


def _status(n) -> str:
    state = "recorded" if n.get("recorded") else \
        {"complete": "reused", "trained": "trained"}.get(n["status"], f"**{n['status']}**")
    return f"{state}, step {n['last_step']}/{n['target_step']}"


def _json_ready(fields: dict) -> dict:
    """Config fields as study.json reads back (tuples such as bf16_layers as lists, the
    options mapping as a dict)."""
    return {k: to_dict(v) for k, v in fields.items()}
