"""Precision recipes: which format each GEMM operand gets, and which layers stay in BF16.

Named as Transformer Engine and Megatron Bridge name them. A recipe is a frozen, hashable
dataclass, part of the static attributes of every swapped ``nnx.Linear`` (equal recipes
share compiled code); its six operand specs (fprop x, W along K; dgrad dy, W along N; wgrad
x, dy along the tokens M; docs/numerics.md) are derived from its options in
``__post_init__``, so they can never disagree. Pure data: this module imports nothing of
the project and writes once the vocabularies (formats, GEMM backends, quantizer
implementations) that the other layers check against.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import ClassVar, Literal

Format = Literal["fp8_e4m3", "fp8_e5m2", "fp8_block", "fp8_block_e5m2", "mxfp8", "nvfp4"]
Backend = Literal["auto", "reference", "xla_fp8", "cudnn", "xla_scaled_dot", "wgmma"]
QuantizeImpl = Literal["xla", "pallas", "auto"]
PER_TENSOR_FORMATS: tuple[Format, ...] = ("fp8_e4m3", "fp8_e5m2")
BLOCK_FORMATS: tuple[Format, ...] = ("fp8_block", "fp8_block_e5m2", "mxfp8", "nvfp4")
BACKENDS: tuple[Backend, ...] = ("auto", "reference", "xla_fp8", "cudnn", "xla_scaled_dot", "wgmma")
QUANTIZE_IMPLS: tuple[QuantizeImpl, ...] = ("xla", "pallas", "auto")
AmaxScope = Literal["global", "local"]
AMAX_SCOPES: tuple[AmaxScope, ...] = ("global", "local")
# The GEMM library each kind of format is built for: cuBLASLt's FP8 GEMM through XLA for
# per-tensor scales, cuDNN's block-scaled GEMM for block formats (docs/backends.md).
NATIVE_BACKEND = {"per_tensor": "xla_fp8", "block": "cudnn"}
# Other backends a kind of format may be forced onto: XLA's scaled dot (a Triton GEMM fusion
# on the GPU) for block formats, not yet measured on one, so not what "auto" picks.
OTHER_BACKENDS = {"per_tensor": (), "block": ("xla_scaled_dot",)}


def check_choice(name: str, value, choices: tuple) -> None:
    """One line (ValueError) when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; expected one of {choices}")


