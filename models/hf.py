"""Hugging Face Llama and Qwen3-MoE folders <-> the NNX Llama and MoE (models.moe), and <->
a plain Orbax checkpoint of their state.

    model = load_hf("path/to/Llama-3.2-1B", dtype=jnp.bfloat16)   # logits computed in dtype
    save_hf(model, "out/")                                         # config.json + safetensors

A `qwen3_moe` folder (Qwen3MoeForCausalLM) loads as models.moe.Qwen3MoE, whose call returns
(logits, extras); its experts' weights are converted by models.hf_experts.

A folder is `config.json` (transformers 4.x or 5.x style) plus `model.safetensors` or a sharded
`model.safetensors.index.json`. Tensors are read and written with `safetensors` only (never
pickle). Command line (docs/models.md):

    python -m models.hf import HF_DIR CKPT_DIR      # HF folder -> Orbax checkpoint of the state
    python -m models.hf export CKPT_DIR HF_DIR [--dtype bfloat16] [--max-shard-size 5GB]
"""
from __future__ import annotations

import json
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from flax.nnx import traversals
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.config import COMPUTE_DTYPES, LlamaConfig, config_from_dict, config_to_dict
from models.files import file_mode, read_json_object
from models.fused_projections import fuse_flat, separate_flat
from models.hf_config import (ARCHITECTURES, IGNORED_TENSOR_SUFFIXES, HFError, config_from_hf,
                              config_to_hf, tensor_map)
from models.hf_experts import expert_shape, is_expert_path, join_experts, split_experts
from models.llama import Llama
from models.moe import Qwen3MoE
from models.orbax_quiet import SaveThreadErrorsHushed, failed_writes_hushed

__all__ = ["HFError", "load_hf", "save_hf", "read_hf_config", "check_tensors", "read_params",
           "model_class", "check_exportable", "save_state_checkpoint", "load_state_checkpoint"]

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# safetensors dtype codes this converter reads and writes; anything else (F8, I8, F64, ...)
# is refused rather than silently rounded.
_READABLE = {"F32": np.float32, "BF16": jnp.bfloat16, "F16": np.float16}


def model_class(cfg: LlamaConfig) -> type:
    """The model a converted config builds: the MoE family's with experts, else the Llama."""
    return Qwen3MoE if cfg.num_experts else Llama


def _architecture(cfg: LlamaConfig) -> str:
    return ARCHITECTURES["qwen3_moe" if cfg.num_experts else "llama"]


def _check_dtype(dtype, what: str):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise HFError(f"{what} {dtype!r} is not a dtype; allowed: {', '.join(COMPUTE_DTYPES)}") from None
    if dt.name not in COMPUTE_DTYPES:
        raise HFError(f"{what} {dt.name} cannot be represented; allowed: {', '.join(COMPUTE_DTYPES)}")
    return dt


def read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise HFError(f"missing file {config_path}")
    return read_json_object(config_path)


def _safe_open(file: str):
    """safe_open, with a file that is not whole safetensors (a download cut short) as one
    HFError line: safetensors checks the header and the data length when it opens."""
    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise HFError(f"{file} is not a readable safetensors file (truncated?): {e}") from None


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        with _safe_open(single) as f:
            return {name: single for name in f.keys()}
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFError(f"{index} has no weight_map of tensor names to file names")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise HFError(f"missing file {os.path.join(path, shard)} (listed in {INDEX_FILE})")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    raise HFError(f"missing file {single} (nor a sharded {INDEX_FILE}); only safetensors are read")


def check_tensors(path: str, cfg: LlamaConfig) -> dict[str, str]:
    """Checks a folder's tensor names, dtypes and shapes against cfg from the safetensors
    headers alone (no tensor is read); returns HF name -> file for every expected tensor."""
    files = _weight_files(path)
    expected = {name: (p, t) for name, p, t in tensor_map(cfg)}
    unexpected = [n for n in files if n not in expected and not n.endswith(IGNORED_TENSOR_SUFFIXES)
                  and not (cfg.tie_embeddings and n == "lm_head.weight")]  # tied: HF ignores it too
    if unexpected:
        raise HFError(f"unexpected tensor {unexpected[0]} in {path} (not a weight of a "
                      f"{_architecture(cfg)} with this config.json; {len(unexpected)} in all)")
    missing = [n for n in expected if n not in files]
    if missing:
        raise HFError(f"missing tensor {missing[0]} in {path} ({len(missing)} missing in all)")
    shapes = _hf_shapes(cfg)
    for file, names in _by_file(files, expected).items():
        with _safe_open(file) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:  # the index's weight_map points at the wrong shard
                    raise HFError(f"{INDEX_FILE} maps tensor {name} to {os.path.basename(file)}, "
                                  f"which does not hold it{_found_in(path, name, file)}")
                sl = f.get_slice(name)
                code, shape = sl.get_dtype(), tuple(sl.get_shape())
                if code not in _READABLE:
                    raise HFError(f"tensor {name} has dtype {code}, which cannot be represented "
                                  f"here; supported: {', '.join(_READABLE)}")
                if shape != shapes[name]:
                    raise HFError(f"tensor {name} has shape {shape} but config.json implies {shapes[name]}")
    return {name: files[name] for name in expected}


