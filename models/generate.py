"""Greedy / temperature sampling with a KV cache, to see what a model writes.

    from models.generate import generate
    tokens_BxN = generate(model, prompt_BxP, max_new_tokens=32, temperature=0.8, seed=0)

Command line, on a Hugging Face folder (its tokenizer.json, when present, encodes the prompt):

    python -m models.generate PATH --prompt "The capital of France is" --max-new-tokens 20
    python -m models.generate PATH --ids 128000,791,6864 --temperature 0.7

The whole loop (prefill, then one token per scan step) is one compiled function, so it is
compiled once per (model graph, prompt shape, max_new_tokens, sampling settings).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models.hf import HFError, load_hf


def sample_token(logits_BxV, key, temperature: float, top_k: int | None):
    """argmax when temperature == 0, else a draw from softmax(logits / temperature), optionally
    restricted to the top_k most likely tokens."""
    logits = logits_BxV.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth_BxOne = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_BxOne, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6))
def _generate(graphdef, state, prompt_BxP, max_new_tokens, temperature, top_k, eos_id, key):
    model = nnx.merge(graphdef, state)
    b, p = prompt_BxP.shape
    cache = model.init_cache(b, p + max_new_tokens)
    logits, cache = model.decode(prompt_BxP, cache, jnp.int32(0))
    key, sub = jax.random.split(key)
    first_B = sample_token(logits[:, -1], sub, temperature, top_k)
    done_B = jnp.zeros((b,), bool) if eos_id is None else first_B == eos_id

    def step(carry, _):
        token_B, cache, index, key, done_B = carry
        logits, cache = model.decode(token_B[:, None], cache, index)
        key, sub = jax.random.split(key)
        nxt_B = sample_token(logits[:, -1], sub, temperature, top_k)
        if eos_id is not None:  # a finished row keeps emitting eos
            nxt_B = jnp.where(done_B, eos_id, nxt_B)
            done_B = done_B | (nxt_B == eos_id)
        return (nxt_B, cache, index + 1, key, done_B), nxt_B

    _, rest_NxB = jax.lax.scan(step, (first_B, cache, jnp.int32(p), key, done_B), None,
                               length=max_new_tokens - 1)
    return jnp.concatenate([prompt_BxP, first_B[:, None], rest_NxB.T], axis=1)


def generate(model, prompt_BxP, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, seed: int = 0):
    """Returns int32 [B, P + max_new_tokens]: the prompt followed by the new tokens. All rows
    share one prompt length (no padding). After eos_id a row repeats eos_id."""
    prompt_BxP = jnp.asarray(prompt_BxP, jnp.int32)
    if prompt_BxP.ndim == 1:
        prompt_BxP = prompt_BxP[None]
    if prompt_BxP.ndim != 2 or prompt_BxP.shape[1] == 0:
        raise ValueError(f"prompt must be int [batch, length>0], got shape {prompt_BxP.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    vocab = model.config.vocab_size
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt_BxP, int(max_new_tokens), float(temperature),
                     top_k, eos_id, jax.random.key(seed))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    ap.add_argument("path", help="Hugging Face Llama folder (config.json + safetensors)")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="text, encoded with PATH/tokenizer.json")
    group.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 | float32")
    args = ap.parse_args(argv)
    tokenizer = None
    try:
        if args.prompt is not None:
            tok_path = os.path.join(args.path, "tokenizer.json")
            if not os.path.isfile(tok_path):
                raise HFError(f"--prompt needs {tok_path} (or pass --ids)")
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(tok_path)
            ids = tokenizer.encode(args.prompt).ids
        else:
            ids = [int(t) for t in args.ids.split(",")]
        model = load_hf(args.path, dtype=args.dtype)
        out = generate(model, jnp.asarray([ids]), args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except (HFError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    new = [int(t) for t in out[0, len(ids):]]
    print(tokenizer.decode(new) if tokenizer is not None else ",".join(map(str, new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