@dataclasses.dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand is quantized. fmt None means BF16 (not quantized)."""

    fmt: Format | None = None
    block_2d: bool = False  # weight tiles (NVFP4 16x16, FP8 block 128x128): one copy for fprop and dgrad
    rht: bool = False  # random Hadamard transform along the contraction axis first
    stochastic: bool = False  # stochastic rounding (NVFP4 gradients)
    scale_rule: str = "rceil"  # MXFP8 E8M0 rule: TE's "rceil" or OCP's "floor"
    block_scale_search: str | None = None  # NVFP4: "4over6" (each block scaled to 6 or to 4)
    metric: str = "mae"  # the 4/6 choice's reconstruction error: "mae" or "mse"
    quantize_impl: QuantizeImpl = "auto"  # the quantizer that makes it (lp_jax.quantize's impl)


_BF16_OPERAND = OperandSpec()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Base: the FiLj layer policy and the backend; subclasses fill the six operand specs."""

    name: ClassVar[str] = "bf16"
    # The tensor-core type its GEMMs run on ("bf16" | "fp8" | "fp4"): which peak an MFU uses.
    gemm_dtype: ClassVar[str] = "bf16"
    # The recipe's GEMM on Hopper (sm_90) where it has one of its own ("auto" picks it there):
    # Hopper has no block-scaled MMA, and XLA expands cuDNN's block-scaled GEMM into
    # dequantize + dot there.
    hopper_backend: ClassVar[str | None] = None
    # FiLj: transformer layer l of L runs in BF16 if l < first_bf16_layers or l >= L - last_bf16_layers.
    first_bf16_layers: int = 0
    last_bf16_layers: int = 0
    # Any other layers kept in BF16, by index (what `python -m lp_jax.inspect` proposes when
    # no FiLj fits): a layer is BF16 if FiLj or this list says so. Stored sorted, unique.
    bf16_layers: tuple[int, ...] = ()
    # GEMM implementation of the quantized GEMMs: "auto" (decided per platform when the program
    # is lowered), "reference", "xla_fp8" (FP8-CS), "cudnn" (block formats) or "wgmma" (FP8
    # block scaling on Hopper: a Pallas Mosaic GPU kernel); docs/backends.md.
    # One that does not fit the recipe, or cannot run where the program is lowered, raises.
    backend: Backend = "auto"
    # Quantizer implementation of all six operand copies: "xla", "pallas" (the Pallas kernels,
    # ``lp_jax.kernels``; the same bits) or "auto" (``lp_jax.quantizer.resolve_impl``).
    quantize_impl: QuantizeImpl = "auto"
    # Transformer Engine's fp8_param_gather / fp4_param_gather (Megatron Bridge's recipes set
    # them): the quantized Linears' weight copies are made from the FP32 masters (one
    # rounding), not from their BF16 cast (two roundings, TE's default); under FSDP each
    # device quantizes its master shard and all-gathers the quantized bytes and scales
    # instead of the BF16 weight (``lp_jax.gemm.param_gather``). No effect on BF16 GEMMs.
    param_gather: bool = False
    # The data a per-tensor amax (FP8-CS, NVFP4's tensor scale) covers under data
    # parallelism: "global", the whole global batch (one scalar all-reduce over the data
    # axis per quantized tensor; results independent of the data layout), or "local", each
    # data-parallel rank's own rows, as Transformer Engine takes it (no such all-reduce;
    # activation and gradient scales then depend on how the batch is split). Weights are
    # whole on every data rank, so their scales are the same either way (docs/scaling.md).
    amax_scope: AmaxScope = "global"

    fprop_x: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)
    fprop_w: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)
    dgrad_dy: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)
    dgrad_w: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)
    wgrad_x: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)
    wgrad_dy: OperandSpec = dataclasses.field(init=False, repr=False, default=_BF16_OPERAND)

    def __post_init__(self):
        for field in ("first_bf16_layers", "last_bf16_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field}={value!r} must be a non-negative integer")
        check_choice("impl", self.quantize_impl, QUANTIZE_IMPLS)
        check_choice("amax_scope", self.amax_scope, AMAX_SCOPES)
        layers = self.bf16_layers
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__") or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
            raise ValueError(f"bf16_layers={layers!r} must be a list of non-negative layer indices")
        object.__setattr__(self, "bf16_layers", tuple(sorted(set(layers))))
        if not isinstance(self.param_gather, bool):
            raise ValueError(f"param_gather={self.param_gather!r} must be true or false")
        for gemm_operand, spec in self._operands().items():
            object.__setattr__(self, gemm_operand, dataclasses.replace(spec, quantize_impl=self.quantize_impl))
        self._check_backend()

    def _operands(self) -> dict[str, OperandSpec]:
        return {}

    @property
    def format_kind(self) -> str | None:
        """"per_tensor" or "block": the kind of format the recipe's GEMMs multiply; None when
        it quantizes nothing (BF16 runs XLA's dot anywhere)."""
        kinds = {"per_tensor" if spec.fmt in PER_TENSOR_FORMATS else "block"
                 for spec in self.operand_specs() if spec.fmt}
        if not kinds:
            return None
        if len(kinds) > 1:
            raise ValueError(f"recipe {self.name!r} mixes per-tensor and block formats: no backend runs it")
        return kinds.pop()

    @property
    def native_backend(self) -> str | None:
        """The backend built for this recipe's quantized GEMMs: xla_fp8 for per-tensor FP8,
        cudnn for block formats, None when it quantizes nothing."""
        kind = self.format_kind
        return None if kind is None else NATIVE_BACKEND[kind]

    @property
    def native_backends(self) -> tuple[str, ...]:
        """Every backend built for this recipe's GEMMs: the native one, its Hopper GEMM if it
        has one (``hopper_backend``), then the others its formats may be forced onto."""
        kind = self.format_kind
        if kind is None:
            return ()
        hopper = (self.hopper_backend,) if self.hopper_backend else ()
        return (NATIVE_BACKEND[kind],) + hopper + OTHER_BACKENDS[kind]

    def _check_backend(self) -> None:
        """One line if ``backend`` is unknown or cannot run the recipe's formats."""
        check_choice("backend", self.backend, BACKENDS)
        native = self.native_backend
        if self.backend in ("auto", "reference") or native is None or self.backend in self.native_backends:
            return
        raise ValueError(f"backend={self.backend!r} cannot run recipe {self.name!r}: its GEMMs run on "
                         f"'auto', 'reference' or {' or '.join(map(repr, self.native_backends))}")

    def operand_specs(self) -> tuple[OperandSpec, ...]:
        return tuple(getattr(self, f) for f in OPERAND_FIELDS)

    @property
    def quantized(self) -> bool:
        return any(spec.fmt for spec in self.operand_specs())

    @property
    def policy(self) -> str:
        """'F1L1', or 'F0L0+bf16[2,5]' with an explicit list of BF16 layers."""
        fil = f"F{self.first_bf16_layers}L{self.last_bf16_layers}"
        return fil + (f"+bf16[{','.join(map(str, self.bf16_layers))}]" if self.bf16_layers else "")

    def layer_is_bf16(self, layer: int, num_layers: int) -> bool:
        return (layer < self.first_bf16_layers or layer >= num_layers - self.last_bf16_layers
                or layer in self.bf16_layers)


