"""MMLU (57 subjects) in lm-evaluation-harness's `mmlu` task format.

Prompt (the harness's default MMLU template), per subject:

    The following are multiple choice questions (with answers) about <subject words>.\\n\\n
    [5-shot: the subject's first K dev questions, each answered " A".." D", then "\\n\\n"]
    <question stripped>\\nA. <a>\\nB. <b>\\nC. <c>\\nD. <d>\\nAnswer:      -> " A" | " B" | " C" | " D"

Scores are kept per subject (`mmlu_<subject>`) and aggregated, as the harness does, into
its four categories and into `mmlu`, each a size-weighted mean of its subjects.
"""

from __future__ import annotations

from lp_jax.evaluation.data_package import read_arrow_rows
from lp_jax.evaluation.documents import Doc, MultipleChoiceFormat, build_docs

# The harness's category of each subject (its `mmlu_<category>_tasks` tags).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "stem": (
        "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics",
        "computer_security", "conceptual_physics", "electrical_engineering",
        "elementary_mathematics", "high_school_biology", "high_school_chemistry",
        "high_school_computer_science", "high_school_mathematics", "high_school_physics",
        "high_school_statistics", "machine_learning",
    ),
    "other": (
        "business_ethics", "clinical_knowledge", "college_medicine", "global_facts",
        "human_aging", "management", "marketing", "medical_genetics", "miscellaneous",
        "nutrition", "professional_accounting", "professional_medicine", "virology",
    ),
    "social_sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies",
        "sociology", "us_foreign_policy",
    ),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history",
        "high_school_world_history", "international_law", "jurisprudence",
        "logical_fallacies", "moral_disputes", "moral_scenarios", "philosophy",
        "prehistory", "professional_law", "world_religions",
    ),
}
SUBJECTS: tuple[str, ...] = tuple(sorted(s for group in CATEGORIES.values() for s in group))
LETTERS = ["A", "B", "C", "D"]


def _question(row: dict) -> str:
    choices = row["choices"]
    options = "".join(f"\n{letter}. {text}" for letter, text in zip(LETTERS, choices))
    return f"{row['question'].strip()}{options}\nAnswer:"


def subject_format(subject: str) -> MultipleChoiceFormat:
    return MultipleChoiceFormat(
        doc_to_text=_question,
        doc_to_choice=lambda row: LETTERS,
        doc_to_gold=lambda row: int(row["answer"]),
        description=(
            "The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n"),
    )


def load_mmlu(shots: int = 0, limit: int | None = None) -> list[Doc]:
    """Test docs of all 57 subjects (the first `limit` of each, as the harness's --limit)."""
    docs: list[Doc] = []
    for subject in SUBJECTS:
        folder = f"hails/mmlu_no_train/{subject}"
        test_rows = read_arrow_rows(f"{folder}/test")
        dev_rows = read_arrow_rows(f"{folder}/dev") if shots else []
        docs += build_docs(f"mmlu_{subject}", test_rows, subject_format(subject),
                           shots=shots, limit=limit, fewshot_rows=dev_rows)
    return docs


def mmlu_groups() -> dict[str, list[str]]:
    """Group -> its leaf subtasks. As in the harness (0.4.x), a group pools the subjects
    under it directly: `mmlu` over all 57, not over the four category results."""
    groups = {"mmlu": [f"mmlu_{s}" for s in SUBJECTS]}
    groups.update({f"mmlu_{cat}": [f"mmlu_{s}" for s in subjects]
                   for cat, subjects in CATEGORIES.items()})
    return groups
