"""Data: TFDS builders on fixture files, JSONL/parquet records, grain, prompts, the arith task."""

import functools
import http.server
import os
import threading

import numpy as np
import pytest
import tensorflow_datasets as tfds
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gvpo_jax import data, rewards

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def gsm8k(tfds_dir):
    path = os.path.join(FIXTURES, "gsm8k")
    return {
        s: list(data.load_task("gsm8k", s, path=path, data_dir=tfds_dir)) for s in ("train", "test")
    }


@pytest.fixture(scope="module")
def math_lighteval(tfds_dir):
    path = os.path.join(FIXTURES, "math_lighteval")
    return {
        s: list(data.load_task("math", s, path=path, data_dir=tfds_dir)) for s in ("train", "test")
    }


@pytest.fixture(scope="module")
def math500(tfds_dir):
    path = os.path.join(FIXTURES, "math500")
    return list(data.load_task("math500", "test", path=path, data_dir=tfds_dir))


@pytest.fixture(scope="module")
def chat_tokenizer(gsm8k, math500):
    """A small byte-level BPE trained on the fixtures, with a ChatML chat template."""
    texts = [ex["prompt"] + ex["solution"] for ex in gsm8k["train"] + math500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = CHATML
    return hf


# ------------------------------------------------------------------------------- builders


def test_gsm8k_builder_reads_published_jsonl(gsm8k):
    assert [len(gsm8k["train"]), len(gsm8k["test"])] == [8, 4]
    by_id = {ex["id"]: ex for ex in gsm8k["train"]}
    first = by_id["gsm8k/train/0"]
    assert first["prompt"].startswith("Mia picks 14 apples")
    assert first["answer"] == "18" and first["dataset"] == "gsm8k"
    assert "<<" not in first["solution"] and first["solution"].endswith("$\\boxed{18}$.")
    assert by_id["gsm8k/train/3"]["answer"] == "1200"  # "1,200" in the text, "#### 1200"
    assert sorted(ex["answer"] for ex in gsm8k["test"]) == ["12", "3000", "420", "66"]


def test_the_trainer_imports_tensorflow_datasets_only_when_it_reads_gsm8k_or_math():
    """tensorflow_datasets takes ~0.3 s to import: a trainer process on the arithmetic task (or
    JSONL records) leaves it out, and the builders load it on first use."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gvpo_jax import data, main, train\n"
        "print('tensorflow_datasets' in sys.modules)\n"
        "print(data.GvpoGsm8k.__name__, 'tensorflow_datasets' in sys.modules)\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["False", "GvpoGsm8k True"], out.stdout


def test_gsm8k_parquet_mirror_gives_the_same_examples(gsm8k, tmp_path):
    src = data.load_gsm8k(
        "train", data_dir=str(tmp_path), source_dir=os.path.join(FIXTURES, "gsm8k_hf")
    )
    assert sorted(map(sorted_items, src)) == sorted(map(sorted_items, gsm8k["train"]))


def sorted_items(ex):
    return tuple(sorted(ex.items()))


def test_math_lighteval_builder_fields(math_lighteval):
    train = {ex["id"]: ex for ex in math_lighteval["train"]}
    assert len(train) == 8 and len(math_lighteval["test"]) == 4
    assert train["train/1"]["answer"] == "\\frac{3}{4}"
    assert train["train/1"]["subject"] == "Prealgebra" and train["train/1"]["level"] == 1
    assert train["train/2"]["answer"] == "[2,5) \\cup (5,\\infty)"
    test = {ex["prompt"]: ex for ex in math_lighteval["test"]}
    unknown = test["If $f(x) = 2x^2 - 3$, what is $f(-2)$?"]
    assert unknown["level"] == 0 and unknown["answer"] == "5"  # "Level ?"
    assert {ex["dataset"] for ex in math_lighteval["test"]} == {"math"}


def test_math_original_json_tree_matches_lighteval_parquet(math_lighteval, tmp_path):
    tree = os.path.join(FIXTURES, "math_hendrycks")
    for split in ("train", "test"):
        src = data.load_math(split, data_dir=str(tmp_path), source_dir=tree)
        key = lambda ex: (ex["prompt"], ex["answer"], ex["solution"], ex["level"], ex["subject"])
        assert sorted(map(key, src)) == sorted(map(key, math_lighteval[split]))
        assert all(ex["id"].startswith(f"{split}/") and ex["id"].endswith(".json") for ex in src)


def test_math500_builder_keeps_published_answer_and_ids(math500):
    assert len(math500) == 12
    by_id = {ex["id"]: ex for ex in math500}
    polar = by_id["test/precalculus/901.json"]
    assert polar["answer"] == "\\left( 4, \\frac{3 \\pi}{2} \\right)" and polar["level"] == 2
    assert by_id["test/prealgebra/907.json"]["answer"] == "3.14"
    assert {ex["dataset"] for ex in math500} == {"math500"}


def test_fixture_solutions_verify_against_their_gold_answers(gsm8k, math_lighteval, math500):
    examples = gsm8k["train"] + gsm8k["test"] + math_lighteval["train"]
    examples += math_lighteval["test"] + math500
    assert len(examples) == 36
    for i, ex in enumerate(examples):
        assert rewards.math_reward(ex["solution"], ex["answer"]) == 1.0, ex["id"]
        other = next(o for o in examples[i + 1 :] + examples if o["answer"] != ex["answer"])
        assert rewards.math_reward(ex["solution"], other["answer"]) == 0.0, ex["id"]


def test_prepared_dataset_loads_with_tfds_data_source_and_no_tensorflow(gsm8k, tfds_dir):
    src = tfds.data_source("gvpo_gsm8k", split="test", data_dir=tfds_dir)
    assert len(src) == 4
    record = src[0]
    assert set(record) == {"question", "answer", "final_answer", "id"}
    assert isinstance(record["question"], bytes)  # decoded by data.load_gsm8k
    assert os.path.isdir(os.path.join(tfds_dir, "gvpo_gsm8k", "1.0.0"))
    assert any(f.endswith(".array_record-00000-of-00001")
               for f in os.listdir(os.path.join(tfds_dir, "gvpo_gsm8k", "1.0.0")))  # fmt: skip


@pytest.fixture
def http_fixtures():
    handler = functools.partial(_QuietHandler, directory=FIXTURES)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_builders_download_when_files_are_missing(http_fixtures, tmp_path, math500):
    urls = {"test": f"{http_fixtures}/math500/test.jsonl"}
    src = data.load_math(
        "test", config="math500", data_dir=str(tmp_path), source_dir=None, urls=urls
    )
    assert sorted(map(sorted_items, src)) == sorted(map(sorted_items, math500))
    bad = {s: f"{http_fixtures}/missing/{s}.jsonl" for s in ("train", "test")}
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        data.load_gsm8k("train", data_dir=str(tmp_path / "b"), source_dir=str(tmp_path), urls=bad)


def test_same_named_files_of_both_datasets_in_one_folder_are_told_apart(tmp_path, monkeypatch):
    import shutil

    for name, src in [("gsm8k", "gsm8k_hf/main"), ("math", "math_lighteval/data")]:
        shutil.copytree(os.path.join(FIXTURES, src), tmp_path / "mixed" / name)
    mixed = str(tmp_path / "mixed")
    monkeypatch.setenv("GVPO_TFDS_DIR", str(tmp_path / "cache"))
    gsm = data.load_task("gsm8k", "test", path=mixed)  # default data_dir: keyed on the source
    math_ = data.load_task("math", "test", path=mixed)
    assert {ex["dataset"] for ex in gsm} == {"gsm8k"} and len(gsm) == 4
    assert {ex["dataset"] for ex in math_} == {"math"} and len(math_) == 4
    assert os.listdir(tmp_path / "cache") == [os.path.basename(data_dir_of(mixed))]


def data_dir_of(source_dir):
    from gvpo_jax.data import tfds_builders

    return tfds_builders.default_data_dir(source_dir)


def test_default_data_dir_changes_when_the_source_files_change(tmp_path, monkeypatch):
    monkeypatch.setenv("GVPO_TFDS_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    before = data_dir_of(str(src))
    assert before == data_dir_of(str(src)) and before.startswith(str(tmp_path / "cache"))
    (src / "train.jsonl").write_text('{"question": "q2", "answer": "#### 12"}\n')
    assert data_dir_of(str(src)) != before
    assert data_dir_of(None).endswith("download")


# ------------------------------------------------------------------------- plain records


def test_records_with_configurable_fields_from_jsonl_and_parquet(gsm8k):
    jsonl = data.load_records(
        os.path.join(FIXTURES, "gsm8k"), split="train", prompt_field="question"
    )
    parquet = data.load_records(
        os.path.join(FIXTURES, "gsm8k_hf", "main", "train-00000-of-00001.parquet"),
        prompt_field="question", dataset="mine",
    )  # fmt: skip
    assert len(jsonl) == len(parquet) == 8
    for a, b in zip(jsonl, parquet, strict=True):
        assert (a["prompt"], a["answer"], a["solution"]) == (
            b["prompt"],
            b["answer"],
            b["solution"],
        )
        assert "####" in a["solution"]  # the raw answer field is kept as the solution
    assert sorted(ex["answer"] for ex in jsonl) == sorted(ex["answer"] for ex in gsm8k["train"])
    assert parquet[0]["dataset"] == "mine" and jsonl[0]["dataset"] == "gsm8k"
    boxed = data.load_records(
        os.path.join(FIXTURES, "math500", "test.jsonl"), prompt_field="problem",
        answer_field="solution", solution_field="solution",
    )  # fmt: skip
    assert boxed[1]["answer"] == "\\frac{5}{6}"
    with pytest.raises(KeyError, match="question"):
        data.load_records(os.path.join(FIXTURES, "math500", "test.jsonl"), prompt_field="question")
    with pytest.raises(FileNotFoundError):
        data.load_records(FIXTURES, split="validation")
    with pytest.raises(ValueError, match="unknown task"):
        data.load_task("mmlu", "test")


# ---------------------------------------------------------------------------------- grain


def _take(it, n):
    return [[ex["id"] for ex in next(it)] for _ in range(n)]


def test_iterator_is_deterministic_by_seed_and_reshuffles_each_epoch():
    src = data.ArithTask(eval_size=20).train_source()
    small = [src[i] for i in range(12)]
    make = lambda seed: data.make_iterator(small, seed=seed, batch_size=4, shard_index=0,
                                           shard_count=1)  # fmt: skip
    a, b, c = _take(make(7), 6), _take(make(7), 6), _take(make(8), 6)
    assert a == b and a != c
    ids = sorted(ex["id"] for ex in small)
    epoch0, epoch1 = sum(a[:3], []), sum(a[3:], [])
    assert sorted(epoch0) == ids and sorted(epoch1) == ids and epoch0 != epoch1
    unshuffled = data.make_iterator(small, seed=0, batch_size=4, shard_index=0, shard_count=1,
                                    shuffle=False)  # fmt: skip
    assert sum(_take(unshuffled, 3), []) == [ex["id"] for ex in small]


def test_iterator_shards_are_disjoint_and_cover_an_epoch(gsm8k, tfds_dir):
    src = data.load_task("gsm8k", "train", path=os.path.join(FIXTURES, "gsm8k"), data_dir=tfds_dir)
    shards = [
        sum(
            _take(data.make_iterator(src, seed=3, batch_size=2, shard_index=i, shard_count=2), 2),
            [],
        )
        for i in range(2)
    ]
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(ex["id"] for ex in gsm8k["train"])
    # Finite epochs: every shard yields the same number of full batches.
    counts = [
        len(
            list(
                data.make_iterator(
                    list(range(23)),
                    seed=1,
                    batch_size=3,
                    shard_index=i,
                    shard_count=2,
                    num_epochs=2,
                )
            )
        )  # fmt: skip
        for i in range(2)
    ]
    assert counts == [7, 7]  # 46 elements -> 42 = 7 batches x 3 x 2 shards
    with pytest.raises(ValueError, match="shard_index"):
        data.make_iterator(src, seed=0, batch_size=2, shard_index=2, shard_count=2)


def test_iterator_state_restores_the_exact_position(tfds_dir):
    src = data.load_task("math", "train", path=os.path.join(FIXTURES, "math_lighteval"),
                         data_dir=tfds_dir)  # fmt: skip
    make = lambda: data.make_iterator(src, seed=11, batch_size=3, shard_index=0, shard_count=1)
    it = make()
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    resumed = make()
    resumed.set_state(state)
    assert _take(resumed, 4) == expected
    import json

    assert json.loads(json.dumps(state)) == state  # checkpointable as plain JSON


def test_default_shard_is_the_jax_process():
    it = data.make_iterator(list(range(5)), seed=0, batch_size=5)  # one process: the whole data
    assert sorted(next(it)) == list(range(5))


# -------------------------------------------------------------------------------- prompts


def test_prompts_through_chat_template_are_tokenised_once_and_checked(chat_tokenizer, math500):
    tok = chat_tokenizer
    ids, lens, kept, dropped = data.encode_prompts(
        tok, math500, template="boxed", max_prompt_len=10_000, use_chat_template=True
    )
    assert dropped == 0 and list(kept) == list(range(12)) and lens.dtype == np.int32
    text = tok.decode(ids[0])
    assert text.startswith("<|im_start|>user\n" + math500[0]["prompt"])
    assert text.endswith(data.BOXED_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n")
    for row, n, ex in zip(ids, lens, math500, strict=True):
        rendered, has_specials = data.render(tok, ex["prompt"], template="boxed",
                                             use_chat_template=True)  # fmt: skip
        assert has_specials and row == tok(rendered, add_special_tokens=False)["input_ids"]
        assert n == len(row)
    # The system-message template puts the instruction first.
    sys_ids, *_ = data.encode_prompts(
        tok, math500[:1], template="qwen_math", max_prompt_len=10_000, use_chat_template=True
    )
    assert tok.decode(sys_ids[0]).startswith("<|im_start|>system\n" + data.BOXED_INSTRUCTION)
    # Too long: dropped and counted, or an error that names the fix.
    limit = int(np.median(lens))
    ids2, lens2, kept2, dropped2 = data.encode_prompts(
        tok, math500, template="boxed", max_prompt_len=limit, use_chat_template=True
    )
    assert list(kept2) == [i for i in range(12) if lens[i] <= limit]
    assert dropped2 == 12 - len(kept2) > 0 and all(n <= limit for n in lens2)
    assert ids2 == [ids[i] for i in kept2]
    with pytest.raises(ValueError, match="max_prompt_len"):
        data.encode_prompts(tok, math500, template="boxed", max_prompt_len=limit,
                            use_chat_template=True, on_too_long="error")  # fmt: skip


def test_prompts_without_chat_template_use_plain_text(chat_tokenizer, gsm8k):
    ex = gsm8k["test"][:2]
    ids, *_ = data.encode_prompts(chat_tokenizer, ex, template="qa", max_prompt_len=10_000)
    assert chat_tokenizer.decode(ids[0]) == f"Question: {ex[0]['prompt']}\nAnswer:"
    char = data.build_char_tokenizer()  # no chat template: falls back to the plain text + <bos>
    ids, lens, _, _ = data.encode_prompts(
        char, [{"prompt": "12+7="}], max_prompt_len=8, use_chat_template=True
    )
    assert ids == [
        [data.char_tokenizer.BOS_ID] + char("12+7=", add_special_tokens=False)["input_ids"]
    ]
    with pytest.raises(ValueError, match="unknown prompt template"):
        data.encode_prompts(char, ex, template="nope", max_prompt_len=8)


def test_verl_template_is_the_official_recipes_prompt(chat_tokenizer, gsm8k, math500):
    """verl's math_dataset.py / gsm8k.py: the problem, one space, the dataset's instruction, as
    the only (user) message; the chat template's own system default is left to the tokenizer."""
    examples = [math500[0], gsm8k["test"][0]]
    ids, *_ = data.encode_prompts(
        chat_tokenizer, examples, template="verl", max_prompt_len=10_000, use_chat_template=True
    )
    math_text, gsm_text = (chat_tokenizer.decode(row) for row in ids)
    assert math_text == (
        f"<|im_start|>user\n{math500[0]['prompt']} Let's think step by step and output the "
        "final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert gsm_text == (
        f"<|im_start|>user\n{gsm8k['test'][0]['prompt']} Let's think step by step and output "
        'the final answer after "####".<|im_end|>\n<|im_start|>assistant\n'
    )


def test_encode_sft_appends_eos_and_drops_long_or_missing_demonstrations(chat_tokenizer, gsm8k):
    tok = chat_tokenizer
    examples = gsm8k["train"][:4] + [{"prompt": "no demo", "answer": "1", "solution": ""}]
    p_ids, r_ids, kept, dropped = data.encode_sft(
        tok, examples, template="boxed", max_prompt_len=10_000, max_response_len=10_000
    )
    assert list(kept) == [0, 1, 2, 3] and dropped == 1
    for r, ex in zip(r_ids, examples, strict=False):
        assert r[-1] == tok.eos_token_id and tok.decode(r[:-1]) == ex["solution"]
    short = min(len(r) for r in r_ids)
    _, r2, kept2, dropped2 = data.encode_sft(
        tok, examples, template="boxed", max_prompt_len=10_000, max_response_len=short
    )
    assert all(len(r) <= short for r in r2) and dropped2 == 5 - len(kept2)


def test_pad_batch():
    ids, mask = data.pad_batch([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 0, 0]])
    assert ids.dtype == np.int32 and data.pad_batch([[1]], pad_id=9, length=3)[0].tolist() == [
        [1, 9, 9]
    ]
    with pytest.raises(ValueError):
        data.pad_batch([[1, 2]], pad_id=0, length=1)


