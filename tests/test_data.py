"""Tests for tlt_jax.data: TFDS builders (array_record, no TensorFlow), prompts, iterator."""

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from etils import epath

from tlt_jax.data import arithmetic, gsm8k, pipeline

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
REPO_ROOT = Path(__file__).resolve().parents[1]
_QUESTION = re.compile(r"^(?:What is|Compute|Evaluate|Calculate) (.+?)[?.]$")


def _evaluate(expression: str) -> int:
    """Evaluates + - * over integer literals with Python's own parser (independent of the
    builder's tree and renderer)."""
    operators = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__}

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise AssertionError(f"unexpected syntax {ast.dump(node)} in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def _expression(question: str) -> str:
    match = _QUESTION.match(question)
    assert match, question
    return match.group(1)


def _arithmetic(tmp_path: Path, split: str, level: str = "mixed", **sizes: int) -> list[dict]:
    config = arithmetic.make_config(level, **sizes)
    return pipeline.load_split("arithmetic", split, data_dir=tmp_path, config=config)


# Arithmetic builder.


def test_arithmetic_is_deterministic_and_answers_are_exact(tmp_path):
    sizes = {"num_train": 600, "num_test": 60}
    first = _arithmetic(tmp_path / "a", "train", **sizes)
    second = _arithmetic(tmp_path / "b", "train", **sizes)
    assert first == second
    assert len(first) == 600
    operand_counts = {1: {2}, 2: {3}, 3: {4, 5}}
    for example in first:
        expression = _expression(example["question"])
        assert example["answer"] == str(_evaluate(expression)), example
        num_operands = len(re.findall(r"\d+", expression))
        assert num_operands in operand_counts[example["level"]], example
    assert {example["level"] for example in first} == {1, 2, 3}
    assert any("(" in example["question"] for example in first)
    assert any(example["answer"].startswith("-") for example in first)


def test_arithmetic_seed_changes_problems(tmp_path):
    default = arithmetic.generate_split((2,), 50, 0, "test", frozenset())[0]
    other_seed = arithmetic.generate_split((2,), 50, 1, "test", frozenset())[0]
    assert default == arithmetic.generate_split((2,), 50, 0, "test", frozenset())[0]
    assert default != other_seed


def test_arithmetic_test_split_is_disjoint_from_train(tmp_path):
    for level in ("level1", "level3"):
        train = _arithmetic(tmp_path, "train", level, num_train=3000, num_test=300)
        test = _arithmetic(tmp_path, "test", level, num_train=3000, num_test=300)
        train_expressions = [_expression(example["question"]) for example in train]
        test_expressions = [_expression(example["question"]) for example in test]
        assert len(set(train_expressions)) == len(train) == 3000
        assert len(set(test_expressions)) == len(test) == 300
        assert not set(train_expressions) & set(test_expressions)


def test_arithmetic_level0_is_small_and_held_out():
    test, test_expressions = arithmetic.generate_split((0,), 200, 0, "test", frozenset())
    train, _ = arithmetic.generate_split((0,), 600, 0, "train", test_expressions)
    for example in test + train:
        expression = _expression(example["question"])
        assert example["answer"] == str(_evaluate(expression)) and example["level"] == 0
        assert all(0 <= int(n) <= 20 for n in re.findall(r"\d+", expression))
    assert not test_expressions & {_expression(e["question"]) for e in train}
    # 21 * 21 operand pairs and two operators: 882 distinct problems, no more.
    with pytest.raises(ValueError, match="could only draw 882 distinct problems"):
        arithmetic.generate_split((0,), 900, 0, "test", frozenset())
    # A split far past that stops once draws find nothing new (it drew 401,000 times for
    # 20,000), naming the flags.
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"could only draw 682 distinct problems for the "
                       r"train split .* lower --config\.data\.num_train or pick a larger "
                       r"--config\.data\.level"):  # fmt: skip
        arithmetic.generate_split((0,), 20_000, 0, "train", test_expressions)
    assert time.perf_counter() - start < 15


def test_arithmetic_exclusion_removes_given_expressions():
    examples, expressions = arithmetic.generate_split((1,), 40, 0, "train", frozenset())
    banned = frozenset(_expression(example["question"]) for example in examples[:10])
    redrawn, redrawn_expressions = arithmetic.generate_split((1,), 40, 0, "train", banned)
    assert not banned & redrawn_expressions
    # Same stream, so the examples after the banned ones come out unchanged and in order.
    assert redrawn[:30] == examples[10:]
    assert len(expressions) == 40


