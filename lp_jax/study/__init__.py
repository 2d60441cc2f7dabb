"""The precision study: the same training in BF16, FP8-CS, MXFP8 and NVFP4 (and the
NVFP4 ablations), then loss curves with the gap to BF16, downstream accuracy, throughput
and memory per component, in one report folder.

    python -m lp_jax.study --config configs/study_tiny.yaml --precisions bf16,fp8_cs,mxfp8,nvfp4
    from lp_jax.study import StudyOptions, run_study

docs/study.md describes the report and how each number is measured.
"""
from typing import TYPE_CHECKING

from lp_jax.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "lp_jax.study.study": ("DEFAULT_PRECISIONS", "StudyOptions", "run_study"),
}, globals())

if TYPE_CHECKING:
    from lp_jax.study.study import DEFAULT_PRECISIONS, StudyOptions, run_study
