import json

import pytest

from offpolicy.tasks import EXAMPLE_JSONL, ArithmeticTask, CountdownTask, JsonlTask, get_task
from offpolicy.tasks.base import Task


def _write(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_examples_and_meta(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "2+2=", "answer": "4", "level": 1}), "", json.dumps({"prompt": "q", "answer": 5})])
    task = JsonlTask(path)
    assert len(task) == 2 and task.name == "t" and isinstance(task, Task)
    ex = task.examples(5, seed=0)  # cycles: 5 > 2
    assert len(ex) == 5 and {e.prompt for e in ex} == {"2+2=", "q"}
    assert ex == task.examples(5, seed=0)
    first = next(e for e in ex if e.prompt == "2+2=")
    assert first.meta == {"level": 1} and first.answer == "4"
    assert next(e for e in ex if e.prompt == "q").answer == "5"  # numbers become strings


def test_default_and_custom_reward(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "p", "answer": "yes"})])
    assert JsonlTask(path).reward([" yes ", "no"], answer=["yes", "yes"]) == [1.0, 0.0]

    def length_reward(completions, *, answer, **kw):
        return [float(len(c)) for c in completions]

    assert get_task(str(path), reward_fn=length_reward).reward(["abc"], answer=["yes"]) == [3.0]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "answer": "b"}', '{"prompt": "a"}'], "line 2: missing key 'answer'"),
        (['{"answer": "b"}'], "line 1: missing key 'prompt'"),
        (['{"prompt": "a", "answer": "b"}', "", "{not json"], "line 3: invalid JSON"),
        (["[1, 2]"], "line 1: expected a JSON object"),
        (['{"prompt": ["a"], "answer": "b"}'], "line 1: 'prompt' must be a string"),
        ([""], "has no examples"),
    ],
)
def test_bad_files_name_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        JsonlTask(_write(tmp_path, lines))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        JsonlTask(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="does not exist"):
        get_task(str(tmp_path / "nope.jsonl"))


def test_get_task():
    assert isinstance(get_task("arithmetic"), ArithmeticTask)
    assert isinstance(get_task("countdown"), CountdownTask)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")
    with pytest.raises(ValueError, match="reward_fn"):
        get_task("arithmetic", reward_fn=lambda c, **k: [0.0] * len(c))


def test_shipped_example_file():
    task = get_task(EXAMPLE_JSONL)
    ex = task.examples(24, seed=0)
    # times-table lines: the reference answer is the product, and exact match gives it reward 1
    for e in ex:
        a, b = e.prompt.rstrip("=").split("*")
        assert int(e.answer) == int(a) * int(b) and e.meta == {"kind": "times-table"}
    assert task.reward([e.answer for e in ex], answer=[e.answer for e in ex]) == [1.0] * 24
