"""Procedural integer-arithmetic problems as a TFDS dataset (no downloads, no TensorFlow).

Each example is an expression over integers with a known exact result:

- `level0`: two operands, `+` / `-`, operands in [0, 20] (882 distinct problems; sized for
  small models such as SmolLM2-135M, which solve about half of them greedily).
- `level1`: two operands, `+` / `-`, operands in [0, 999].
- `level2`: three operands, `+` / `-` / `*`, parentheses where the tree needs them.
- `level3`: four or five operands, nested parentheses, operands up to 9,999.
- `chain` (level 4): three operands in [1, 9] chained left to right with `+` / `-`
  (`7 + 2 - 5`), every partial result >= 0: each operator is one step of working.
- `word` (level 5): one or two gains or losses told as a short story ("Mia has 14 marbles.
  Then Mia finds 6 more. ... How many marbles does Mia have now?"); partials in [0, 100].
- `steps`: each example is `level0` (one step) or `chain` (two steps), half each.
- `mixed`: each example picks one of levels 1-3 uniformly.

Generation is deterministic: every (config seed, split) has its own fixed
`numpy.random.default_rng` stream. The test split is drawn first; train skips any expression
already in test, and no split repeats an expression, so held-out problems never leak.

Importing this module registers the builder as `arithmetic` with TFDS, so
`tfds.data_source("arithmetic/level2", data_dir=..., builder_kwargs={"file_format":
"array_record"})` works. Importing it twice under different module names would register twice;
import it as `tlt_jax.data.arithmetic` only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

LEVELS = (0, 1, 2, 3, 4, 5)
_EXHAUSTED = 20_000  # draws in a row without a new problem: the level has no more
MIXED_LEVELS = (1, 2, 3)
# Names of the level sets that are not `level<N>`.
_NAMED_LEVELS = {"chain": (4,), "word": (5,), "steps": (0, 4), "mixed": MIXED_LEVELS}
LEVEL_NAMES = ("level0", "level1", "level2", "level3", "chain", "word", "steps", "mixed")
_SPLIT_STREAM = {"test": 0, "train": 1}
_TEMPLATES = ("What is {expr}?", "Compute {expr}.", "Evaluate {expr}.", "Calculate {expr}.")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


@dataclasses.dataclass(frozen=True)
class _LevelSpec:
    """How one difficulty level draws its expressions."""

    num_operands: tuple[int, ...]  # allowed operand counts
    operators: tuple[str, ...]
    additive_range: tuple[int, int]  # inclusive range of leaves under + / -
    multiplicative_range: tuple[int, int]  # inclusive range of leaves directly under *
    max_abs_result: int  # redraw expressions whose result (or any partial) is larger
    chain: bool = False  # left-deep trees only: `a + b - c + d`, one step per operator
    nonnegative: bool = False  # redraw expressions with a negative partial result


_LEVEL_SPECS = {
    0: _LevelSpec((2,), ("+", "-"), (0, 20), (0, 0), 100),
    1: _LevelSpec((2,), ("+", "-"), (0, 999), (0, 0), 10_000),
    2: _LevelSpec((3,), ("+", "-", "*"), (1, 99), (2, 20), 10_000),
    3: _LevelSpec((4, 5), ("+", "-", "*"), (10, 9_999), (2, 99), 1_000_000),
    4: _LevelSpec((3,), ("+", "-"), (1, 9), (0, 0), 100, chain=True, nonnegative=True),
}
_WORD_LEVEL = 5


@dataclasses.dataclass(frozen=True)
class _Node:
    """Binary expression tree; a leaf has `operator == ""` and holds `value`."""

    value: int
    operator: str = ""
    left: _Node | None = None
    right: _Node | None = None


def _render(node: _Node) -> str:
    """Renders `node` with the fewest parentheses that keep its meaning."""
    if not node.operator:
        return str(node.value)
    precedence = _PRECEDENCE[node.operator]

    def child(sub: _Node, is_right: bool) -> str:
        text = _render(sub)
        if not sub.operator:
            return text
        sub_precedence = _PRECEDENCE[sub.operator]
        # a - (b + c) and a * (b - c) need parentheses; a + (b - c) and a * (b * c) do not.
        needs = sub_precedence < precedence or (
            is_right and sub_precedence == precedence and node.operator == "-"
        )
        return f"({text})" if needs else text

    return f"{child(node.left, False)} {node.operator} {child(node.right, True)}"


def _draw_tree(
    rng: np.random.Generator, spec: _LevelSpec, num_leaves: int, under_product: bool
) -> _Node:
    """Draws a random tree with `num_leaves` leaves; partial results must stay bounded."""
    if num_leaves == 1:
        low, high = spec.multiplicative_range if under_product else spec.additive_range
        return _Node(int(rng.integers(low, high + 1)))
    operator = str(rng.choice(spec.operators))
    left_leaves = num_leaves - 1 if spec.chain else int(rng.integers(1, num_leaves))
    product = operator == "*"
    left = _draw_tree(rng, spec, left_leaves, product)
    right = _draw_tree(rng, spec, num_leaves - left_leaves, product)
    value = {"+": left.value + right.value, "-": left.value - right.value}.get(
        operator, left.value * right.value
    )
    return _Node(value, operator, left, right)


def _within_bounds(node: _Node, limit: int, nonnegative: bool = False) -> bool:
    """Whether every partial result in `node` has absolute value at most `limit` (and is
    >= 0 when `nonnegative`)."""
    if abs(node.value) > limit or (nonnegative and node.value < 0):
        return False
    if not node.operator:
        return True
    return _within_bounds(node.left, limit, nonnegative) and _within_bounds(
        node.right, limit, nonnegative
    )


_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Emma", "Noah", "Lily", "Ben")
_ITEMS = ("apples", "marbles", "stickers", "cards", "pencils", "coins", "shells", "books")
_GAINS = ("Then {who} buys {n} more.", "Then {who} finds {n} more.",
          "Then {who} gets {n} from a friend.")  # fmt: skip
_LOSSES = ("Then {who} gives {n} to a friend.", "Then {who} loses {n}.",
           "Then {who} sells {n}.")  # fmt: skip
_WORD_LIMIT = 100


def _word_problem(rng: np.random.Generator) -> tuple[str, _Node]:
    """A story of one or two events (a gain or a loss of 1-20) on a starting amount of 5-30;
    every partial result stays in [0, 100]. Returns the question and its left-deep tree."""
    who, item = str(rng.choice(_NAMES)), str(rng.choice(_ITEMS))
    tree = _Node(int(rng.integers(5, 31)))
    sentences = [f"{who} has {tree.value} {item}."]
    for _ in range(int(rng.integers(1, 3))):
        gain = bool(rng.integers(2)) if 0 < tree.value < _WORD_LIMIT else tree.value == 0
        limit = _WORD_LIMIT - tree.value if gain else tree.value
        n = int(rng.integers(1, min(20, limit) + 1))
        tree = _Node(tree.value + n if gain else tree.value - n, "+" if gain else "-", tree,
                     _Node(n))  # fmt: skip
        sentences.append(str(rng.choice(_GAINS if gain else _LOSSES)).format(who=who, n=n))
    sentences.append(f"How many {item} does {who} have now?")
    return " ".join(sentences), tree


def make_problem(rng: np.random.Generator, level: int) -> tuple[str, str, int]:
    """Draws one problem of the given level.

    Args:
      rng: the generator to draw from (advanced in place).
      level: difficulty, one of `LEVELS`.

    Returns:
      `(question, expression, result)`: the question text, the expression it asks about, and
      the exact integer value of that expression.
    """
    if level == _WORD_LEVEL:
        question, tree = _word_problem(rng)
        return question, _render(tree), tree.value
    if level not in _LEVEL_SPECS:
        raise ValueError(f"level={level!r} is not one of {LEVELS}")
    spec = _LEVEL_SPECS[level]
    while True:
        num_leaves = int(rng.choice(spec.num_operands))
        tree = _draw_tree(rng, spec, num_leaves, under_product=False)
        if _within_bounds(tree, spec.max_abs_result, spec.nonnegative):
            break
    expression = _render(tree)
    template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
    return template.format(expr=expression), expression, tree.value


def generate_split(
    levels: tuple[int, ...], num_examples: int, seed: int, split: str, exclude: frozenset[str]
) -> tuple[list[dict], frozenset[str]]:
    """Draws `num_examples` problems with distinct expressions, none of them in `exclude`.

    Expressions, not question texts, are compared: "What is 3 + 4?" and "Compute 3 + 4." are
    the same problem.

    Args:
      levels: the levels to draw from; each example picks one uniformly.
      num_examples: how many examples to return.
      seed: the base seed; the split name selects a separate stream from it.
      split: `"train"` or `"test"`.
      exclude: expressions that must not appear (the test ones, when drawing train).

    Returns:
      `(examples, expressions)`: examples `{"question": str, "answer": str, "level": int}` in
      generation order, and the set of their expressions.
    """
    if split not in _SPLIT_STREAM:
        raise ValueError(f"split={split!r} is not one of {tuple(_SPLIT_STREAM)}")
    rng = np.random.default_rng([seed, _SPLIT_STREAM[split]])
    seen: set[str] = set()
    examples: list[dict] = []
    # A level can run out of distinct problems (level0 has 882): drawing stops once
    # `_EXHAUSTED` draws in a row found nothing new (a level with even 1 in 1,000 of its
    # problems left finds one in that many draws but for odds of e^-20), not after 20 draws
    # per example asked (a 20,000-example split of level0 drew for 25 s before failing).
    max_draws, misses = 20 * num_examples + 1000, 0
    for _ in range(max_draws):
        if len(examples) == num_examples or misses == _EXHAUSTED:
            break
        level = levels[int(rng.integers(len(levels)))]
        question, expression, result = make_problem(rng, level)
        if expression in seen or expression in exclude:
            misses += 1
            continue
        misses = 0
        seen.add(expression)
        examples.append({"question": question, "answer": str(result), "level": level})
    if len(examples) < num_examples:
        raise ValueError(
            f"could only draw {len(examples)} distinct problems for the {split} split at "
            f"levels {levels} (the test split's excluded from train), {num_examples} requested: "
            f"lower --config.data.num_{split} or pick a larger --config.data.level"
        )
    return examples, frozenset(seen)


@dataclasses.dataclass
class ArithmeticConfig(tfds.core.BuilderConfig):
    """Which levels to draw and how many examples per split.

    Attributes:
      levels: difficulty levels, each in `LEVELS`.
      num_train: examples in the `train` split.
      num_test: examples in the `test` split.
      seed: base seed of the procedural generator.
    """

    levels: tuple[int, ...] = (1,)
    num_train: int = 20_000
    num_test: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [level for level in self.levels if level not in LEVELS]
        if not self.levels or bad:
            raise ValueError(f"ArithmeticConfig.levels={self.levels!r}: each must be in {LEVELS}")
        for field in ("num_train", "num_test"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ArithmeticConfig.{field}={getattr(self, field)} must be > 0")


_DEFAULT_SIZES = {"num_train": 20_000, "num_test": 500, "seed": 0}


def _config_for(level: str, num_train: int, num_test: int, seed: int) -> ArithmeticConfig:
    if level in _NAMED_LEVELS:
        levels = _NAMED_LEVELS[level]
    else:
        levels = (int(level.removeprefix("level")),)
    name = level
    if {"num_train": num_train, "num_test": num_test, "seed": seed} != _DEFAULT_SIZES:
        name = f"{level}_train{num_train}_test{num_test}_seed{seed}"
    return ArithmeticConfig(
        name=name,
        description=f"levels {levels}, {num_train} train / {num_test} test, seed {seed}",
        levels=levels,
        num_train=num_train,
        num_test=num_test,
        seed=seed,
    )


_STANDARD_CONFIGS = {level: _config_for(level, **_DEFAULT_SIZES) for level in LEVEL_NAMES}


def make_config(
    level: str, *, num_train: int = 20_000, num_test: int = 500, seed: int = 0
) -> ArithmeticConfig:
    """Returns the config for a named level, with custom sizes if asked.

    Args:
      level: one of `LEVEL_NAMES` (`"level0"` ... `"level3"`, `"chain"`, `"word"`, `"mixed"`).
      num_train: examples in `train`.
      num_test: examples in `test`.
      seed: base seed of the generator.

    Returns:
      The registered config when the sizes and seed are the defaults (TFDS rejects a new
      object under a registered name); otherwise a custom config whose name records sizes and
      seed, so differently sized builds get different cache folders.
    """
    if level not in LEVEL_NAMES:
        raise ValueError(f"level={level!r} is not one of {LEVEL_NAMES}")
    if {"num_train": num_train, "num_test": num_test, "seed": seed} == _DEFAULT_SIZES:
        return _STANDARD_CONFIGS[level]
    return _config_for(level, num_train, num_test, seed)


class Arithmetic(tfds.core.GeneratorBasedBuilder):
    """Procedural integer arithmetic; the answer is the exact result as a decimal string."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = list(_STANDARD_CONFIGS.values())
    DEFAULT_CONFIG_NAME = "mixed"
    # TFDS derives this through `importlib_resources`, which it does not declare as a dependency
    # on Python >= 3.9; setting it avoids that import (TFDS looks for `checksums.tsv` beside it).
    code_path = epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        # `dataset_info_from_configs` would read README/CITATIONS files next to this module.
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__.split("\n\n", 1)[0],
            features=tfds.features.FeaturesDict(
                {
                    "question": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "level": np.int32,
                }
            ),
            supervised_keys=None,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # nothing to download
        config = self.builder_config
        test, test_expressions = generate_split(
            config.levels, config.num_test, config.seed, "test", frozenset()
        )
        train, _ = generate_split(
            config.levels, config.num_train, config.seed, "train", test_expressions
        )
        return {"train": self._generate_examples(train), "test": self._generate_examples(test)}

    def _generate_examples(self, examples: list[dict]) -> Iterator[tuple[int, dict]]:
        yield from enumerate(examples)
