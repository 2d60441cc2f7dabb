"""The model families the trainer builds, by ``model.type``: ``llama`` (models.llama), any
family a user registers with ``register_model_family``, and any family named by an import
path ``package.module:attribute`` (imported on first use, from the working directory or the
installed packages, so that ``python train.py`` and the plan can build it too).

The trainer, the plan, the study's memory table, the mesh checks and the saved-run reader
build their model only through ``build_model``; nothing else in lp_jax constructs one.
Every family builds from the same architecture, a ``models.config.LlamaConfig`` made of
``model.preset`` and the ``model.*`` keys (vocab_size, hidden_size, num_layers, ...,
dtype, param_dtype): a family reads the fields it needs. That is what the shape checks of a
resume, the run folder's saved model and the tensor-parallel head checks read, so they hold
for every family. docs/your_model.md, "Registering a model family", has a worked example.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, Protocol

from flax import nnx

from lp_jax.errors import UserError, one_line
from models import config as model_config
from models.llama import Llama

DEFAULT_TYPE = "llama"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class TrainableModel(Protocol):
    """The model a family builds: an ``nnx.Module`` the train step calls as below.

    ``apply_recipe`` quantizes the GEMMs of the container of its repeated blocks, found from
    its structure (docs/your_model.md), and the layer policy (FiLj, ``precision.bf16_layers``)
    counts the blocks there; the embedding and the LM head stay unquantized. Keeping the
    blocks in ``self.layers`` (paths ``layers/<i>/...``) also serves scanned-layer stacking
    and ``python -m lp_jax.inspect``. It keeps no ``nnx.Rngs`` (``build_model`` refuses it).
    """

    def __call__(self, tokens_BxL, positions=None, segment_ids=None) -> Any:
        """Logits [B, L, V] from int32 tokens [B, L]; ``positions`` [B, L] restart at 0 in each
        packed document and ``segment_ids`` [B, L] number the documents (a token attends
        only to earlier tokens of its own document; a model may ignore both). A model may
        return ``(logits, extras)`` instead: ``extras["aux_loss"]`` (a scalar per token, such
        as models.moe's load-balancing loss) joins what the step differentiates, and the
        scalars named by the model's ``extra_metrics`` attribute are reported with the loss."""


class ScannedLayers(Protocol):
    """Optional hooks of a model that scans runs of identical layers (models.llama does with
    ``model.scan_layers``). A model without them is differentiated as it is
    (``lp_jax.training.layer_stacks``).

    Optional too, for any model: calling block ``i`` inside ``models.layer_scope.layer_scope(i)``.
    The stochastic-rounding keys then differ per layer, and a scanned (stacked) Linear gets
    its per-layer FiLj choice from it. Without it, stochastic-rounding keys differ per call
    site only, and the layer policy applies by the ``layers/<i>`` paths (unscanned blocks).
    """

    def scanned_runs(self) -> list[tuple[int, int]]:
        """[(start, end), ...]: the layer index ranges run as one scan."""

    def layer_param_stacks(self) -> dict:
        """{start: the run's Params stacked along a leading layer axis}, for each scanned run."""

    def __call__(self, tokens_BxL, positions=None, segment_ids=None, layer_stacks=None) -> Any:
        """As ``TrainableModel``; ``layer_stacks`` (as ``layer_param_stacks`` returns, made once
        per step by the trainer) replaces the stacks the model would make itself."""


class ModelFamily(Protocol):
    """What ``register_model_family`` takes. ``build`` is required; the rest is optional, and
    a family that leaves a member out gets the default below (subclass ``ModelFamily`` to
    inherit them, or write a plain class with the members you need)."""

    def build(self, config: model_config.LlamaConfig, rngs: nnx.Rngs) -> TrainableModel:
        """The NNX model of the run: ``config`` is the architecture of ``model.*`` (checked
        by ``LlamaConfig``), ``rngs`` seeded with the run's seed. Called under
        ``nnx.eval_shape`` too, so it must not read the parameters it creates."""
        ...

    def preset(self, name: str, **overrides) -> model_config.LlamaConfig:
        """The architecture of ``model.preset=name`` with the set ``model.*`` keys. Default:
        ``models.config.preset`` (tiny, llama3_125m, llama3_1b, llama3_8b, research_8b)."""
        return model_config.preset(name, **overrides)

    def flops_per_token(self, config: model_config.LlamaConfig, seq_len: int) -> float:
        """Training FLOPs per token, for the metrics' tflops_per_device and MFU and the plan's
        figures. Default: the dense decoder's ``6N + 12 L H d_head T``
        (``models.config.flops_per_token``) on the config's fields."""
        return model_config.flops_per_token(config, seq_len)

    #: Whether ``init.hf`` and ``python -m lp_jax.export`` can convert this family's weights
    #: from and to a Hugging Face checkpoint (``models.hf``: a Llama one, a Qwen3-MoE one for
    #: ``moe``). Default: False, and those keys are refused for the family with one line.
    hf_checkpoints: bool = False


class LlamaFamily(ModelFamily):
    """lp_jax's own Llama (models.llama), the default ``model.type``."""

    hf_checkpoints = True

    def build(self, config: model_config.LlamaConfig, rngs: nnx.Rngs) -> Llama:
        return Llama(config, rngs=rngs)


class MoEFamily(ModelFamily):
    """The Qwen3-MoE-style mixture of experts (models.moe): ``model.type=moe``. Its Hugging
    Face checkpoints are Qwen3MoeForCausalLM folders, which need ``model.qk_norm``."""

    hf_checkpoints = True

    def build(self, config: model_config.LlamaConfig, rngs: nnx.Rngs):
        from models.moe import Qwen3MoE
        return Qwen3MoE(config, rngs=rngs)

    def preset(self, name: str, **overrides) -> model_config.LlamaConfig:
        from models import moe
        return moe.preset(name, **overrides)

    def flops_per_token(self, config: model_config.LlamaConfig, seq_len: int) -> float:
        from models import moe
        return moe.flops_per_token(config, seq_len)


_FAMILIES: dict[str, Any] = {DEFAULT_TYPE: LlamaFamily(), "moe": MoEFamily()}


def register_model_family(name: str, family: Any, *, replace: bool = False) -> None:
    """Makes ``family`` (a ``ModelFamily``) the model of ``model.type=name``. ValueError if
    the name is taken (``replace=True`` replaces it; ``llama`` cannot be) or the family has
    no callable ``build``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"model family name {name!r} is invalid: lower-case letters, digits and _, "
                         "starting with a letter")
    if not callable(getattr(family, "build", None)):
        raise ValueError(f"model family {name!r}: {family!r} has no build(config, rngs) method")
    if name == DEFAULT_TYPE:
        raise ValueError(f"model family {DEFAULT_TYPE!r} is lp_jax's Llama and cannot be replaced")
    if name in _FAMILIES and not replace:
        raise ValueError(f"model family {name!r} is already registered (replace=True replaces it)")
    _FAMILIES[name] = family


def unregister_model_family(name: str) -> None:
    """Removes a family ``register_model_family`` added (KeyError if there is none)."""
    if name == DEFAULT_TYPE:
        raise ValueError(f"model family {DEFAULT_TYPE!r} cannot be removed")
    del _FAMILIES[name]


def registered() -> tuple[str, ...]:
    """The registered ``model.type`` names, ``llama`` first."""
    return tuple(_FAMILIES)


def model_family(model_type: str) -> Any:
    """The family of ``model.type``: a registered name, or an import path
    ``package.module:attribute`` (``imported_family``). UserError (one line) for a name not
    registered (with the registered names and the close ones) or a path that does not import
    a family."""
    if ":" in str(model_type):
        return imported_family(model_type)
    family = _FAMILIES.get(model_type)
    if family is None:
        close = difflib.get_close_matches(str(model_type), list(_FAMILIES), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        if not hint and "." in str(model_type):
            hint = "; an import path is written package.module:attribute"
        raise UserError(f"model.type={model_type!r} is not a registered model family; registered: "
                        f"{', '.join(_FAMILIES)}{hint}")
    return family


_IMPORTED: dict[str, Any] = {}  # import path -> its family, made once per process


def imported_family(path: str) -> Any:
    """The family at ``package.module:attribute``: the module imported (the working directory
    is importable, as it is for ``python -m``), the attribute taken (a dotted one too), a class
    instantiated with no arguments; it must have a callable ``build``. The same object each
    time; UserError (one line) for a module not found, an attribute missing or not a family."""
    family = _IMPORTED.get(path)
    if family is not None:
        return family
    where = f"model.type={path!r}"
    module_name, _, attribute = path.partition(":")
    if not module_name or module_name.startswith(".") or not attribute or ":" in attribute:
        raise UserError(f"{where} is not an import path package.module:attribute")
    cwd = os.getcwd()
    if cwd not in {os.path.abspath(p) for p in sys.path}:
        sys.path.append(cwd)
        importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UserError(f"{where}: no module named {module_name!r}; it must be importable from the "
                            f"working directory ({cwd}) or installed") from None
        raise UserError(f"{where}: importing {module_name!r} failed: {one_line(e)}") from None
    family = module
    for i, name in enumerate(attribute.split(".")):
        if not hasattr(family, name):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attribute.split('.')[:i])}"
            close = difflib.get_close_matches(name, [n for n in dir(family) if not n.startswith("_")],
                                              n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise UserError(f"{where}: {owner!r} has no attribute {name!r}{hint}")
        family = getattr(family, name)
    if inspect.isclass(family):
        try:  # __init__'s own signature: a metaclass (nnx.Module's) hides the class's
            inspect.signature(family.__init__).bind(None)
        except TypeError as e:
            raise UserError(f"{where}: the class {attribute} cannot be made with no arguments "
                            f"({one_line(e)})") from None
        except ValueError:  # no signature to check: the call below says
            pass
        family = family()
    if not callable(getattr(family, "build", None)):
        shown = " ".join(repr(family).split())
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        raise UserError(f"{where} is not a model family: {shown} has no build(config, rngs) method")
    return _IMPORTED.setdefault(path, family)


def build_model(model_type: str, config: model_config.LlamaConfig, rngs: nnx.Rngs):
    """The model of ``model.type`` built from the architecture ``config``. UserError if it
    keeps ``nnx.Rngs`` (the train step threads no RNG state through the model)."""
    model = model_family(model_type).build(config, rngs)
    kept = nnx.to_flat_state(nnx.state(model, nnx.RngState))
    if len(kept):
        where = "/".join(map(str, kept[0][0]))
        raise UserError(f"model.type={model_type!r}: the model keeps nnx.Rngs state ({where}), which the train step "
                        "does not thread: drop it once the model is built (a ToNNX's to_nnx__rngs = None)")
    return model


def preset(model_type: str, name: str, **overrides) -> model_config.LlamaConfig:
    """The architecture of ``model.preset=name`` for the family (its ``preset`` or the default)."""
    family = model_family(model_type)
    make = getattr(family, "preset", None) or model_config.preset
    return make(name, **overrides)


def flops_per_token(model_type: str, config: model_config.LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token of the family's model (its ``flops_per_token`` or the default)."""
    family = model_family(model_type)
    count = getattr(family, "flops_per_token", None)
    return float(count(config, seq_len) if count is not None else model_config.flops_per_token(config, seq_len))


def check_hf_checkpoints(model_type: str, key: str) -> None:
    """UserError unless the family converts Hugging Face checkpoints (``key`` names what asked)."""
    if not getattr(model_family(model_type), "hf_checkpoints", False):
        raise UserError(f"{key}: model.type={model_type!r} has no Hugging Face conversion "
                        f"(only {', '.join(n for n in _FAMILIES if getattr(_FAMILIES[n], 'hf_checkpoints', False))})")
