"""apply_recipe: set the dot_general of the selected nnx.Linear modules, in place.

Selection: by default every ``nnx.Linear`` inside a transformer layer (an integer right after
a ``layers`` path component: ``layers/3/attn/q_proj``), never the embedding or the LM head,
whatever the rules say; ``include`` and ``exclude`` are regular expressions (or lists of
them) searched in the '/'-joined path. Layers the recipe keeps in BF16 (FiLj,
``bf16_layers``) and, unless ``fp32_weight_gradients=False``, the unselected Linears get
lp_jax's BF16 GEMM, whose weight gradient is FP32 (docs/numerics.md); a user's own
dot_general is left alone. Stacked layers get the policy per slice
(``LayerPolicyDotGeneral``). Only static attributes change (``dot_general``,
``promote_dtype``), so a checkpoint from one recipe loads into a model swapped to another;
calling apply_recipe again replaces what the previous call set.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Protocol

from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax

from lp_jax.gemm import backends
from lp_jax.gemm.dot_general import KeepKernelDtype, LowPrecisionDotGeneral
from lp_jax.recipes import BF16, Recipe, get_recipe
from lp_jax.surgery.layer_policy import LayerPolicyDotGeneral

LAYER_INDEX = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")
IN_LAYERS = re.compile(r"(?:^|/)layers(?:/|$)")
# Never quantized (embedding, LM head), whatever include says.
NEVER = re.compile(r"(?:^|/)(?:embed\w*|lm_head|tok_embeddings|wte|output_head|head)(?:/|$)")


@dataclasses.dataclass
class SwapReport:
    """What apply_recipe did: path -> recipe name, for every Linear it saw.

    ``str(report)`` is a one-line summary followed by one line per group of Linears that got
    the same GEMM (layer indices folded into ranges: ``layers/{0-3,6}/{q_proj, k_proj}``).
    """

    recipe: str
    policy: str
    num_layers: int
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> recipe
    bf16_by_policy: list[str] = dataclasses.field(default_factory=list)
    per_slice: dict[str, str] = dataclasses.field(default_factory=dict)  # stacked path -> policy
    not_selected: list[str] = dataclasses.field(default_factory=list)
    unmatched_rules: list[str] = dataclasses.field(default_factory=list)
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

    def __str__(self) -> str:
        gemms = ", ".join(f"{name} via {backend}" for name, backend in self.backends.items())
        lines = [f"recipe {self.recipe} ({self.policy}) over {self.num_layers} layers: "
                 f"{len(self.quantized)} Linears run {self.recipe}, {len(self.bf16_by_policy)} kept in "
                 f"BF16 by the layer policy, {len(self.per_slice)} stacked with a per-slice policy, "
                 f"{len(self.not_selected)} not selected; GEMMs on {self.platform}: {gemms}"]
        groups = [(self.recipe, list(self.quantized)),
                  ("BF16 (layer policy)", self.bf16_by_policy),
                  (f"{self.recipe}, per-slice policy {self.policy}", list(self.per_slice)),
                  ("BF16, FP32 weight gradient (not selected)", self.fp32_weight_gradients),
                  ("left as it was (not selected)",
                   [p for p in self.not_selected if p not in set(self.fp32_weight_gradients)])]
        for label, paths in groups:
            if paths:
                lines.append(f"  {label}: " + "; ".join(fold_layer_paths(paths)))
        if self.unmatched_rules:
            lines.append("  rules that matched nothing: " + ", ".join(self.unmatched_rules))
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


def fold_layer_paths(paths) -> list[str]:
    """Paths with the same layer indices and prefix folded into one entry:
    layers/0/q, layers/0/k, layers/1/q, layers/1/k -> 'layers/{0-1}/{q, k}'."""
    by_template: dict[tuple[str, str], list[int]] = {}
    plain = []
    for path in paths:
        m = LAYER_INDEX.search(path)
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


def _patterns(rules) -> list[str]:
    if rules is None:
        return []
    return [rules] if isinstance(rules, str) else list(rules)


def _linears(model):
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear):
            yield "/".join(map(str, path)), node


def _placed(dg: LowPrecisionDotGeneral, path: str, linear: nnx.Linear, layout: Layout | None,
            report: SwapReport) -> LowPrecisionDotGeneral:
    """``dg`` with the layout's weight gather and tensor reduction for this Linear."""
    if layout is None:
        return dg
    shape = linear.kernel.shape
    gather, reduce = layout.gather(path, shape, dg.recipe), layout.tensor_reduce(path, shape)
    if gather is not None:
        report.gathered.append(path)
    if reduce is not None:
        report.tensor_reduced[path] = reduce
    return dataclasses.replace(dg, gather=gather, tensor_reduce=reduce, partly_manual=layout.partly_manual)