# ---------------------------------------------------------------- char tokenizer / arith


def test_char_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = data.build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(data.char_tokenizer.CHARS)
    text = "12 + 7=19"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(str(tmp_path))
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for s in ["12+7=", "99*9=891", "abc xyz?", "A#"]:
        assert loaded(s)["input_ids"] == tok(s)["input_ids"]
    assert loaded("A#", add_special_tokens=False)["input_ids"] == [3, 3]  # unknown -> <unk>
    char_ids = [4 + data.char_tokenizer.CHARS.index(c) for c in "1+1=2"]
    assert loaded.convert_tokens_to_ids(list("1+1=2")) == char_ids
    assert loaded.decode([1, *char_ids, 2], skip_special_tokens=True) == "1+1=2"
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0 and len(loaded) == len(tok)
    batch = loaded(["1+1=", "22+33="], padding=True)
    assert batch["input_ids"][0][-2:] == [0, 0] and batch["attention_mask"][0][-2:] == [0, 0]


def test_arith_eval_set_is_fixed_distinct_and_disjoint_from_training():
    task = data.ArithTask(max_operand=20, ops="+-", seed=0, eval_size=100)
    other_seed = data.ArithTask(max_operand=20, ops="+-", seed=5, eval_size=100)
    assert [e["id"] for e in task.eval_examples] == [e["id"] for e in other_seed.eval_examples]
    eval_ids = {e["id"] for e in task.eval_examples}
    assert len(eval_ids) == 100
    src = task.train_source()
    train = [src[i] for i in range(3000)]
    assert not eval_ids & {e["id"] for e in train}
    assert len({e["id"] for e in train}) > 300  # the stream covers most of the 472 left
    assert [src[i] for i in (5, 17)] == [task.train_example(5), task.train_example(17)]
    assert [other_seed.train_example(i) for i in range(20)] != train[:20]
    with pytest.raises(IndexError):
        src[len(src)]


