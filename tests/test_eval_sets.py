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


def test_money_and_inline_math_golds_stay_parseable(tmp_path):
    """MATH-500's '\\$18.90' keeps its escaped dollar (dropping the '$' left '\\18.90', which
    math-verify cannot parse, so every policy scored 0); '\\(1\\), \\(-1\\)' loses all four
    markers, not just the outer two."""
    _jsonl(str(tmp_path / "math500" / "test.jsonl"), [
        {"problem": "A book costs $\\$18.90$.", "solution": "$\\boxed{\\$18.90}$",
         "answer": "\\$18.90", "unique_id": "test/prealgebra/1.json"},
        {"problem": "Total?", "solution": "...", "answer": "$\\$32,\\!348$",
         "unique_id": "test/prealgebra/2.json"},
    ])  # fmt: skip
    ev = eval_sets.load_eval_set("math500", str(tmp_path / "math500"))
    money, total = (ex["answer"] for ex in ev.examples)
    assert rewards.math_reward("so \\boxed{18.90}", money) == 1.0
    assert rewards.math_reward("so \\boxed{\\$18.90}", money) == 1.0
    assert rewards.math_reward("so \\boxed{18.80}", money) == 0.0
    assert rewards.math_reward("so \\boxed{32348}", total) == 1.0
    assert (money, total) == ("\\$18.90", "\\$32,\\!348")
    _parquet(str(tmp_path / "olympiad" / "OE_TO_maths_en_COMP" / "x.parquet"), [
        {"id": 1, "question": "Price?", "final_answer": ["$\\$ 100$"],
         "question_type": "Open-ended"},
        {"id": 2, "question": "Roots?", "final_answer": ["\\(1\\), \\(-1\\)"],
         "question_type": "Open-ended"},
    ])  # fmt: skip
    price, roots = (ex["answer"] for ex in eval_sets.load_eval_set(
        "olympiad", str(tmp_path / "olympiad")).examples)  # fmt: skip
    assert rewards.math_reward("\\boxed{100}", price) == 1.0
    assert rewards.math_reward("\\boxed{-1, 1}", roots) == 1.0
    assert (price, roots) == ("\\$ 100", "1, -1")


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


# ----------------------------------------------------------------------------------------------
# The eval mode on a tiny model, resume, and the paired comparison


def eval_config(root, **changes):
    from gvpo_jax import config as config_lib

    c = config_lib.base_config()
    c.model.overrides.update(dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                  head_dim=16, intermediate_size=64))  # fmt: skip
    c.mode = "eval"
    c.data.max_prompt_len = 48
    c.rollout.max_new_tokens = 6
    c.rollout.prompts_per_step = 4
    c.algo.overlong_cache = 2
    c.train.reward_workers = 0  # the fixture golds are small; no worker pool in a unit test
    c.mesh.num_devices = 1
    c.eval.sets = "all"
    c.eval.dir = str(root)
    config_lib.set_fields(c, changes)
    config_lib.validate(c)
    return c


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, fixture_dirs):
    from gvpo_jax import train

    workdir = str(tmp_path_factory.mktemp("eval_run"))
    root = os.path.dirname(fixture_dirs["amc"])
    table = train.run(eval_config(root), workdir)
    return workdir, root, table


def test_eval_mode_writes_the_table_of_the_five_sets(eval_run):
    from gvpo_jax import eval as eval_lib

    workdir, root, table = eval_run
    rows = {r["set"]: r for r in table["rows"]}
    assert list(rows) == list(eval_sets.EVAL_SETS)
    assert {k: r["problems"] for k, r in rows.items()} == {
        "aime24": 3, "amc": 3, "math500": 2, "minerva": 2, "olympiad": 2}  # fmt: skip
    assert rows["olympiad"]["skipped"] == 1
    assert rows["aime24"]["n"] == 32 and rows["aime24"]["metric"] == "avg@32"  # the paper's
    assert all(r["n"] == 1 and r["metric"] == "greedy" for k, r in rows.items() if k != "aime24")
    assert table["policy"].startswith("random init") and table["commit"]
    for name in eval_sets.EVAL_SETS:
        record = json.load(open(os.path.join(workdir, "eval", f"{name}.json")))
        assert record["protocol"]["n"] == rows[name]["n"]
        assert len(record["outcomes"]) == rows[name]["problems"]
        o = record["outcomes"][0]
        assert len(o["lengths"]) == o["n"] and 0 <= o["correct"] <= o["n"]
        assert all(1 <= x <= 6 for x in o["lengths"]) and 0 <= o["truncated"] <= o["n"]
        problems = {ex["id"]: ex for ex in eval_sets.load_eval_set(name, f"{root}/{name}").examples}
        for o in record["outcomes"]:  # the digest compare checks pairs by: the text and the gold
            ex = problems[o["id"]]
            assert o["digest"] == eval_lib.problem_digest(ex["prompt"], ex["answer"])
    md = open(os.path.join(workdir, "eval", "table.md")).read()
    assert "| aime24 |" in md and "avg@32 at T=1" in md and "greedy pass@1" in md
    assert json.load(open(os.path.join(workdir, "eval", "table.json"))) == json.loads(
        json.dumps(table)
    )