def _by_file(files: dict[str, str], names) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def _read_tensors(path: str, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Reads every expected tensor, checking presence, dtype and shape against cfg."""
    files = check_tensors(path, cfg)
    out = {}
    for file, names in _by_file(files, files).items():
        with _safe_open(file) as f:
            for name in names:
                out[name] = f.get_tensor(name)
                _refuse_non_finite(name, out[name], file)
    return out


def _refuse_non_finite(name: str, tensor: np.ndarray, file: str) -> None:
    """A NaN or inf weight would train (or be saved into a checkpoint) as NaN everywhere
    it reaches: refused, naming the tensor, before any model is built from it."""
    finite = np.isfinite(tensor)  # in the file's dtype (BF16 too): no FP32 copy of each tensor
    if not finite.all():
        bad = tensor.size - int(np.count_nonzero(finite))
        raise HFError(f"tensor {name} in {file} holds {bad} NaN or infinite value(s) of "
                      f"{tensor.size}; a model is never built from non-finite weights")


def _found_in(path: str, name: str, listed: str) -> str:
    """Where else in the folder tensor ``name`` is (for the wrong-shard message)."""
    for file in sorted(os.listdir(path)):
        full = os.path.join(path, file)
        if file.endswith(".safetensors") and full != listed:
            try:
                with safe_open(full, framework="numpy") as f:
                    if name in f.keys():
                        return f" (it is in {file})"
            except SafetensorError:
                continue
    return ""


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    # Hugging Face keeps q/k/v, gate/up and the experts apart: the shapes are those of the
    # separate layout.
    separate = cfg.replace(fused_projections=False)
    abstract = nnx.eval_shape(lambda: model_class(separate)(separate, rngs=nnx.Rngs(0)))
    flat = {p: tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(abstract))}
    shapes = {}
    for name, p, transpose in tensor_map(cfg):
        shape = expert_shape(p, cfg) if is_expert_path(p) else flat[p]
        shapes[name] = tuple(reversed(shape)) if transpose else shape
    return shapes


def param_arrays(cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> dict[tuple, np.ndarray]:
    """HF tensors as host arrays keyed by our parameter paths ([in, out] kernels), in
    cfg.param_dtype; the trainer places these on its mesh without a copy on one device.
    Experts are stacked into the MoE's grouped kernels (models.hf_experts); with
    cfg.fused_projections, q/k/v and gate/up are joined in Megatron's layout."""
    out = {}
    for name, p, transpose in tensor_map(cfg):
        array = tensors[name].T if transpose else tensors[name]
        out[p] = array.astype(cfg.param_dtype)
    out = join_experts(out, cfg)
    return fuse_flat(out, cfg) if cfg.fused_projections else out


def read_params(path: str, cfg: LlamaConfig) -> dict[tuple, np.ndarray]:
    """An HF folder's weights, checked against cfg, as param_arrays."""
    return param_arrays(cfg, _read_tensors(path, cfg))


def model_from_tensors(cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> Llama:
    """Builds the model directly from HF tensors (no random init of the full model)."""
    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = {p: jnp.asarray(a) for p, a in param_arrays(cfg, tensors).items()}
    nnx.replace_by_pure_dict(state, traversals.unflatten_mapping(flat))
    return nnx.merge(graphdef, state)


def load_hf(path: str, dtype=jnp.bfloat16, *, param_dtype=jnp.float32,
            fused_projections: bool = False) -> Llama:
    """The model of an HF Llama or Qwen3-MoE folder (models.llama.Llama or models.moe.Qwen3MoE);
    its call computes in `dtype`, its parameters are kept in `param_dtype` (float32 master
    weights by default; BF16 or F16 files widen exactly); `fused_projections` joins q/k/v
    (and a Llama's gate/up: models.fused_projections)."""
    dtype, param_dtype = _check_dtype(dtype, "dtype"), _check_dtype(param_dtype, "param_dtype")
    cfg = config_from_hf(read_hf_config(path), dtype=dtype, param_dtype=param_dtype)
    cfg = cfg.replace(fused_projections=fused_projections)
    return model_from_tensors(cfg, _read_tensors(path, cfg))


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*", str(size))
    if not m:
        raise HFError(f"bad shard size {size!r}; write e.g. 5GB, 500MB or a byte count")
    unit = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20,
            "GiB": 2**30}[m.group(2) or "B"]
    return int(float(m.group(1)) * unit)


def hf_tensors(model: Llama, dtype=None) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named numpy arrays in `dtype` (default: param_dtype)."""
    cfg = exported_config(model)
    dt = _check_dtype(cfg.param_dtype if dtype is None else dtype, "export dtype")
    check_exportable(model)
    flat = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    flat = split_experts(flat, cfg)  # before the fused projections: the MoE's gate_up stays whole
    if cfg.fused_projections:
        flat = separate_flat(flat, cfg)
    out = {}
    for name, p, transpose in tensor_map(cfg):
        src = flat[p]
        src = src.T if transpose else src
        with np.errstate(over="ignore"):  # overflow is detected just below, with a clear error
            array = np.ascontiguousarray(src).astype(dt)
        if not np.array_equal(np.isfinite(array), np.isfinite(src)):
            raise HFError(f"tensor {name} has values that {dt.name} cannot represent (overflow); "
                          f"export in float32 or bfloat16")
        out[name] = array
    return out


def exported_config(model) -> LlamaConfig:
    """The model's config as exported: a dense Llama's with no experts, whatever its
    num_experts says (model.type=llama builds the dense MLP and ignores the field)."""
    cfg = model.config
    return cfg if isinstance(model, Qwen3MoE) else cfg.replace(num_experts=0)


def check_exportable(model) -> None:
    """HFError (one line) for a model that no Hugging Face architecture here describes (an
    MoE without QK-norm, a Llama with it)."""
    config_to_hf(exported_config(model), "float32")


def save_hf(model: Llama, path: str, *, dtype=None, max_shard_size="5GB",
            extra_config: dict | None = None) -> None:
    """Writes config.json and model.safetensors (or shards plus model.safetensors.index.json
    when larger than max_shard_size) so that transformers' LlamaForCausalLM (a Qwen3MoE:
    Qwen3MoeForCausalLM) loads the folder. `extra_config` keys (bos/eos token ids, ...) are
    added to config.json."""
    tensors = hf_tensors(model, dtype)
    dt_name = next(iter(tensors.values())).dtype.name
    os.makedirs(path, exist_ok=True)
    for stale in [SINGLE_FILE, INDEX_FILE] + [f for f in os.listdir(path)
                                             if re.fullmatch(r"model-\d+-of-\d+\.safetensors", f)]:
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))  # a folder must not hold two weight layouts
    limit = _parse_size(max_shard_size)
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    if len(shards) == 1:
        _save_safetensors(shards[0], os.path.join(path, SINGLE_FILE))
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _save_safetensors(shard, os.path.join(path, fname))
            weight_map.update({name: fname for name in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": weight_map}
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    config = {**(extra_config or {}), **config_to_hf(exported_config(model), dt_name)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _save_safetensors(tensors: dict[str, np.ndarray], file: str) -> None:
    """save_file, with the mode of the folder's other files: it writes through a private
    temporary file, whose mode 0600 the weights would keep."""
    save_file(tensors, file, metadata={"format": "pt"})  # transformers needs the format
    os.chmod(file, file_mode())


# ---- plain Orbax checkpoints of the model state (the CLI's other side) ----

def save_state_checkpoint(model: Llama, ckpt_dir: str, *, hf_config: dict | None = None) -> None:
    ckpt_dir = os.path.abspath(ckpt_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    # A failed write (a full disk) reaches the caller as one exception; Orbax's threads
    # would each log it with its traceback, and its abandoned writes report themselves.
    with SaveThreadErrorsHushed(), failed_writes_hushed(), ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(ckpt_dir, "state"), nnx.state(model))
    with open(os.path.join(ckpt_dir, "llama_config.json"), "w") as f:
        json.dump(config_to_dict(model.config), f, indent=2)
    if hf_config is not None:
        with open(os.path.join(ckpt_dir, "hf_config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)


def load_state_checkpoint(ckpt_dir: str, cfg: LlamaConfig | None = None) -> Llama:
    """Restores a model from save_state_checkpoint's folder (or a bare StandardCheckpointer
    folder of nnx.state(model) when `cfg` is given)."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    state_dir = os.path.join(ckpt_dir, "state")
    if cfg is None:
        config_path = os.path.join(ckpt_dir, "llama_config.json")
        if not os.path.isfile(config_path):
            raise HFError(f"missing file {config_path} (pass a preset for a bare state checkpoint; "
                          "a training run exports with python -m lp_jax.export RUN_DIR HF_DIR)")
        saved = read_json_object(config_path)
        try:
            cfg = config_from_dict(saved)
        except (TypeError, ValueError) as e:
            raise HFError(f"{config_path} does not describe a model: {' '.join(str(e).split())}") from None
    if not os.path.isdir(state_dir):
        state_dir = ckpt_dir
    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, rngs=nnx.Rngs(0)))
    graphdef, target = nnx.split(abstract)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            state = ckptr.restore(state_dir, target)
    except (FileNotFoundError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = first if len(first) <= 200 else first[:200] + "..."  # Orbax lists every key
        raise HFError(f"cannot restore {state_dir} as this model's state: {first}") from None
    return nnx.merge(graphdef, state)


if __name__ == "__main__":
    from models.hf_cli import main
    sys.exit(main())
