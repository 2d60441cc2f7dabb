"""SwapReport: what apply_recipe did, and how its paths are folded for printing."""
from __future__ import annotations

import dataclasses
import re

from lp_jax.gemm import backends

# lp_jax's Llama's layers (the telemetry and the sensitivity study read these paths).
LAYER_INDEX = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")
IN_LAYERS = re.compile(r"(?:^|/)layers(?:/|$)")


@dataclasses.dataclass
class SwapReport:
    """What apply_recipe did: path -> recipe name, for every GEMM module it saw.

    ``str(report)`` is a one-line summary (with the layer container used and its number of
    layers) followed by one line per group of GEMMs that got the same GEMM (layer indices
    folded into ranges: ``layers/{0-3,6}/{q_proj, k_proj}``).
    """

    recipe: str
    policy: str
    num_layers: int
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> recipe
    bf16_by_policy: list[str] = dataclasses.field(default_factory=list)
    per_slice: dict[str, str] = dataclasses.field(default_factory=dict)  # stacked path -> policy
    not_selected: list[str] = dataclasses.field(default_factory=list)
    # not selected, given lp_jax's BF16 GEMM for an FP32 weight gradient (the LM head)
    fp32_weight_gradients: list[str] = dataclasses.field(default_factory=list)
    # The GEMM backend each recipe used here runs on this process's platform
    # (docs/backends.md): recipe class name -> backend; ``platform`` is cpu, cuda, ...
    platform: str = ""
    backends: dict[str, str] = dataclasses.field(default_factory=dict)
    # From the layout: Linears that all-gather quantized weight bytes over fsdp, and those
    # that reduce their tensor-parallel partial sums in BF16 (path -> "row" | "column").
    gathered: list[str] = dataclasses.field(default_factory=list)
    tensor_reduced: dict[str, str] = dataclasses.field(default_factory=dict)
    # The container whose blocks are the layers ('/'-joined path; None: the model has none)
    # and whether its blocks are stacked on a leading axis (nnx.vmap) rather than indexed.
    layer_container: str | None = None
    stacked_container: bool = False
    # Linen models inside the NNX one (nnx.bridge.ToNNX): path -> the apply_recipe_linen
    # module now there, whose GEMMs are planned at its first call (lp_jax.linen_report).
    bridged: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        gemms = ", ".join(f"{name} via {backend}" for name, backend in self.backends.items())
        where = ("no layer container" if self.layer_container is None else
                 f"{'stacked ' if self.stacked_container else ''}container '{self.layer_container}'")
        if self.bridged:
            where += f"; the Linen model bridged at {', '.join(repr(p) for p in self.bridged)} is planned at its first call"
        lines = [f"recipe {self.recipe} ({self.policy}) over {self.num_layers} layers ({where}): "
                 f"{len(self.quantized)} GEMMs run {self.recipe}, {len(self.bf16_by_policy)} kept in "
                 f"BF16 by the layer policy, {len(self.per_slice)} stacked with a per-slice policy, "
                 f"{len(self.not_selected)} not selected; GEMMs on {self.platform}: {gemms}"]
        groups = [(self.recipe, list(self.quantized)),
                  ("BF16 (layer policy)", self.bf16_by_policy),
                  (f"{self.recipe}, per-slice policy {self.policy}", list(self.per_slice)),
                  ("BF16, FP32 weight gradient (not selected)", self.fp32_weight_gradients),
                  ("left as it was (not selected)",
                   [p for p in self.not_selected if p not in set(self.fp32_weight_gradients)])]
        pattern = None if self.layer_container is None or self.stacked_container else \
            index_pattern(self.layer_container)
        for label, paths in groups:
            if paths:
                lines.append(f"  {label}: " + "; ".join(fold_layer_paths(paths, pattern)))
        return "\n".join(lines)


def _ranges(indices) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out if r)


def index_pattern(container: str) -> re.Pattern:
    """A GEMM path's layer index in ``container``: 'h/3/...' (an nnx.List) or 'block_3/...'
    (numbered attributes, container 'block')."""
    return re.compile(rf"^{re.escape(container)}[/_](\d+)(?:/|$)" if container else r"^(\d+)(?:/|$)")


def fold_layer_paths(paths, pattern: re.Pattern | None = LAYER_INDEX) -> list[str]:
    """Paths with the same layer indices and prefix folded into one entry:
    layers/0/q, layers/0/k, layers/1/q, layers/1/k -> 'layers/{0-1}/{q, k}'. ``pattern``
    finds the index (None: no folding)."""
    by_template: dict[tuple[str, str], list[int]] = {}
    plain = []
    for path in paths:
        m = pattern.search(path) if pattern is not None else None
        if m is None:
            plain.append(path)
            continue
        prefix, suffix = path[:m.start(1)], path[m.end(1):]
        by_template.setdefault((prefix, suffix), []).append(int(m.group(1)))
    by_indices: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for (prefix, suffix), indices in by_template.items():
        by_indices.setdefault((prefix, tuple(sorted(indices))), []).append(suffix.lstrip("/"))
    folded = []
    for (prefix, indices), suffixes in by_indices.items():
        tail = suffixes[0] if len(suffixes) == 1 else "{" + ", ".join(suffixes) + "}"
        folded.append(f"{prefix}{{{_ranges(indices)}}}/{tail}")
    return folded + plain


def record_backends(report: SwapReport, recipe, bf16, partly_manual: bool = False) -> None:
    """Fills ``report.platform`` and the GEMM backend of each recipe the swap used."""
    report.platform = backends.current_platform()
    used_recipes = [recipe] if report.quantized or report.per_slice or report.bridged else []
    if report.bf16_by_policy or report.fp32_weight_gradients or report.per_slice:
        used_recipes.append(bf16)
    for r in used_recipes:
        report.backends.setdefault(type(r).__name__, backends.backend_on(r, report.platform,
                                                                         partly_manual=partly_manual))