def _reset(linear: nnx.Linear):
    """Undoes an earlier apply_recipe on this Linear (a user's own dot_general is kept)."""
    if isinstance(linear.dot_general, (LowPrecisionDotGeneral, LayerPolicyDotGeneral)):
        linear.dot_general = lax.dot_general
        linear.promote_dtype = nnx_dtypes.promote_dtype


class Layout(Protocol):
    """How a Linear's GEMM meets the mesh (``lp_jax.parallel.linear_layout.LinearLayout``)."""

    def gather(self, path: str, kernel_shape, recipe: Recipe) -> tuple | None: ...

    def tensor_reduce(self, path: str, kernel_shape) -> str | None: ...

    @property
    def partly_manual(self) -> bool: ...

    @property
    def partitioned(self) -> bool: ...


def apply_recipe(model, recipe: Recipe | str, include=None, exclude=None,
                 num_layers: int | None = None, fp32_weight_gradients: bool = True,
                 layout: Layout | None = None) -> SwapReport:
    """Swaps in ``recipe`` (a Recipe or a name) on the selected Linears of ``model``; the
    unselected ones get lp_jax's BF16 GEMM (FP32 weight gradients) unless
    ``fp32_weight_gradients=False``, which leaves them on ``lax.dot_general``.

    ``layout`` (the trainer's mesh) decides, in the same pass, which of those GEMMs gather
    quantized weight bytes under FSDP and which reduce tensor-parallel sums in BF16; without
    one, none does."""
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if layout is not None and layout.partitioned and recipe.quantize_impl == "auto":
        # The Pallas quantizers bring no partitioning rule (their amax is over what they are
        # given): where the GEMMs see arrays the partitioner splits, "auto" keeps XLA's.
        recipe = dataclasses.replace(recipe, quantize_impl="xla")
    includes, excludes = _patterns(include), _patterns(exclude)
    used = {p: False for p in includes + excludes}
    linears = list(_linears(model))
    indices = [int(m.group(1)) for path, _ in linears if (m := LAYER_INDEX.search(path))]
    stacked_depths = [lin.kernel.shape[0] for path, lin in linears
                      if IN_LAYERS.search(path) and not LAYER_INDEX.search(path) and lin.kernel.ndim > 2]
    if num_layers is None:
        num_layers = max(indices) + 1 if indices else max(stacked_depths, default=0)
    if recipe.first_bf16_layers + recipe.last_bf16_layers > num_layers and recipe.quantized:
        raise ValueError(f"layer policy {recipe.policy} keeps more layers in BF16 than the model has "
                         f"({num_layers})")
    beyond = [i for i in recipe.bf16_layers if i >= num_layers]
    if beyond and recipe.quantized:
        raise ValueError(f"bf16_layers {beyond} are not layers of this model (it has {num_layers})")
    bf16 = BF16(backend=recipe.backend)
    report = SwapReport(type(recipe).__name__, recipe.policy, num_layers)
    for path, linear in linears:
        selected = any(re.search(p, path) for p in includes) if includes else bool(IN_LAYERS.search(path))
        for p in includes + excludes:
            used[p] = used[p] or bool(re.search(p, path))
        if any(re.search(p, path) for p in excludes) or NEVER.search(path) or not selected:
            _reset(linear)
            report.not_selected.append(path)
            if fp32_weight_gradients and linear.dot_general is lax.dot_general:
                linear.dot_general = _placed(LowPrecisionDotGeneral(bf16), path, linear, layout, report)
                linear.promote_dtype = KeepKernelDtype()
                report.fp32_weight_gradients.append(path)
            continue
        linear.promote_dtype = KeepKernelDtype()
        m = LAYER_INDEX.search(path)
        if m is None and linear.kernel.ndim > 2:
            linear.dot_general = LayerPolicyDotGeneral(recipe, num_layers,
                                                       partly_manual=layout is not None and layout.partly_manual)
            report.per_slice[path] = recipe.policy
        elif m is not None and recipe.layer_is_bf16(int(m.group(1)), num_layers):
            linear.dot_general = _placed(LowPrecisionDotGeneral(bf16), path, linear, layout, report)
            report.bf16_by_policy.append(path)
        else:
            linear.dot_general = _placed(LowPrecisionDotGeneral(recipe), path, linear, layout, report)
            report.quantized[path] = type(recipe).__name__
    report.unmatched_rules = [p for p, hit in used.items() if not hit]
    report.platform = backends.current_platform()
    used_recipes = [recipe] if report.quantized or report.per_slice else []
    if report.bf16_by_policy or report.fp32_weight_gradients or report.per_slice:
        used_recipes.append(bf16)
    for r in used_recipes:
        report.backends.setdefault(type(r).__name__, backends.backend_on(
            r, report.platform, partly_manual=layout is not None and layout.partly_manual))
    return report