def test_arithmetic_config_validation():
    with pytest.raises(ValueError, match="level='level9'.*level1"):
        arithmetic.make_config("level9")
    with pytest.raises(ValueError, match="num_test=0"):
        arithmetic.make_config("level1", num_test=0)
    assert arithmetic.make_config("level2") is arithmetic.make_config("level2")


def test_registered_builder_reads_through_tfds_data_source_without_tensorflow(tmp_path):
    # In a fresh interpreter: build the standard 20,000-example config and read it with
    # tfds.data_source by its registered name; TensorFlow must never be imported (the check
    # holds whether or not it is installed, and the project does not install it).
    script = textwrap.dedent(
        f"""
        import sys
        import tensorflow_datasets as tfds
        from tlt_jax.data import arithmetic
        source = tfds.data_source(
            "arithmetic/level1", split="test", data_dir={str(tmp_path)!r},
            builder_kwargs={{"file_format": "array_record"}},
        )
        answer = source[0]["answer"].decode()
        assert "tensorflow" not in sys.modules, "TensorFlow was imported"
        print(len(source), answer)
        """
    )
    # TFDS leaves an empty mkdtemp("tfds") folder per first build (`pipeline._tfds_scratch`).
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    count, answer = result.stdout.split()[-2:]
    assert count == "500"
    loaded = pipeline.load_split("arithmetic", "test", data_dir=tmp_path, config="level1")
    assert loaded[0]["answer"] == answer