def test_resumed_eval_skips_finished_sets_and_gives_the_same_table(eval_run, capsys):
    from gvpo_jax import train

    workdir, root, table = eval_run
    kept = {n: os.path.getmtime(os.path.join(workdir, "eval", f"{n}.json"))
            for n in eval_sets.EVAL_SETS if n != "amc"}  # fmt: skip
    os.remove(os.path.join(workdir, "eval", "amc.json"))  # as if killed during amc
    again = train.run(eval_config(root), workdir)
    out = capsys.readouterr().out
    assert out.count("finished before, kept") == 4 and "[eval] amc: greedy" in out
    assert again == json.loads(json.dumps(table))
    for n, mtime in kept.items():
        assert os.path.getmtime(os.path.join(workdir, "eval", f"{n}.json")) == mtime


def test_a_policy_compared_with_itself_is_zero_with_a_zero_width_interval(eval_run, capsys):
    from gvpo_jax import compare

    workdir = eval_run[0]
    result = compare.compare(workdir, workdir)
    assert result["all"]["problems"] == 12 and set(result["sets"]) == set(eval_sets.EVAL_SETS)
    for r in [*result["sets"].values(), result["all"]]:
        assert r["diff"] == r["lo"] == r["hi"] == 0.0
    assert compare.main([workdir, workdir]) == 0
    assert "| all | 12 |" in capsys.readouterr().out


def _outcome_file(path, correct, n=1, *, prompt="Find {i}.", set_name="amc", **changes):
    """Outcomes of problems `prompt.format(i=i)` (gold i), as `eval.problem_outcomes` writes them;
    `changes` replace fields of every record (None: drop the field)."""
    from gvpo_jax import eval as eval_lib

    outcomes = []
    for i, c in enumerate(correct):
        o = {"id": f"{set_name}/{i}", "set": set_name, "gold": str(i), "n": n, "correct": c,
             "greedy": int(c > 0), "lengths": [3] * n, "truncated": 0,
             "digest": eval_lib.problem_digest(prompt.format(i=i), str(i)), **changes}  # fmt: skip
        outcomes.append({k: v for k, v in o.items() if v is not None})
    with open(path, "w") as f:
        json.dump({"outcomes": outcomes}, f)
    return str(path)


