"""The five evaluation sets of the GVPO paper: readers on fixtures the tests write in the published
layouts (awkward cases included), the eval mode over all five on a tiny model, resume, the paired
comparison of two policies, and bad input (one sentence, exit 2)."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gvpo_jax import rewards
from gvpo_jax.data import eval_sets


def _parquet(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_fixtures(root) -> dict[str, str]:
    """A few items of each set in a published layout; returns {set: directory}."""
    root = str(root)
    # HuggingFaceH4/aime_2024: answer is a string; '025' has a leading zero.
    _parquet(f"{root}/aime24/data/train-00000-of-00001.parquet", [
        {"id": 60, "problem": "Find 20+5.", "solution": "It is $\\boxed{025}$.", "answer": "025",
         "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1",
         "year": "2024"},
        {"id": 61, "problem": "Find 7*3.", "solution": "$\\boxed{21}$", "answer": "21",
         "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_II_Problems/Problem_2",
         "year": "2024"},
        {"id": 62, "problem": "Find 1+1.", "solution": "$\\boxed{2}$", "answer": "002",
         "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_II_Problems/Problem_3",
         "year": "2024"},
    ])  # fmt: skip
    # AI-MO/aimo-validation-amc: answer is a float64 (27.0; 0.75 is a fraction).
    _parquet(f"{root}/amc/data/train-00000-of-00001.parquet", [
        {"id": 0, "problem": "Find 3^3.", "answer": 27.0, "url": "u0"},
        {"id": 1, "problem": "Find 3/4.", "answer": 0.75, "url": "u1"},
        {"id": 2, "problem": "Find 9-4.", "answer": 5.0, "url": "u2"},
    ])  # fmt: skip
    # HuggingFaceH4/MATH-500: test.jsonl.
    _jsonl(f"{root}/math500/test.jsonl", [
        {"problem": "Find 2+2.", "solution": "$\\boxed{4}$", "answer": "4",
         "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
        {"problem": "Simplify 2/4.", "solution": "$\\boxed{\\frac{1}{2}}$",
         "answer": "\\frac{1}{2}", "subject": "Algebra", "level": 2,
         "unique_id": "test/algebra/2.json"},
    ])  # fmt: skip
    # math-ai/minervamath: question / answer, an answer with units.
    _jsonl(f"{root}/minerva/test.jsonl", [
        {"question": "A rod is 1.3 mm long. In metres?",
         "answer": "1.3 \\times 10^{-3} \\mathrm{~m}"},
        {"question": "Mass of 4.5 kg?", "answer": "4.5"},
    ])  # fmt: skip
    # Hothan/OlympiadBench: one parquet per subset; final_answer is a list.
    oe = f"{root}/olympiad/OE_TO_maths_en_COMP/OE_TO_maths_en_COMP-00000-of-00001.parquet"
    _parquet(oe, [
        {"id": 1606, "question": "Find 6*7.", "solution": ["$42$"], "final_answer": ["$42$"],
         "context": None, "is_multiple_answer": False, "unit": None, "answer_type": "Numerical",
         "question_type": "Open-ended", "subfield": "Algebra", "language": "English"},
        {"id": 1607, "question": "Find all x with x^2=1.", "solution": ["..."],
         "final_answer": ["$1$, $-1$"], "context": None, "is_multiple_answer": True, "unit": None,
         "answer_type": "Numerical", "question_type": "Open-ended", "subfield": "Algebra",
         "language": "English"},
        {"id": 1608, "question": "Two answers in two entries.", "solution": ["..."],
         "final_answer": ["$1$", "$2$"], "context": None, "is_multiple_answer": True,
         "unit": None, "answer_type": "Numerical", "question_type": "Open-ended",
         "subfield": "Algebra", "language": "English"},
    ])  # fmt: skip
    _parquet(f"{root}/olympiad/TP_TO_maths_en_COMP/TP_TO_maths_en_COMP-00000-of-00001.parquet", [
        {"id": 1, "question": "Prove that 1 < 2.", "solution": ["..."], "final_answer": None,
         "context": None, "is_multiple_answer": False, "unit": None, "answer_type": None,
         "question_type": "Theorem proof", "subfield": "Algebra", "language": "English"},
    ])  # fmt: skip
    return {name: os.path.join(root, name) for name in eval_sets.EVAL_SETS}


@pytest.fixture(scope="module")
def fixture_dirs(tmp_path_factory):
    return write_fixtures(tmp_path_factory.mktemp("eval_sets"))


def test_aime_answers_lose_leading_zeros(fixture_dirs):
    ev = eval_sets.load_eval_set("aime24", fixture_dirs["aime24"])
    assert [ex["answer"] for ex in ev.examples] == ["25", "21", "2"]
    assert [ex["id"] for ex in ev.examples] == ["aime24/60", "aime24/61", "aime24/62"]
    assert ev.skipped == {} and ev.examples[0]["dataset"] == "aime24"
    assert rewards.math_reward("so \\boxed{25}", ev.examples[0]["answer"]) == 1.0


def test_aime_other_layouts_and_years(tmp_path):
    # Maxwell-Jia/AIME_2024: capitalised fields, integer answers.
    _parquet(str(tmp_path / "mj" / "aime_2024_problems.parquet"), [
        {"ID": "2024-I-1", "Problem": "p", "Solution": "s", "Answer": 33},
        {"ID": "2024-II-4", "Problem": "q", "Solution": "s", "Answer": 7},
    ])  # fmt: skip
    ev = eval_sets.load_eval_set("aime24", str(tmp_path / "mj"))
    assert [(ex["id"], ex["answer"]) for ex in ev.examples] == [
        ("aime24/2024-I-1", "33"), ("aime24/2024-II-4", "7")]  # fmt: skip
    # AI-MO/aimo-validation-aime holds 2022-2024: only 2024 is kept, the rest counted.
    url = "https://artofproblemsolving.com/wiki/index.php/{}_AIME_I_Problems/Problem_1"
    _parquet(str(tmp_path / "aimo" / "data" / "train-00000-of-00001.parquet"), [
        {"id": i, "problem": "p", "solution": "s", "answer": "010", "url": url.format(y)}
        for i, y in enumerate((2022, 2023, 2024, 2024))
    ])  # fmt: skip
    ev = eval_sets.load_eval_set("aime24", str(tmp_path / "aimo"))
    assert len(ev.examples) == 2 and ev.skipped == {"other years": 2}
    assert ev.examples[0]["answer"] == "10"


def test_amc_float_answers(fixture_dirs):
    ev = eval_sets.load_eval_set("amc", fixture_dirs["amc"])
    assert [ex["answer"] for ex in ev.examples] == ["27", "\\frac{3}{4}", "5"]
    assert rewards.math_reward("\\boxed{0.75}", ev.examples[1]["answer"]) == 1.0
    assert rewards.math_reward("\\boxed{27}", ev.examples[0]["answer"]) == 1.0


def test_math500_and_minerva_units(fixture_dirs):
    ev = eval_sets.load_eval_set("math500", fixture_dirs["math500"])
    assert [ex["answer"] for ex in ev.examples] == ["4", "\\frac{1}{2}"]
    assert ev.examples[1]["id"] == "math500/test/algebra/2.json" and ev.examples[1]["level"] == 2
    ev = eval_sets.load_eval_set("minerva", fixture_dirs["minerva"])
    gold = ev.examples[0]["answer"]
    assert gold == "1.3 \\times 10^{-3} \\mathrm{~m}" and ev.examples[0]["id"] == "minerva/0"
    assert rewards.math_reward("\\boxed{1.3 \\times 10^{-3}}", gold) == 1.0
    assert rewards.math_reward("\\boxed{1.3 \\times 10^{-2}}", gold) == 0.0


def test_minerva_answer_from_the_solution(tmp_path):
    # Qwen2.5-Math's evaluation copy: problem / solution, the answer is the last \boxed{}.
    _jsonl(
        str(tmp_path / "minerva_math" / "test.jsonl"),
        [{"problem": "p", "solution": "so $\\boxed{7 \\text{ s}}$", "type": "t", "idx": 3}],
    )
    ev = eval_sets.load_eval_set("minerva", str(tmp_path / "minerva_math"))
    assert ev.examples[0]["answer"] == "7 \\text{ s}" and ev.examples[0]["id"] == "minerva/3"


def test_olympiad_multi_answer_kept_proofs_and_lists_skipped(fixture_dirs):
    ev = eval_sets.load_eval_set("olympiad", fixture_dirs["olympiad"])
    # The OE_TO_maths_en_COMP subset only: the proof file beside it is not read.
    assert [ex["answer"] for ex in ev.examples] == ["42", "1, -1"]
    assert ev.skipped == {"no single final answer": 1}
    assert rewards.math_reward("\\boxed{-1, 1}", ev.examples[1]["answer"]) == 1.0
    assert rewards.math_reward("\\boxed{1}", ev.examples[1]["answer"]) == 0.0
    proofs = eval_sets.load_eval_set(
        "olympiad", os.path.join(fixture_dirs["olympiad"], "OE_TO_maths_en_COMP")
    )
    assert len(proofs.examples) == 2
    with pytest.raises(eval_sets.EvalSetError, match="no usable olympiad problem.*proof 1"):
        eval_sets.load_eval_set(
            "olympiad", os.path.join(fixture_dirs["olympiad"], "TP_TO_maths_en_COMP")
        )


def test_bad_input_names_the_file_and_line(tmp_path, fixture_dirs):
    with pytest.raises(eval_sets.EvalSetError, match="unknown evaluation set 'aime25'"):
        eval_sets.load_eval_set("aime25", fixture_dirs["aime24"])
    missing = str(tmp_path / "nowhere")
    with pytest.raises(eval_sets.EvalSetError, match=f"^{missing} does not exist"):
        eval_sets.load_eval_set("amc", missing)
    bad = str(tmp_path / "bad" / "test.jsonl")
    _jsonl(bad, [{"question": "q", "answer": "1"}, {"question": "q", "solution_text": "x"}])
    with pytest.raises(eval_sets.EvalSetError) as e:
        eval_sets.load_eval_set("minerva", bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad} line 2 has no field 'answer'") and msg.count(".") >= 1
    assert "docs/data.md" in msg and "\n" not in msg
    with open(bad, "a") as f:
        f.write("{not json\n")
    with pytest.raises(eval_sets.EvalSetError, match=f"{bad} line 3 is not valid JSON"):
        eval_sets.load_eval_set("minerva", bad)
    _parquet(str(tmp_path / "p" / "x.parquet"), [{"Problem": "p", "Solution": "s"}])
    with pytest.raises(eval_sets.EvalSetError, match=r"x.parquet record 1 has no field 'answer'"):
        eval_sets.load_eval_set("aime24", str(tmp_path / "p"))


def test_paths_and_sets_parse():
    assert eval_sets.parse_sets("aime24, amc") == ["aime24", "amc"]
    assert eval_sets.parse_sets("all") == list(eval_sets.EVAL_SETS)
    with pytest.raises(ValueError, match="unknown evaluation set 'gsm8k'"):
        eval_sets.parse_sets("amc,gsm8k")
    assert eval_sets.parse_paths("amc=/a/b, minerva=gs://x/y") == {
        "amc": "/a/b", "minerva": "gs://x/y"}  # fmt: skip
    with pytest.raises(ValueError):
        eval_sets.parse_paths("amc:/a")
    assert eval_sets.number_text(-0.5) == "-\\frac{1}{2}" and eval_sets.number_text("7.00") == "7"