def test_processes_sharing_a_data_dir_build_it_once_without_racing(tmp_path):
    # N processes of one run on one host (launch_local.py) load the same split into the same
    # fresh data_dir at once: TFDS builds into a temporary folder and renames it, and without
    # the lock in load_split all but the first fail with FileExistsError.
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from tlt_jax.data import arithmetic, pipeline
        time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # start together
        config = arithmetic.make_config("level1", num_train=2000, num_test=20)
        examples = pipeline.load_split("arithmetic", "train", data_dir={str(tmp_path)!r},
                                       config=config)
        print(json.dumps([len(examples), examples[0], examples[-1]]))
        """
    )
    import time

    start = f"{time.time() + 8.0}"  # after every interpreter has imported TFDS
    procs = [subprocess.Popen([sys.executable, "-c", script, start], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]  # fmt: skip
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    outputs = {out.strip().splitlines()[-1] for out, _ in results}
    assert len(outputs) == 1 and json.loads(outputs.pop())[0] == 2000


def test_a_first_build_leaves_no_temporary_folder(tmp_path, monkeypatch):
    # TFDS's DatasetInfo.initialize_from_bucket makes a mkdtemp("tfds") folder on every first
    # build and never removes it; load_split sends it into data_dir and removes it.
    system_tmp = tmp_path / "system_tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    config = arithmetic.make_config("level1", num_train=20, num_test=4)
    loaded = pipeline.load_split("arithmetic", "test", data_dir=tmp_path / "data", config=config)
    assert len(loaded) == 4
    assert tempfile.tempdir == str(system_tmp)  # restored
    assert list(system_tmp.iterdir()) == []
    assert not (tmp_path / "data" / ".tfds_scratch").exists()


# GSM8K builder.


def _write_jsonl(folder: Path, name: str, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(record) for record in records]
    (folder / name).write_text("\n".join(lines) + "\n\n")


def test_gsm8k_builder_parses_tiny_jsonl(tmp_path):
    raw = tmp_path / "raw"
    train = [
        {"question": "How many? ", "answer": "Add them.\n3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Big one?", "answer": "It is 1,000 + 234.\n#### 1,234"},
        {"question": "Negative?", "answer": "Down.\n#### -5"},
    ]
    test = [{"question": "Half?", "answer": "1/2 = 0.5\n#### 0.5"}]
    _write_jsonl(raw, "train.jsonl", train)
    _write_jsonl(raw, "test.jsonl", test)
    loaded = pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=raw)
    by_question = {example["question"]: example for example in loaded}
    assert set(by_question) == {"How many?", "Big one?", "Negative?"}
    assert by_question["Big one?"]["answer"] == "1234"
    assert by_question["How many?"]["answer"] == "7"
    assert by_question["Negative?"]["answer"] == "-5"
    assert by_question["Big one?"]["solution"] == train[1]["answer"]
    loaded_test = pipeline.load_split("gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=raw)
    assert loaded_test == [{"question": "Half?", "answer": "0.5", "solution": test[0]["answer"]}]

    # Edited files get a new build rather than the cached one.
    _write_jsonl(raw, "test.jsonl", [{"question": "New?", "answer": "#### 2"}])
    reloaded = pipeline.load_split("gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=raw)
    assert [example["answer"] for example in reloaded] == ["2"]


def test_parse_final_answer():
    assert gsm8k.parse_final_answer("steps\n#### 1,234,567") == "1234567"
    assert gsm8k.parse_final_answer("a #### b\n#### 12 ") == "12"
    with pytest.raises(ValueError, match="no final answer"):
        gsm8k.parse_final_answer("no marker 42")


def test_gsm8k_malformed_line_names_file_and_line(tmp_path):
    raw = tmp_path / "raw"
    _write_jsonl(raw, "train.jsonl", [{"question": "q", "answer": "no marker"}])
    _write_jsonl(raw, "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match=r"train\.jsonl:1: no final answer"):
        pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=raw)


# What the generator draws at every level (the first 20 test and 30 train problems, seed 0)
# and GSM8K's parse of a few solutions, by (Arithmetic.VERSION, Gsm8k.VERSION). TFDS keys a
# build by its config name and VERSION only: a change to what the code generates or parses
# would be served from the stale build in ~/.cache/tlt_jax/tfds without a word.
DATA_PINS = {
    ("1.0.0", "1.0.0"): ("16a3987e6bb9e64772a9647f61c99ae1f7faa7e043b95f81470fb2d363f0fc10",
                         ["42", "-3", "1234.5", "7 apples"]),
}  # fmt: skip


def test_a_change_to_the_generated_or_parsed_data_bumps_the_builders_version():
    import hashlib

    digest = hashlib.sha256()
    for level in arithmetic.LEVELS:
        test, expressions = arithmetic.generate_split((level,), 20, 0, "test", frozenset())
        train, _ = arithmetic.generate_split((level,), 30, 0, "train", expressions)
        digest.update(json.dumps([test, train], sort_keys=True).encode())
    solutions = ["2 + 40 = 42\n#### 42", "#### -3", "so\n#### 1,234.5", "#### 7 apples"]
    versions = (str(arithmetic.Arithmetic.VERSION), str(gsm8k.Gsm8k.VERSION))
    assert versions in DATA_PINS, f"builder versions {versions}: add their pins to DATA_PINS"
    generated, parsed = DATA_PINS[versions]
    assert digest.hexdigest() == generated, (
        "the arithmetic generator draws other problems: bump Arithmetic.VERSION (a cached "
        "build would be reused) and pin the new digest"
    )
    assert [gsm8k.parse_final_answer(s) for s in solutions] == parsed, (
        "GSM8K answers parse differently: bump Gsm8k.VERSION and pin the new answers"
    )


def test_a_gsm8k_line_that_is_not_utf8_names_file_and_line(tmp_path):
    """The file was read in the locale's encoding, and a bad byte raised a bare
    UnicodeDecodeError naming neither file nor line; a UTF-8 question in any locale reads."""
    raw = tmp_path / "raw"
    _write_jsonl(raw, "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    (raw / "train.jsonl").write_bytes(
        '{"question": "caf\u00e9 \u2212 1?", "answer": "#### 2"}\n'.encode()
        + b'{"question": "\xff", "answer": "#### 1"}\n'
    )
    with pytest.raises(ValueError, match=r"train\.jsonl:2: 'utf-8' codec can't decode"):
        pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=raw)
    (raw / "train.jsonl").write_bytes('{"question": "caf\u00e9?", "answer": "#### 2"}\n'.encode())
    examples = pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds2", manual_dir=raw)
    assert [ex["question"] for ex in examples] == ["caf\u00e9?"]


def test_an_empty_gsm8k_split_file_is_named(tmp_path):
    """An empty test.jsonl failed loading the train split with TFDS's 'No examples were
    yielded' for the test split, naming neither the file nor the flag."""
    raw = tmp_path / "raw"
    _write_jsonl(raw, "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    (raw / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"GSM8K file .*test\.jsonl' holds no examples; set "
                                         r"--config\.data\.data_dir"):  # fmt: skip
        pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=raw)


