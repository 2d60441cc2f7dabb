"""Forward+backward of a Llama-like block stack per recipe, against peers, on this platform.

    python bench/bench_dot_general.py [--layers 4 --tokens 2048 --d 512 --ffn 1536 --repeats 5]
                                      [--mode both|linear|block] [--reference-backend]
                                      [--no-fp32] [--no-peers] [--tiny]

Two stacks: "linear" (the headline) has only the five linear layers, RMSNorm and SwiGLU
in each block, so every row differs from BF16 by its GEMMs and quantizers alone; "block"
adds the causal attention core, which costs the same in every row and dilutes the ratios.
Prints, per stack and variant: median step time and its ratio to our BF16 in the same run
(every variant compiled first, then timed in interleaved rounds, so load drift hits all rows),
the compiled step's temp memory, and the weight-gradient error against an FP32 run; then
the work each peer skips, and the bytes the backward keeps for one quantized linear layer,
as a ratio to BF16's.
Every layer is quantized (policy F0L0) so recipes are compared GEMM for GEMM. The recipes
run their GEMMs on the backend "auto" picks on this platform (docs/backends.md);
``--reference-backend`` adds MXFP8 and NVFP4 forced onto the reference backend (on Hopper
both are emulations: this shows which is faster). ``--no-fp32`` skips the FP32 run and the
error column (a GPU run at Llama 3 8B's width saves its compilation and memory).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lp_jax as lp  # noqa: E402
from bench import peers  # noqa: E402
from bench.common import interleaved_seconds, platform_line, print_table  # noqa: E402
from lp_jax import context  # noqa: E402
from lp_jax.gemm.backends import backend_on, current_platform  # noqa: E402
from models.layer_scope import layer_scope  # noqa: E402


class Block(nnx.Module):
    """Fused qkv, o, gate, up, down; RMSNorm; a causal attention core in bf16, or (heads 0,
    the linear-only stack) q + k + v in its place, so every qkv output still has a gradient."""

    def __init__(self, d, ffn, heads, rngs, dtype):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                      param_dtype=jnp.float32, rngs=rngs)
        self.qkv, self.o = lin(d, 3 * d), lin(d, d)
        self.gate, self.up, self.down = lin(d, ffn), lin(d, ffn), lin(ffn, d)
        self.norm1 = nnx.RMSNorm(d, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.heads = heads

    def __call__(self, x_BxLxD):
        b, n, d = x_BxLxD.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x_BxLxD)), 3, axis=-1)
        if self.heads:
            shape = (b, n, self.heads, d // self.heads)
            att = jax.nn.dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                                               is_causal=True)
        else:
            att = q + k + v
        x_BxLxD = x_BxLxD + self.o(att.reshape(b, n, d))
        h = self.norm2(x_BxLxD)
        return x_BxLxD + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Stack(nnx.Module):
    def __init__(self, layers, d, ffn, heads, seed=0, dtype=jnp.bfloat16):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([Block(d, ffn, heads, rngs, dtype) for _ in range(layers)])

    def __call__(self, x):
        for i, block in enumerate(self.layers):
            with layer_scope(i):
                x = block(x)
        return x


def loss_fn(model, x, target):
    return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)


def make_step(model, loss_scale=1.0):
    """The jitted value-and-grad step; a loss_scale multiplies the loss and divides the
    gradients (exact: a power of two), for a peer whose gradients underflow otherwise."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, x, target, key):
        def loss(state):
            with context.rng_scope(key):
                return loss_fn(nnx.merge(graphdef, state), x, target) * loss_scale
        value, grads = jax.value_and_grad(loss)(state)
        if loss_scale != 1.0:
            value, grads = jax.tree.map(lambda g: g / loss_scale, (value, grads))
        return value, grads

    return step, state


def grad_error(grads, ref):
    g = np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(grads)])
    r = np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(ref)])
    return np.linalg.norm(g - r) / np.linalg.norm(r)


def residual_bytes(recipe, m, k, n):
    """Bytes kept for the backward of one linear [m,k]x[k,n], sub-byte types at their width."""
    x = jnp.ones((m, k), jnp.bfloat16)
    w = jnp.ones((k, n), jnp.float32)
    f = lambda x, w: lp.dot_general(recipe)(x, w, (((1,), (0,)), ((), ())))  # noqa: E731
    _, vjp = jax.vjp(f, x, w)
    return sum(a.size * jnp.finfo(a.dtype).bits // 8 if jnp.issubdtype(a.dtype, jnp.floating)
               else a.nbytes for a in jax.tree.leaves(vjp))


def with_recipe(name, **overrides):
    """A setup that swaps every layer's Linears to recipe ``name`` (F0L0) in place."""
    def setup(model, x):
        lp.apply_recipe(model, lp.get_recipe(name, policy="F0L0", **overrides))
        return model
    return setup