def test_two_hand_made_outcome_files_give_the_hand_count(tmp_path, capsys):
    from gvpo_jax import compare

    # A right on problems 0-6, B on 0-2 and 7: B - A = (4 - 7) / 10; discordant 4 (A) vs 1 (B),
    # McNemar p = 2 * P(X <= 1 | 5, 1/2) = 2 * 6 / 32.
    a = _outcome_file(tmp_path / "a.json", [1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    b = _outcome_file(tmp_path / "b.json", [1, 1, 1, 0, 0, 0, 0, 1, 0, 0])
    r = compare.compare(a, b)["all"]
    assert (r["a"], r["b"], r["diff"]) == (0.7, 0.4, pytest.approx(-0.3))
    assert (r["a_higher"], r["b_higher"]) == (4, 1) and r["mcnemar_p"] == pytest.approx(0.375)
    assert r["lo"] < -0.3 < r["hi"] and r == compare.compare(a, b)["all"]  # fixed seed
    # Fractions of n = 4 samples: per-problem means, no McNemar.
    a4 = _outcome_file(tmp_path / "a4.json", [4, 2, 0], n=4)
    b4 = _outcome_file(tmp_path / "b4.json", [4, 3, 1], n=4)
    r4 = compare.compare(a4, b4)["all"]
    assert r4["diff"] == pytest.approx((0 + 0.25 + 0.25) / 3) and "mcnemar_p" not in r4
    assert compare.main([a, str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'missing'} does not exist")


def test_different_problems_under_the_same_ids_are_refused(tmp_path):
    """Two evaluations of different files with the same set name have the same ids (the row
    index): pairing them by id compared different problems. Pairs must be the same problem (the
    digest of text and gold; records without digests: the gold)."""
    from gvpo_jax import compare

    a = _outcome_file(tmp_path / "a.json", [1, 0, 1])
    same = _outcome_file(tmp_path / "same.json", [0, 0, 1])
    assert compare.compare(a, same)["all"]["problems"] == 3
    other = _outcome_file(tmp_path / "other.json", [0, 0, 1], prompt="Compute {i}.")
    with pytest.raises(compare.CompareError, match=r"hold different problems .*\(3 of 3, first"):
        compare.compare(a, other)
    old_a = _outcome_file(tmp_path / "old_a.json", [1, 0], digest=None)
    old_b = _outcome_file(tmp_path / "old_b.json", [1, 0], digest=None, gold="7")
    assert compare.compare(a, old_a)["all"]["problems"] == 2  # no digest on one side: the golds
    with pytest.raises(compare.CompareError, match="hold different problems"):
        compare.compare(old_a, old_b)


def test_bad_compare_input_exits_2_with_one_sentence(tmp_path):
    """Through the CLI, every kind of compare input: flags, paths, files, records, problems that
    differ. Each is one sentence naming the input, exit status 2, and no --json file written."""
    import subprocess
    import sys

    d = tmp_path
    a = _outcome_file(d / "a.json", [1, 0, 1])
    b = _outcome_file(d / "b.json", [0, 1, 1])
    (d / "bad.json").write_text("{not json")
    (d / "flat.json").write_text(json.dumps({"metrics": {}}))
    files = {
        "other": _outcome_file(d / "other.json", [1, 1, 1], prompt="Compute {i}."),
        "math": _outcome_file(d / "math.json", [1, 1, 1], set_name="math500"),
        "n0": _outcome_file(d / "n0.json", [0], n=0),
        "c5": _outcome_file(d / "c5.json", [5], n=4),
        "g2": _outcome_file(d / "g2.json", [1], greedy=2),
        "noid": _outcome_file(d / "noid.json", [1], id=None),
        "dup": _outcome_file(d / "dup.json", [1, 1], id="amc/0"),
    }
    with open(d / "notobj.json", "w") as f:
        json.dump({"outcomes": [3]}, f)
    os.makedirs(d / "run" / "eval_outcomes")
    _outcome_file(d / "run" / "eval_outcomes" / "step_000005.json", [1, 0, 1])
    out = d / "result.json"
    cases = [
        ([a, b, "--resamples=0"], "error: --resamples is 0; give at least 1"),
        ([a, b, "--resamples=-3"], "error: --resamples is -3; give at least 1"),
        ([a, b, "--resamples=x"], "error: argument --resamples: invalid int value: 'x'; see"),
        ([a, b, "--level=1.5"], "error: --level is 1.5; give the interval's confidence between"),
        ([a, b, "--level=nan"], "error: --level is nan; give the interval's confidence between"),
        ([a, b, "--metric=best"], "error: argument --metric: invalid choice: 'best'"),
        ([a, b, "--seed=-1"], "error: --seed is -1; give a whole number >= 0."),
        ([a, b, "--bogus"], "error: unrecognized arguments: --bogus; see"),
        ([a], "error: the following arguments are required: b; see"),
        ([a, b, f"--json={d / 'nowhere' / 'r.json'}"], f"error: --json {d / 'nowhere' / 'r.json'}"),
        ([a, str(d / "missing")], f"error: {d / 'missing'} does not exist; give a workdir"),
        ([a, str(d / "bad.json")], f"error: {d / 'bad.json'} is not valid JSON (Expecting"),
        ([a, str(d / "flat.json")], f"error: {d / 'flat.json'} holds no 'outcomes' list;"),
        ([a, str(d / "notobj.json")], f"error: {d / 'notobj.json'} outcome 1 is 3, not a JSON"),
        ([a, files["noid"]], f"error: {files['noid']} outcome 1 has no id;"),
        ([a, files["n0"]], f"error: {files['n0']} outcome 1 has n 0; n counts samples"),
        ([a, files["c5"]], f"error: {files['c5']} outcome 1 has correct 5 of n 4;"),
        ([a, files["g2"]], f"error: {files['g2']} outcome 1 has greedy 2; it is a verdict"),
        ([a, files["dup"]], f"error: {files['dup']} outcome 2 repeats id 'amc/0' of set 'amc';"),
        ([a, files["other"]], f"error: {a} and {files['other']} hold different problems under "
                              "the same set and id (3 of 3, first: set 'amc' id 'amc/0');"),
        ([a, files["math"]], f"error: {a} (sets amc) and {files['math']} (sets math500) share "
                             "no problem"),
        ([a, b, "--step_a=5"], f"error: --step_a picks a training-time evaluation in a workdir, "
                               f"and {a} is a file;"),
        ([a, str(d / "run"), "--step_b=7"], f"error: {d / 'run'} holds no evaluation outcomes "
                                            "at step 7;"),
    ]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [
        subprocess.Popen([sys.executable, "-m", "gvpo_jax.compare", f"--json={out}", *args],
                         cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args, _ in cases
    ]  # fmt: skip
    for proc, (args, sentence) in zip(procs, cases, strict=True):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (args, err[-3000:])
        assert err.startswith(sentence) and err.count("\n") == 1, (args, err)
        assert err.rstrip().endswith("."), (args, err)
    assert not out.exists()
    ok = subprocess.run([sys.executable, "-m", "gvpo_jax.compare", a, b, "--level=0.9",
                         f"--json={out}"], cwd=repo, capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and "90% interval" in ok.stdout, ok.stderr
    assert json.loads(out.read_text())["level"] == 0.9


def test_training_time_evaluations_keep_outcomes(eval_run, tmp_path, fixture_dirs):
    """mode=eval without sets (the task's held-out set) writes eval_outcomes/, which compare
    reads from a workdir."""
    from gvpo_jax import compare, train

    root = os.path.dirname(fixture_dirs["amc"])
    c = eval_config(root, **{"eval.sets": "", "data.eval_size": 8, "data.max_prompt_len": 8})
    train.run(c, str(tmp_path))
    files = os.listdir(tmp_path / "eval_outcomes")
    assert files == ["step_000000_eval.json"]
    record = json.load(open(tmp_path / "eval_outcomes" / files[0]))
    assert len(record["outcomes"]) == 8 and record["outcomes"][0]["set"] == "arith"
    assert compare.compare(str(tmp_path), str(tmp_path))["all"]["diff"] == 0.0


def test_bad_eval_input_exits_2_with_one_sentence(tmp_path):
    """Through the CLI: an unknown set and a missing folder fail at config validation, a file off
    its layout when the set is read; each is one sentence naming the input, exit status 2."""
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    _jsonl(str(bad), [{"question": "q", "answer": "1"}, {"question": "q", "solution_text": "x"}])
    cases = [
        (["--config.eval.sets=aime24,aime25"],
         "error: config.eval.sets is 'aime24,aime25': unknown evaluation set 'aime25'; use one "
         "of aime24, amc, math500, minerva, olympiad; or 'all'."),
        (["--config.eval.sets=amc", f"--config.eval.dir={tmp_path / 'none'}"],
         f"error: the amc set's files '{tmp_path / 'none' / 'amc'}' (config.eval.dir) do not "
         "exist;"),
        (["--config.eval.sets=minerva", f"--config.eval.paths=minerva={bad}"],
         f"error: {bad} line 2 has no field 'answer' (its fields are question, solution_text);"),
    ]  # fmt: skip
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gvpo_jax.main",
                "--config=configs/arith_tiny.py",
                "--config.mode=eval",
                f"--workdir={tmp_path / f'w{i}'}",
                *args,
            ],
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i, (args, _) in enumerate(cases)
    ]
    for proc, (args, sentence) in zip(procs, cases, strict=True):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (args, err[-3000:])
        assert err.strip().startswith(sentence) and "\n" not in err.strip(), (args, err)