@pytest.mark.parametrize("line", ['[1, 2]', '"text"', '{"question": null, "answer": "#### 3"}',
                                  '{"question": "q", "answer": 3}'])  # fmt: skip
def test_gsm8k_row_of_the_wrong_type_names_file_and_line(tmp_path, line):
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:2: expected an object with string"):
        list(gsm8k.read_jsonl(epath.Path(path)))


def test_gsm8k_missing_folder_or_file_names_flag_and_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as error:
        pipeline.load_split("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=missing)
    assert "--config.data.data_dir" in str(error.value)
    assert str(missing) in str(error.value)
    assert not (tmp_path / "tfds").exists()  # failed before TFDS wrote anything

    _write_jsonl(tmp_path / "half", "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(FileNotFoundError, match="test.jsonl.*--config.data.data_dir"):
        pipeline.load_split(
            "gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=tmp_path / "half"
        )
    with pytest.raises(FileNotFoundError, match="--config.data.data_dir"):
        pipeline.load_split("gsm8k", "test", data_dir=tmp_path / "tfds")
    with pytest.raises(ValueError, match="data.data_dir=None.*--config.data.data_dir"):
        pipeline.DataConfig(name="gsm8k")


@pytest.mark.skipif(not SHARED_GSM8K.is_dir(), reason=f"{SHARED_GSM8K} is absent")
def test_gsm8k_shared_folder(tmp_path):
    train = pipeline.load_split("gsm8k", "train", data_dir=tmp_path, manual_dir=SHARED_GSM8K)
    test = pipeline.load_split("gsm8k", "test", data_dir=tmp_path, manual_dir=SHARED_GSM8K)
    assert (len(train), len(test)) == (7473, 1319)
    number = re.compile(r"-?\d+(\.\d+)?")
    assert all(number.fullmatch(example["answer"]) for example in train + test)
    ducks = [example for example in test if example["question"].startswith("Janet’s ducks")]
    assert [example["answer"] for example in ducks] == ["18"]
    assert ducks[0]["solution"].endswith("#### 18")


# Prompt rendering.


def _tiny_tokenizer(chat_template: str | None):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "solve": 1}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", chat_template=chat_template
    )


def test_render_prompt_with_and_without_chat_template():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with_template = _tiny_tokenizer(template)
    rendered = pipeline.render_prompt(with_template, " What is 2 + 3? ", instruction="Box it.")
    assert rendered == "<|user|>What is 2 + 3?\n\nBox it.<|end|><|assistant|>"

    default = pipeline.render_prompt(with_template, "Q")
    assert default == f"<|user|>Q\n\n{pipeline.DEFAULT_INSTRUCTION}<|end|><|assistant|>"
    assert "\\boxed{}" in pipeline.DEFAULT_INSTRUCTION

    plain = "What is 2 + 3?\n\nBox it."
    assert (
        pipeline.render_prompt(_tiny_tokenizer(None), "What is 2 + 3?", instruction="Box it.")
        == plain
    )
    assert (
        pipeline.render_prompt(
            with_template, "What is 2 + 3?", instruction="Box it.", use_chat_template=False
        )
        == plain
    )
    assert pipeline.render_prompt(None, "Q", instruction="") == "Q"
    with_system = pipeline.render_prompt(
        with_template, "Q", instruction="", system_prompt="Be brief."
    )
    assert with_system == "<|system|>Be brief.<|end|><|user|>Q<|end|><|assistant|>"


# Iterator.


def _examples(n: int) -> list[dict]:
    return [{"question": f"q{i}", "answer": str(i)} for i in range(n)]


def _ids(batch: list[dict]) -> list[int]:
    return [int(example["answer"]) for example in batch]


def test_iterator_follows_the_documented_order():
    iterator = pipeline.PromptIterator(_examples(10), batch_size=4, seed=7)
    flat = [i for _ in range(5) for i in _ids(next(iterator))]  # 20 = two full epochs
    assert flat[:10] == np.random.default_rng([7, 0]).permutation(10).tolist()
    assert flat[10:] == np.random.default_rng([7, 1]).permutation(10).tolist()
    assert flat[:10] != flat[10:]
    assert iterator.state() == {"epoch": 1, "index": 10, "shuffle": 2}

    unshuffled = pipeline.PromptIterator(_examples(5), batch_size=3, shuffle=False)
    assert [_ids(next(unshuffled)) for _ in range(2)] == [[0, 1, 2], [3, 4, 0]]


