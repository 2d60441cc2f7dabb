"""Downstream evaluation: log-likelihood multiple choice as lm-evaluation-harness scores it.

    from lp_jax.evaluation import LoglikelihoodScorer, evaluate, load_from_hf_dir
    loaded = load_from_hf_dir("path/to/hf")            # BF16 by default
    scorer = LoglikelihoodScorer(loaded.model, loaded.tokenizer, max_length=loaded.max_length)
    results = evaluate(scorer, ["hellaswag", "mmlu"], shots=0, limit=100)

docs/evaluation.md describes the tasks, prompt formats and metrics.
"""

from typing import TYPE_CHECKING

from lp_jax.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "lp_jax.evaluation.documents": ("Doc",),
    "lp_jax.evaluation.loading": ("LoadedModel", "load_from_hf_dir", "load_from_run_dir"),
    "lp_jax.evaluation.runner": ("evaluate", "evaluate_task"),
    "lp_jax.evaluation.scorer": ("LoglikelihoodScorer",),
    "lp_jax.evaluation.tasks": ("TASKS", "load_task"),
}, globals())

if TYPE_CHECKING:
    from lp_jax.evaluation.documents import Doc
    from lp_jax.evaluation.loading import LoadedModel, load_from_hf_dir, load_from_run_dir
    from lp_jax.evaluation.runner import evaluate, evaluate_task
    from lp_jax.evaluation.scorer import LoglikelihoodScorer
    from lp_jax.evaluation.tasks import TASKS, load_task
