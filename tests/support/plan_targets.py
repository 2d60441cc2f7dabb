"""What the plan's compile tests share: the skip when JAX's CUDA plugin is absent, and the
tiny config they compile."""
import os

import pytest

from lp_jax.plan import environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
needs_plugin = pytest.mark.skipif(environment.plugin_problem() is not None,
                                  reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu]')")