OPERAND_FIELDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")


@dataclasses.dataclass(frozen=True)
class BF16(Recipe):
    """BF16 GEMMs with FP32 accumulation, FP32 weight gradients: the baseline."""

    name: ClassVar[str] = "bf16"


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """FP8 with per-tensor current scaling (TE ``Float8CurrentScaling``).

    fp8_format "HYBRID" (TE's default): x and W in E4M3, dy in E5M2 for its range; "E4M3":
    all three in E4M3. Per-tensor scaling makes rowwise and columnwise copies identical, so
    each tensor is quantized once and the bytes serve all GEMMs that use it.
    """

    name: ClassVar[str] = "fp8_cs"
    gemm_dtype: ClassVar[str] = "fp8"
    first_bf16_layers: int = 1  # Megatron Bridge default F1L1
    last_bf16_layers: int = 1
    fp8_format: str = "HYBRID"

    def _operands(self):
        if self.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"fp8_format={self.fp8_format!r} is not valid; expected 'HYBRID' or 'E4M3'")
        fwd = OperandSpec("fp8_e4m3")
        grad = OperandSpec("fp8_e5m2" if self.fp8_format == "HYBRID" else "fp8_e4m3")
        return dict(fprop_x=fwd, fprop_w=fwd, dgrad_dy=grad, dgrad_w=fwd, wgrad_x=fwd, wgrad_dy=grad)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 block scaling (TE ``Float8BlockScaling``, DeepSeek-V3's recipe): FP32
    power-of-two scales; activations and gradients in 1x128 blocks along each GEMM's
    contraction axis (the wgrad copies along the tokens, quantized again from the BF16
    tensor), weights in 128x128 tiles (the same bytes serve fprop and dgrad).

    fp8_format "E4M3" (TE's default for this recipe): every operand in E4M3; "HYBRID": the
    gradient dy of the dgrad and wgrad GEMMs in E5M2 blocks, x and W in E4M3. Megatron
    Bridge's ``bf16_with_fp8_subchannel_scaling_mixed`` is HYBRID (its fp8="hybrid") and
    keeps no layer in BF16 (F0L0).
    """

    name: ClassVar[str] = "fp8_block"
    gemm_dtype: ClassVar[str] = "fp8"
    hopper_backend: ClassVar[str | None] = "wgmma"
    fp8_format: str = "E4M3"

    def _operands(self):
        check_choice("fp8_format", self.fp8_format, ("E4M3", "HYBRID"))
        if self.quantize_impl == "pallas":
            raise ValueError("quantize_impl='pallas' cannot run recipe 'fp8_block' (no Pallas kernel "
                             "quantizes its blocks); use 'xla' or 'auto'")
        rows, tiles = OperandSpec("fp8_block"), OperandSpec("fp8_block", block_2d=True)
        grad = OperandSpec("fp8_block_e5m2") if self.fp8_format == "HYBRID" else rows
        return dict(fprop_x=rows, fprop_w=tiles, dgrad_dy=grad, dgrad_w=tiles, wgrad_x=rows, wgrad_dy=grad)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: 32-element blocks along each GEMM's contraction axis, E8M0 scales, all E4M3.

    A copy along another axis is re-quantized from the high-precision tensor (TE does the
    same): rowwise and columnwise MXFP8 differ.
    """

    name: ClassVar[str] = "mxfp8"
    gemm_dtype: ClassVar[str] = "fp8"
    scale_rule: str = "rceil"  # TE/cuBLAS rounding; "floor" is the OCP v1.0 rule

    def _operands(self):
        if self.scale_rule not in ("rceil", "floor"):
            raise ValueError(f"scale_rule={self.scale_rule!r} is not valid; expected 'rceil' or 'floor'")
        mx = OperandSpec("mxfp8", scale_rule=self.scale_rule)
        return {f: mx for f in OPERAND_FIELDS}


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, 16-element E4M3 block scales and an FP32 tensor scale.

    Weights use 16x16 tiles (the same bytes serve fprop and dgrad); gradients use stochastic
    rounding; wgrad operands go through the 16-point RHT along the token axis. The last four
    layers stay in BF16 (Megatron Bridge F0L4): a fully NVFP4 model diverges at scale.
    """

    name: ClassVar[str] = "nvfp4"
    gemm_dtype: ClassVar[str] = "fp4"
    last_bf16_layers: int = 4
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d: bool = False
    # 4/6 block scales (TE's nvfp4_4over6; docs/numerics.md): None (off, the default) or
    # "4over6", on the weights, the activations (x, its RHT'd wgrad copy too) or all of them;
    # never on gradients. The choice's error metric: "mae" (TE's default) or "mse".
    block_scale_search: str | None = None
    block_scale_search_on: str = "weights"
    block_scale_search_metric: str = "mae"

    def _operands(self):
        check_choice("block_scale_search", self.block_scale_search, (None, "4over6"))
        check_choice("block_scale_search_on", self.block_scale_search_on, ("weights", "activations", "all"))
        check_choice("block_scale_search_metric", self.block_scale_search_metric, ("mae", "mse"))
        if self.block_scale_search and self.quantize_impl == "pallas":
            raise ValueError("quantize_impl='pallas' cannot run block_scale_search='4over6' (no Pallas "
                             "kernel chooses 4/6 scales); use 'xla' or 'auto'")
        sr = not self.disable_stochastic_rounding
        rht = not self.disable_rht
        on = self.block_scale_search_on
        search = lambda applies: (dict(block_scale_search=self.block_scale_search,  # noqa: E731
                                       metric=self.block_scale_search_metric)
                                  if self.block_scale_search and applies else {})
        w = OperandSpec("nvfp4", block_2d=not self.disable_2d, **search(on in ("weights", "all")))
        x = search(on in ("activations", "all"))
        return dict(
            fprop_x=OperandSpec("nvfp4", **x),
            fprop_w=w,
            dgrad_dy=OperandSpec("nvfp4", stochastic=sr),
            dgrad_w=w,
            wgrad_x=OperandSpec("nvfp4", rht=rht, **x),
            wgrad_dy=OperandSpec("nvfp4", rht=rht, stochastic=sr),
        )


_CLASSES = (BF16, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)
# Megatron Bridge's mixed_precision recipe names -> our short names, and the fields whose
# value Bridge's recipe sets apart from the short name's default.
BRIDGE_NAMES = {
    "bf16_mixed": "bf16",
    "bf16_with_fp8_current_scaling_mixed": "fp8_cs",
    "bf16_with_fp8_subchannel_scaling_mixed": "fp8_block",
    "bf16_with_mxfp8_mixed": "mxfp8",
    "bf16_with_nvfp4_mixed": "nvfp4",
}
BRIDGE_FIELDS = {"bf16_with_fp8_subchannel_scaling_mixed": {"fp8_format": "HYBRID"}}
# Every name a recipe answers to: short names, Megatron Bridge's names, TE's class names.
RECIPES: dict[str, type[Recipe]] = {cls.name: cls for cls in _CLASSES}
RECIPES.update({bridge: RECIPES[short] for bridge, short in BRIDGE_NAMES.items()})
RECIPES.update({cls.__name__: cls for cls in _CLASSES})


def parse_policy(policy: str) -> tuple[int, int]:
    """'F1L4' -> (1, 4)."""
    m = re.fullmatch(r"F(\d+)L(\d+)", policy.strip())
    if not m:
        raise ValueError(f"layer policy {policy!r} is not of the form F<i>L<j>, e.g. 'F0L4'")
    return int(m.group(1)), int(m.group(2))


def get_recipe(name: str | Recipe, **overrides) -> Recipe:
    """A recipe by short, Megatron Bridge or TE name, with fields overridden by keyword.

    A Bridge name gives Bridge's recipe (``BRIDGE_FIELDS``); ``policy="F1L1"`` is accepted
    as shorthand for first_bf16_layers/last_bf16_layers.
    """
    if isinstance(name, Recipe):
        cls, base = type(name), {f.name: getattr(name, f.name) for f in dataclasses.fields(name) if f.init}
    elif name in RECIPES:
        cls, base = RECIPES[name], dict(BRIDGE_FIELDS.get(name, {}))
    else:
        close = difflib.get_close_matches(str(name), list(RECIPES), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"unknown recipe {name!r}{hint}; valid names: {', '.join(RECIPES)}")
    overrides = dict(overrides)
    if "policy" in overrides:
        overrides["first_bf16_layers"], overrides["last_bf16_layers"] = parse_policy(overrides.pop("policy"))
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in overrides:
        if key not in valid:
            raise ValueError(f"recipe {cls.__name__} has no field {key!r}; valid fields: {', '.join(valid)}")
    return cls(**{**base, **overrides})
