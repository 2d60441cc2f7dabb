"""The report's model line counts the parameters its family builds: a mixture of experts
counts every expert and the router, not the dense MLP its fields would give."""
import math

from flax import nnx
import jax

from lp_jax.model_registry import build_model
from lp_jax.study.report import _model_line
from models import moe
from models.config import count_params, preset


def test_the_moe_line_counts_every_expert_and_the_router():
    cfg = moe.preset("tiny")
    d, f, experts, layers = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts, cfg.num_layers
    dense = preset("tiny")
    # The dense tiny's count with its SwiGLU MLPs swapped for the experts' and a router's.
    expected = count_params(dense) + layers * (experts * 3 * d * f + d * experts - 3 * d * dense.intermediate_size)
    line = _model_line("moe", cfg)
    assert f"{experts} experts of width {f}, {cfg.moe_router_topk} per token" in line
    assert f"{expected / 1e6:.2f} M parameters" in line, line
    built = nnx.eval_shape(lambda: build_model("moe", cfg, nnx.Rngs(0)))
    assert expected == sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(built, nnx.Param)))


def test_the_dense_line_keeps_its_ffn_and_count():
    cfg = preset("tiny")
    line = _model_line("llama", cfg)
    assert f"FFN {cfg.intermediate_size}," in line and f"{count_params(cfg) / 1e6:.2f} M parameters" in line
