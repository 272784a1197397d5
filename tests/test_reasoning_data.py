"""The multi-step arithmetic levels: `chain` (left-to-right chains), `word` (short stories) and
`steps` (level0 and chain, half each)."""

import ast
import re

import pytest

from tlt_jax.data import arithmetic, pipeline

_CHAIN = re.compile(r"^(?:What is|Compute|Evaluate|Calculate) (\d+(?: [+-] \d+)+)[?.]$")
_START = re.compile(r"^(\w+) has (\d+) (\w+)\.$")
_GAIN = re.compile(r"^Then (\w+) (?:buys (\d+) more|finds (\d+) more|gets (\d+) from a friend)\.$")
_LOSS = re.compile(r"^Then (\w+) (?:gives (\d+) to a friend|loses (\d+)|sells (\d+))\.$")
_ASK = re.compile(r"^How many (\w+) does (\w+) have now\?$")


def _chain_steps(question: str) -> tuple[list[int], list[int]]:
    """(operands, partial results) of a `chain` question, evaluated left to right by hand."""
    match = _CHAIN.match(question)
    assert match, question
    tokens = match.group(1).split()
    value, partials = int(tokens[0]), []
    for operator, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        value = value + int(operand) if operator == "+" else value - int(operand)
        partials.append(value)
    # Python's parser agrees: + and - associate to the left.
    assert value == eval(compile(ast.parse(match.group(1), mode="eval"), "", "eval"))  # noqa: S307
    return [int(t) for t in tokens[::2]], partials


def _word_story(question: str) -> tuple[int, list[int], int]:
    """(start, signed changes, result) of a `word` question, parsed sentence by sentence."""
    sentences = re.split(r"(?<=[.?]) ", question)
    start = _START.match(sentences[0])
    ask = _ASK.match(sentences[-1])
    assert start and ask, question
    who, amount, item = start.group(1), int(start.group(2)), start.group(3)
    assert ask.groups() == (item, who), question
    changes = []
    for sentence in sentences[1:-1]:
        gain, loss = _GAIN.match(sentence), _LOSS.match(sentence)
        match = gain or loss
        assert match and match.group(1) == who, sentence
        n = int(next(g for g in match.groups()[1:] if g))
        changes.append(n if gain else -n)
    return amount, changes, amount + sum(changes)


def _expression(example: dict) -> str:
    return re.match(r"^(?:What is|Compute|Evaluate|Calculate) (.+?)[?.]$", example["question"])[1]


def _signature(example: dict) -> tuple[int, ...]:
    start, changes, _ = _word_story(example["question"])
    return (start, *changes)


def test_chain_level_is_three_small_operands_with_bounded_partials():
    examples, expressions = arithmetic.generate_split((4,), 500, 0, "test", frozenset())
    assert len(expressions) == 500
    for example in examples:
        operands, partials = _chain_steps(example["question"])
        assert len(operands) == 3 and all(1 <= n <= 9 for n in operands), example
        assert all(0 <= p <= 100 for p in partials), example  # never negative on the way
        assert example["answer"] == str(partials[-1]) and example["level"] == 4
    assert any(" - " in e["question"] for e in examples)
    assert any(" + " in e["question"] for e in examples)


def test_word_level_answers_follow_the_story():
    examples, _ = arithmetic.generate_split((5,), 800, 0, "test", frozenset())
    event_counts = set()
    for example in examples:
        start, changes, result = _word_story(example["question"])
        assert 5 <= start <= 30 and all(1 <= abs(c) <= 20 for c in changes), example
        running = start
        for change in changes:
            running += change
            assert 0 <= running <= 100, example
        assert example["answer"] == str(result) and example["level"] == 5
        event_counts.add(len(changes))
    assert event_counts == {1, 2}
    assert any("loses" in e["question"] for e in examples)
    assert any("finds" in e["question"] for e in examples)


def test_word_problems_with_the_same_arithmetic_count_as_one():
    # Names and items vary, but the held-out check compares the expression: no train story
    # may repeat a test story's numbers and operations.
    test, test_expressions = arithmetic.generate_split((5,), 300, 0, "test", frozenset())
    train, _ = arithmetic.generate_split((5,), 1500, 0, "train", test_expressions)
    test_signatures = {_signature(e) for e in test}
    train_signatures = [_signature(e) for e in train]
    assert len(test_signatures) == 300
    assert len(set(train_signatures)) == 1500
    assert not test_signatures & set(train_signatures)


def test_steps_level_mixes_one_and_two_step_problems():
    config = arithmetic.make_config("steps", num_train=600, num_test=200)
    assert config.levels == (0, 4)
    test, test_expressions = arithmetic.generate_split(config.levels, 200, 0, "test", frozenset())
    train, _ = arithmetic.generate_split(config.levels, 600, 0, "train", test_expressions)
    levels = [e["level"] for e in test + train]
    assert 0.35 < levels.count(0) / len(levels) < 0.65
    for example in test + train:
        if example["level"] == 4:
            assert len(_chain_steps(example["question"])[0]) == 3, example
        else:
            assert re.match(r"^\D+\d+ [+-] \d+[?.]$", example["question"]), example
    assert not {_expression(e) for e in test} & {_expression(e) for e in train}


@pytest.mark.parametrize("level", ["chain", "word", "steps"])
def test_new_levels_build_deterministically_without_leaks(tmp_path, level):
    config = arithmetic.make_config(level, num_train=400, num_test=100)
    assert config.name == f"{level}_train400_test100_seed0"
    first = {s: pipeline.load_split("arithmetic", s, data_dir=tmp_path / "a", config=config)
             for s in pipeline.SPLITS}  # fmt: skip
    second = pipeline.load_split("arithmetic", "train", data_dir=tmp_path / "b", config=config)
    assert first["train"] == second
    assert len(first["train"]) == 400 and len(first["test"]) == 100
    assert not {e["question"] for e in first["train"]} & {e["question"] for e in first["test"]}
    assert arithmetic.make_config(level) is arithmetic.make_config(level)
    assert pipeline.DataConfig(level=level).level == level


def test_word_level_is_deterministic_per_seed():
    first = arithmetic.generate_split((5,), 50, 0, "train", frozenset())[0]
    assert first == arithmetic.generate_split((5,), 50, 0, "train", frozenset())[0]
    assert first != arithmetic.generate_split((5,), 50, 1, "train", frozenset())[0]