def test_iterator_is_deterministic_per_seed():
    def batches(seed: int) -> list[list[int]]:
        iterator = pipeline.PromptIterator(_examples(13), batch_size=5, seed=seed)
        return [_ids(next(iterator)) for _ in range(6)]

    assert batches(3) == batches(3)
    assert batches(3) != batches(4)


def test_a_seed_sweep_does_not_share_epoch_orders_one_epoch_apart():
    """Epoch e drew `default_rng(seed + e)`: seed 3's second epoch was seed 4's first. A
    position saved then (no "shuffle" key) still resumes in that order."""

    def epochs(seed: int, state=None) -> list[list[int]]:
        iterator = pipeline.PromptIterator(_examples(50), batch_size=50, seed=seed)
        if state is not None:
            iterator.restore(state)
        return [_ids(next(iterator)) for _ in range(2)]

    assert epochs(3)[1] != epochs(4)[0]
    legacy = epochs(3, {"epoch": 0, "index": 0})
    assert legacy[0] == np.random.default_rng(3).permutation(50).tolist()
    assert legacy[1] == epochs(4, {"epoch": 0, "index": 0})[0]  # the old overlap, kept
    assert epochs(3, {"epoch": 0, "index": 0, "shuffle": 2}) == epochs(3)
    with pytest.raises(ValueError, match="state shuffle=7 is not one of"):
        epochs(3, {"epoch": 0, "index": 0, "shuffle": 7})


def test_iterator_restore_across_epoch_boundary():
    original = pipeline.PromptIterator(_examples(10), batch_size=4, seed=1)
    for _ in range(2):
        next(original)
    saved = json.loads(json.dumps(original.state()))
    assert saved == {"epoch": 0, "index": 8, "shuffle": 2}
    expected = [_ids(next(original)) for _ in range(4)]  # crosses into epochs 1 and 2
    assert original.state() == {"epoch": 2, "index": 4, "shuffle": 2}

    restored = pipeline.PromptIterator(_examples(10), batch_size=4, seed=1)
    next(restored)  # a restored iterator's own history must not matter
    restored.restore(saved)
    assert [_ids(next(restored)) for _ in range(4)] == expected

    numpy_state = {"epoch": np.int64(0), "index": np.asarray(8), "shuffle": np.int64(2)}
    from_numpy = pipeline.PromptIterator(_examples(10), batch_size=4, seed=1)
    from_numpy.restore(numpy_state)
    assert _ids(next(from_numpy)) == expected[0]


def test_iterator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=0"):
        pipeline.PromptIterator(_examples(3), batch_size=0)
    with pytest.raises(ValueError, match="empty split"):
        pipeline.PromptIterator([], batch_size=1)
    iterator = pipeline.PromptIterator(_examples(3), batch_size=1)
    with pytest.raises(ValueError, match="index=4"):
        iterator.restore({"epoch": 0, "index": 4})
    with pytest.raises(ValueError, match="keys"):
        iterator.restore({"epoch": 0})


# Config.


def test_data_config_validation_names_field_value_and_choices():
    with pytest.raises(ValueError, match=r"data.name='mnist'.*'arithmetic', 'gsm8k'"):
        pipeline.DataConfig(name="mnist")
    with pytest.raises(ValueError, match=r"data.level='hard'.*'level1'"):
        pipeline.DataConfig(level="hard")
    with pytest.raises(ValueError, match=r"data.eval_split='validation'.*'test'"):
        pipeline.DataConfig(eval_split="validation")
    with pytest.raises(ValueError, match="data.num_train=0"):
        pipeline.DataConfig(num_train=0)
    with pytest.raises(ValueError, match="data.seed=-1"):
        pipeline.DataConfig(seed=-1)
    with pytest.raises(ValueError, match="data.eval_split='train' is the train split"):
        pipeline.DataConfig(eval_split="train")


def test_data_config_end_to_end(tmp_path):
    config = pipeline.DataConfig(
        level="level2", num_train=40, num_test=8, cache_dir=str(tmp_path), seed=5
    )
    iterator = pipeline.make_prompt_iterator(config, batch_size=16)
    batch = next(iterator)
    assert len(batch) == 16 and all(example["level"] == 2 for example in batch)
    assert len(pipeline.load_data(config, config.eval_split)) == 8
