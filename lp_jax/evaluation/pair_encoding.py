"""Turns (context, continuation) strings into model inputs as lm-evaluation-harness does
(its `_encode_pair` and `_loglikelihood_tokens`).

``PairEncoder(tokenizer, max_length)(context, continuation)`` is a TokenizedRequest: the
input `(context + continuation)[-(max_length + 1):][:-1]`, and the continuation's tokens
(those of `encode(context + continuation)` after the context's, the context's trailing
whitespace moved to the continuation, both with the tokenizer's BOS first where it has one)
as the targets of the input's last positions. docs/evaluation.md, "Scoring", has each rule
and the one departure from the harness.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class ScoringTokenizer(Protocol):
    """What evaluation needs of a tokenizer (the training tokenizers satisfy it)."""

    bos_id: int | None

    def encode(self, text: str) -> list[int]:  # without any special token
        ...


@dataclasses.dataclass(frozen=True)
class TokenizedRequest:
    input_ids: tuple[int, ...]  # what the model reads
    continuation_ids: tuple[int, ...]  # targets of the last len(continuation_ids) positions


class PairEncoder:
    """Encodes (context, continuation) pairs; caches context encodings (shared by choices)."""

    def __init__(self, tokenizer: ScoringTokenizer, max_length: int):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._cache: dict[str, list[int]] = {}
        self.truncated_continuations = 0  # continuations longer than max_length (see below)

    def _encode(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_id
        return ([bos] if bos is not None else []) + list(self.tokenizer.encode(text))

    def _encode_context(self, context: str) -> list[int]:
        # A document's choices share its context: encode it once. The cache holds only
        # the latest contexts, enough for consecutive choices of the same document.
        ids = self._cache.get(context)
        if ids is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            ids = self._cache[context] = self._encode(context)
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if context == "":
            # The harness conditions an empty context on a prefix token (BOS).
            if self.tokenizer.bos_id is None:
                raise ValueError("an empty context needs a tokenizer with a BOS token")
            return [self.tokenizer.bos_id], list(self.tokenizer.encode(continuation))
        stripped = context.rstrip()
        if len(stripped) < len(context):
            continuation = context[len(stripped):] + continuation
            context = stripped
        context_ids = self._encode_context(context)
        whole_ids = self._encode(context + continuation)
        return context_ids, whole_ids[len(context_ids):]

    def __call__(self, context: str, continuation: str) -> TokenizedRequest:
        context_ids, continuation_ids = self.encode_pair(context, continuation)
        if not context_ids or not continuation_ids:
            raise ValueError(
                f"empty tokenization for context {context[-40:]!r} / continuation "
                f"{continuation[:40]!r}: nothing to score")
        full = (context_ids + continuation_ids)[-(self.max_length + 1):]
        if len(continuation_ids) > self.max_length:
            # The harness stops here (an assertion). A small-context model (the tiny byte
            # model: 256 tokens) meets a few HellaSwag endings this long; rather than give up
            # on the task, such a continuation is scored on its last max_length tokens, each
            # predicted from the tokens really before it, and counted.
            continuation_ids = continuation_ids[-self.max_length:]
            self.truncated_continuations += 1
        return TokenizedRequest(tuple(full[:-1]), tuple(continuation_ids))