def variants(args):
    """(name, setup, loss scale): setup(model, sample input) returns the model to time."""
    rows = [("bf16 (nnx default dot_general)", lambda m, x: m, 1.0)]
    # fp8_block last: a row that runs past the time budget is the one left out
    for name in ("bf16", "fp8_cs", "mxfp8", "nvfp4", "fp8_block"):
        rows.append((f"lp_jax {name}", with_recipe(name), 1.0))
    if args.reference_backend:
        for name in ("mxfp8", "nvfp4"):
            rows.append((f"lp_jax {name} (reference backend)", with_recipe(name, backend="reference"), 1.0))
    if not args.no_peers:
        rows += [(name, setup, peers.LOSS_SCALES.get(name, 1.0)) for name, setup in peers.peer_setups()]
    return rows


def time_stack(args, heads, x, target, key):
    """Table rows for every variant on one stack (heads 0: linear-only): all compiled
    first, then timed in interleaved rounds (bench/common.py: interleaved_seconds)."""
    dims = (args.layers, args.d, args.ffn, heads)
    ref_grads = None
    if not args.no_fp32:
        ref_step, ref_state = make_step(Stack(*dims, dtype=jnp.float32))
        _, ref_grads = ref_step(ref_state, x.astype(jnp.float32), target, key)
    rows, compiled_steps = [], {}
    for name, setup, loss_scale in variants(args):
        if args.budget_s is not None and time.perf_counter() - args.start > args.budget_s:
            rows.append((name, "skipped", "", "", f"time budget of {args.budget_s:.0f} s spent"))
            continue
        model = Stack(*dims)
        try:
            model = setup(model, x)
        except ImportError as e:  # a missing optional peer is reported, not fatal
            rows.append((name, "n/a", "", "", f"{type(e).__name__}: {e}"[:60]))
            continue
        print(f"... {name}", file=sys.stderr, flush=True)
        step, state = make_step(model, loss_scale)
        try:
            compiled = step.lower(state, x, target, key).compile()
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this model is reported
            rows.append((name, "failed", "", "", f"{type(e).__name__}: {e}"[:70]))
            continue
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        _, grads = compiled(state, x, target, key)
        compiled_steps[name] = compiled, (state, x, target, key)
        error = "" if ref_grads is None else f"{grad_error(grads, ref_grads):.4f}"
        rows.append((name, "", "", f"{temp:.0f}", error))
    timed = interleaved_seconds({n: c for n, (c, _) in compiled_steps.items()},
                                {n: a for n, (_, a) in compiled_steps.items()}, "lp_jax bf16", repeats=args.repeats)
    return [(r[0], f"{timed[r[0]][0] * 1e3:.0f}", f"{timed[r[0]][1]:.2f}", *r[3:]) if r[0] in timed else r
            for r in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8, help="attention heads of the block stack")
    ap.add_argument("--mode", choices=("both", "linear", "block"), default="both",
                    help="linear-only stack (headline), full blocks with attention, or both")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--reference-backend", action="store_true")
    ap.add_argument("--no-fp32", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new variant after this")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    args = ap.parse_args(argv)
    args.start = time.perf_counter()
    if args.tiny:  # a smoke run of every row: no time budget
        args.budget_s = None
        args.layers, args.tokens, args.d, args.ffn, args.heads, args.repeats = 1, 64, 64, 96, 2, 1
    x = jax.random.normal(jax.random.key(1), (1, args.tokens, args.d), jnp.bfloat16)
    target = jax.random.normal(jax.random.key(2), (1, args.tokens, args.d), jnp.float32)
    key = jax.random.key(3)
    stacks = [("linear", 0, "linear layers, RMSNorm and SwiGLU only (no attention core)"),
              ("block", args.heads, "full blocks (causal attention core in BF16)")]
    tables = [(title, time_stack(args, heads, x, target, key))
              for mode, heads, title in stacks if args.mode in ("both", mode)]
    print(platform_line())
    print("GEMM backends here: " + ", ".join(
        f"{r} {backend_on(lp.get_recipe(r), current_platform())}" for r in ("fp8_cs", "fp8_block", "mxfp8", "nvfp4")))
    for title, rows in tables:
        print_table(["variant", "step ms", "x lp_jax bf16", "temp MiB", "dW rel. err vs FP32"], rows,
                    title=f"{args.layers} blocks, {title}, {args.tokens} tokens, d {args.d}, FFN {args.ffn}: "
                          f"forward+backward, median of {args.repeats} interleaved rounds "
                          "(ratio: median over rounds of the round's ratio)")
    if not args.no_peers:
        print("\nWhat each peer does not do that lp_jax does:")
        for name, skips in peers.SKIPS.items():
            print(f"- {name}: {skips}")
    m, k, n = args.tokens, args.d, args.ffn
    b16 = residual_bytes(lp.get_recipe("bf16"), m, k, n)
    res_rows = []
    for name in ("bf16", "fp8_cs", "fp8_block", "mxfp8", "nvfp4"):
        b = residual_bytes(lp.get_recipe(name), m, k, n)
        res_rows.append((name, f"{b / 2**20:.2f}", f"{b / b16:.3f}"))
    print_table(["recipe", "residual MiB", "x bf16"], res_rows,
                title=f"bytes kept for the backward of one linear [{m}x{k}] x [{k}x{n}]")


if __name__ == "__main__":
    main()
