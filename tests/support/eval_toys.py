"""Toy tokenizers and models with known log-likelihoods, for the evaluation tests."""

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB = 260


class ByteTokenizer:
    bos_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))


class WordTokenizer:
    """Whitespace joins the following word (" A" is one token), as BPE vocabularies do."""

    bos_id = None

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(p, len(self.vocab))
                for p in re.findall(r"\s*\S+|\s+", text)]


TABLE = np.random.default_rng(0).normal(size=(VOCAB, VOCAB)).astype(np.float32) * 3


def bigram_logits(tokens_BxL):
    """Logits depend on the current token only: log p(next | prev) = log_softmax(TABLE[prev])."""
    return jnp.asarray(TABLE)[tokens_BxL]


def reference_loglikelihood(context, continuation, max_length=10_000):
    stripped = context.rstrip()  # the harness scores the context's trailing space too
    context, continuation = stripped, context[len(stripped):] + continuation
    ids = [256] + list(context.encode())
    whole = [256] + list((context + continuation).encode())
    cont = whole[len(ids):]
    full = whole[-(max_length + 1):]
    logp = TABLE - np.log(np.exp(TABLE).sum(-1, keepdims=True))
    pairs = list(zip(full[:-1], full[1:]))[-len(cont):]
    return float(sum(logp[a, b] for a, b in pairs))


class BigramModel(nnx.Module):
    def __init__(self):
        self.table = nnx.Param(jnp.asarray(TABLE))

    def __call__(self, tokens_BxL):
        return self.table[...][tokens_BxL].astype(jnp.bfloat16)


def write_byte_level_tokenizer(path, *, with_bos=True, vocab_size=320):
    """A small byte-level BPE tokenizer.json (GPT-2/Llama 3 style), trained on a few
    sentences; with_bos adds Llama 3's post-processor that prepends <|begin_of_text|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["Question: what is the answer?\nAnswer: the answer is here.",
            "The following are multiple choice questions (with answers) about anatomy."] * 20
    tok.train_from_iterator(text, trainer)
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    tok.save(str(path))
    return tok