@pytest.mark.parametrize("ops,max_operand,negative", [("+-", 20, False), ("+-*", 9, False),
                                                      ("-", 99, True)])  # fmt: skip
def test_arith_answers_are_correct_short_integers(ops, max_operand, negative):
    task = data.ArithTask(max_operand=max_operand, ops=ops, allow_negative=negative, eval_size=30)
    examples = [task.train_example(i) for i in range(300)] + task.eval_examples
    for ex in examples:
        a, op, b = _split(ex["prompt"])
        assert 0 <= a <= max_operand and 0 <= b <= max_operand and op in ops
        assert int(ex["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex["solution"] == ex["answer"] and ex["dataset"] == "arith"
        assert len(ex["answer"].lstrip("-")) <= 3
        assert rewards.REWARDS["exact_match"](ex["solution"], ex["answer"]) == 1.0
    assert negative == any(int(ex["answer"]) < 0 for ex in examples)


def _split(prompt: str):
    assert prompt.endswith("=")
    body = prompt[:-1]
    for i, ch in enumerate(body[1:], start=1):
        if ch in "+-*":
            return int(body[:i]), ch, int(body[i + 1 :])
    raise AssertionError(prompt)


def test_arith_settings_are_validated():
    assert data.ArithTask.from_digits(2).max_operand == 99
    assert data.ArithTask(max_operand=20, ops="+-").num_problems == 21 * 21 + 21 * 22 // 2
    with pytest.raises(ValueError, match="ops"):
        data.ArithTask(ops="+/")
    with pytest.raises(ValueError, match="eval_size"):
        data.ArithTask(max_operand=3, ops="+", eval_size=10)
    arith = data.load_task("arith", "test", arith=data.ArithTask(eval_size=7))
    assert len(arith) == 7
