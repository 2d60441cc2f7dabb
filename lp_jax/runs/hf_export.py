"""A training run's checkpoint -> a Hugging Face folder (``python -m lp_jax.export``).

The folder holds what `LlamaForCausalLM.from_pretrained` (`Qwen3MoeForCausalLM`'s for
model.type=moe) and `AutoTokenizer` read:
config.json (with the tokenizer's BOS/EOS ids), the safetensors weights and the run's
tokenizer files (``lp_jax.data.tokenizers``). The weights are the checkpoint's FP32
masters, cast to `dtype` if asked; the optimizer state is never read, and the recipe the
run trained in changes nothing (it quantizes GEMM operands, never the stored weights).

The folder is written whole (``models.files``): into ``.<name>.partial-<host>-<pid>`` beside
it, then swapped in for the old one, so an earlier export's files never outlive it and a
failed write (a full disk) leaves the old export as it was. Every export holds
``lp_jax_export.json`` (the source, step and dtype), the marker by which a later export
knows the folder as one it may replace; a folder that holds other files is refused before
the checkpoint is read.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from lp_jax import model_registry
from lp_jax.config.schema import MOCK_SOURCES
from lp_jax.data.tokenizers import get_tokenizer, write_tokenizer_files
from lp_jax.errors import UserError, one_line
from lp_jax.runs.run_folder import SavedRun, open_and_restore
from models.files import check_output, written_whole
from models.hf import check_exportable, save_hf
from models.hf_config import HFError


def export_run(source: str, hf_dir: str, *, step: int | None = None, dtype=None,
               max_shard_size="5GB", say: Callable[[str], Any] = print) -> SavedRun:
    """Writes the run's checkpoint at `step` (default: the newest that restores) to `hf_dir`."""
    check_output(hf_dir, "hf_dir", replaces_exports=True)
    saved, model = open_and_restore(source, step)
    model_registry.check_hf_checkpoints(saved.config.model.type, source)
    try:
        check_exportable(model)
    except HFError as e:
        raise UserError(f"{source}: {e}") from None
    data = saved.config.data
    tokenizer = None if data.source in MOCK_SOURCES else data.tokenizer  # mock tokens have none
    if tokenizer is not None:
        _check_tokenizer(source, tokenizer)
    dt = "float32" if dtype is None else str(dtype)
    marker = {"written_by": "python -m lp_jax.export", "source": os.path.abspath(source),
              "step": saved.step, "dtype": dt}
    with written_whole(hf_dir, "hf_dir", marker=marker) as folder:
        token_ids = {}
        if tokenizer is not None:
            token_ids = write_tokenizer_files(tokenizer, folder, saved.model_config.max_seq_len)
        save_hf(model, folder, dtype=dtype, max_shard_size=max_shard_size, extra_config=token_ids)
    shipped = "no tokenizer (mock data)" if tokenizer is None else f"tokenizer {tokenizer!r}"
    say(f"exported {source} step {saved.step} -> {hf_dir}: FP32 master weights as {dt}, "
        f"{shipped}; the run trained in {saved.recipe}, which quantizes GEMM inputs on "
        "the fly, never the stored weights, so the export does not depend on it")
    return saved


def _check_tokenizer(source: str, name: str) -> None:
    """The run's tokenizer must be readable before the folder is written: what fails while
    writing it is then the folder's fault (a full disk), reported as such."""
    try:
        get_tokenizer(name)
    except (ValueError, ImportError, OSError) as e:
        raise UserError(f"{source}: cannot read the run's tokenizer {name!r}: {one_line(e)}") from None
