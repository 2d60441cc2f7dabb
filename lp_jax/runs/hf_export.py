"""A training run's checkpoint -> a Hugging Face Llama folder (``python -m lp_jax.export``).

The folder holds what `LlamaForCausalLM.from_pretrained` and `AutoTokenizer` read:
config.json (with the tokenizer's BOS/EOS ids), the safetensors weights and the run's
tokenizer files (``lp_jax.data.tokenizers``). The weights are the checkpoint's FP32
masters, cast to `dtype` if asked; the optimizer state is never read, and the recipe the
run trained in changes nothing (it quantizes GEMM operands, never the stored weights).
"""
from __future__ import annotations

from typing import Any, Callable

from lp_jax.data.tokenizers import write_tokenizer_files
from lp_jax.errors import UserError
from lp_jax.runs.run_folder import SavedRun, open_and_restore
from models.hf import save_hf


def export_run(source: str, hf_dir: str, *, step: int | None = None, dtype=None,
               max_shard_size="5GB", say: Callable[[str], Any] = print) -> SavedRun:
    """Writes the run's checkpoint at `step` (default: the newest that restores) to `hf_dir`."""
    saved, model = open_and_restore(source, step)
    data = saved.config.data
    token_ids = {}
    if data.source != "mock":  # mock tokens have no tokenizer to ship
        try:
            token_ids = write_tokenizer_files(data.tokenizer, hf_dir, saved.model_config.max_seq_len)
        except (ValueError, ImportError, OSError) as e:
            raise UserError(f"{source}: cannot write the run's tokenizer "
                            f"{data.tokenizer!r}: {' '.join(str(e).split())}") from None
    save_hf(model, hf_dir, dtype=dtype, max_shard_size=max_shard_size, extra_config=token_ids)
    dt = "float32" if dtype is None else str(dtype)
    tokenizer = "no tokenizer (mock data)" if data.source == "mock" else f"tokenizer {data.tokenizer!r}"
    say(f"exported {source} step {saved.step} -> {hf_dir}: FP32 master weights as {dt}, "
        f"{tokenizer}; the run trained in {saved.recipe}, which quantizes GEMM inputs on "
        "the fly, never the stored weights, so the export does not depend on it")
    return saved
