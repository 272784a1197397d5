"""Verifiable rewards for math reasoning: answer extraction, numeric equivalence, scoring.

A reward function is `fn(completion: str, answer: str) -> float` and is registered by name in
`REWARD_FUNCTIONS`. `score_batch` runs one over a batch so that a function that raises or hangs
on one completion costs that completion its reward (0) and nothing else.
"""

import math
import queue
import re
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from absl import logging

RewardFunction = Callable[[str, str], float]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = "####"
# A `####` line's text that reads as a markdown heading, not an answer: "Step 3", "Part 2: ...",
# "2. Check", or anything ending in ":".
_HEADING_RE = re.compile(r"(?:(?:step|part|section)\b|\d+[.)]\s+[^\d\s]|.*:\s*$)", re.IGNORECASE)
# A plain number: optional sign, digits with optional well-formed thousands groups, optional
# decimal part; or a bare decimal like ".5". Linear-time (no nested quantifiers).
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
# `\u2212` is the unicode minus (`parse_number` reads it as `-`).
_SIGN = "[-+\u2212]"
_NUMBER = rf"{_SIGN}?{_UNSIGNED}"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
# A sign, and in running text a `$` after it (`-$5`, `-\$5`; `_clean` drops the `$`). Only after
# a sign: a `$` alone is `_OPEN`'s, so no two parts of a pattern match the same `$`.
_SIGN_MONEY = rf"{_SIGN}(?:\\?\$)?"
# In running text a `-` right after a word or digit is a hyphen or range ("pages 3-5"), not a sign.
_LAST_NUMBER_RE = re.compile(rf"(?:(?<![\w)]){_SIGN_MONEY})?{_UNSIGNED}(?:/\d+)?")
_SLASH_FRACTION_RE = re.compile(rf"^({_NUMBER})/({_NUMBER})$")
_LATEX_FRACTION_RE = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf)\{[^{}]*\}")
# Runs of digits and spaces (one character class: linear time); where spaces separate digits
# (`1 000`, `12 15`) only thousands groups are one number.
_DIGITS_AND_SPACES_RE = re.compile(r"[\d ]+")
_SPACED_THOUSANDS_RE = re.compile(r"\d{1,3}(?: \d{3})+")
# What may wrap a stated number: markdown bold, `$` or `\$` (math or money), `\(` `\)`.
# No two adjacent parts of the next two patterns match the same characters (`\s*\**\s*`
# did): after "answer is" or "=", a run of blanks then backtracks in linear time, not cubic
# (800 newlines took 4 s inside `re`, which holds the GIL, so `score_batch`'s timeout could
# not fire).
_OPEN = r"(?:\s|\*|\\?\$|\\\()*"
_CLOSE = r"(?:\*|\$|\\\))*"
# Stated final answers: "the answer is 17", "Answer: 17", "answer = 17" anywhere ...
_ANSWER_IS_RE = re.compile(
    rf"\banswer\s*(?:is(?:\s*:)?|:|=){_OPEN}((?:{_SIGN_MONEY})?{_UNSIGNED}(?:/\d+)?)(?![\d/])",
    re.IGNORECASE,
)
# ... or a last line that ends in "= 17" or "is 17" (an optional "." after it).
_LAST_LINE_RE = re.compile(
    rf"(?:=|\bis){_OPEN}((?:{_SIGN_MONEY})?{_UNSIGNED}){_CLOSE}(?:\s*\.)?\s*$"
)


def _boxed_contents(text: str) -> list[str]:
    """Contents of every complete `\\boxed{...}` in order, nested braces matched."""
    contents = []
    for match in _BOXED_RE.finditer(text):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
                if depth == 0:
                    contents.append(text[start:position])
                    break
    return contents


def _hash_answers(text: str) -> list[str]:
    """The rest of the line after each GSM8K-style `####` marker, stripped.

    A marker is a `####` followed by a number, or the text's last non-empty line starting
    with `####` (a non-numeric final answer) when no numeric marker comes before it and it
    does not read as a heading (`_HEADING_RE`). Other `####` lines are markdown headings
    ("#### Step 2: Answer"), which models write often, also as the last line of a response
    cut off at its length limit: no answer, so the later rules apply.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    answers = []
    for i, line in enumerate(lines):
        if _HASHES not in line:
            continue
        answer = line.rsplit(_HASHES, 1)[1].strip()
        if parse_number(_clean(answer)) is not None:
            answers.append(answer)
        elif (i == len(lines) - 1 and line.lstrip().startswith(_HASHES) and not answers
              and not _HEADING_RE.match(answer)):  # fmt: skip
            answers.append(answer)
    return answers


def _clean(answer: str) -> str:
    """Drops `$`, surrounding spaces and markdown bold (`**42**`), and a trailing `.`."""
    answer = answer.replace("\\$", "").replace("$", "").strip().strip("*").strip()
    return answer.rstrip(".").strip().strip("*").strip()


def _marked_answer(text: str) -> str | None:
    """The last complete `\\boxed{...}`, else the text after the last `####`; cleaned."""
    boxed = _boxed_contents(text)
    if boxed:
        return _clean(boxed[-1])
    hashes = [answer for answer in _hash_answers(text) if _clean(answer)]
    return _clean(hashes[-1]) if hashes else None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, or None if it has none.

    Priority: the last complete `\\boxed{...}` (nested braces kept whole, so
    `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); else the text after the last `####` on its
    line; else the last number in the text outside `####` headings (signs, thousands
    separators, decimals and `a/b` kept; a heading's number is a step's: "#### Step 2"). `$`,
    a trailing `.` and surrounding spaces are stripped.
    """
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    # No `####` line is an answer marker here: each is a heading.
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(_HASHES))
    numbers = _LAST_NUMBER_RE.findall(prose)
    if numbers:
        return _clean(numbers[-1])
    return None


def extract_final_answer(text: str) -> str | None:
    """The answer a completion states as final, or None; unlike `extract_answer`, a number
    that is merely last in the text is not one.

    Priority: the last complete `\\boxed{...}`; else the text after the last `####` on its
    line; else the number after the last "answer is" / "answer:" / "answer =" (any case);
    else a number ending the last non-empty line after `=` or "is" ("19 - 5 = 14.",
    "So the total is 14"). Cleaned as in `extract_answer`.
    """
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    stated = _ANSWER_IS_RE.findall(text)
    if stated:
        return _clean(stated[-1])
    lines = [line for line in text.splitlines() if line.strip()]
    if lines and (match := _LAST_LINE_RE.search(lines[-1])):
        return _clean(match.group(1))
    return None


def _plain_number(text: str) -> Fraction | None:
    text = text.strip()
    if not _NUMBER_RE.match(text):
        return None
    return Fraction(text.replace(",", ""))


def parse_number(text: str) -> Fraction | None:
    """An exact rational for a numeric answer string, or None if it is not a number.

    Accepts integers, a leading `+` or `-` (also the unicode minus), decimals, well-formed
    thousands separators (`1,234.5`; `1,2` is rejected as ambiguous), LaTeX `{,}` separators,
    `a/b` and `\\frac{a}{b}` / `\\dfrac` / `\\tfrac`, surrounding `$`, `\\text{...}` units and
    spaces (between digits only as thousands groups: `1 000`, not `12 15`). A trailing `%` is
    dropped, NOT divided by 100: gold answers to "what percent" questions are written as the
    bare number (`25%` parses as 25). A zero denominator gives None.
    """
    text = _TEXT_RE.sub("", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("{,}", ",")
    text = text.replace("\u2212", "-").replace("\\!", "").replace("\\,", "")
    for run in _DIGITS_AND_SPACES_RE.findall(text):
        run = run.strip()
        if " " in run and not _SPACED_THOUSANDS_RE.fullmatch(run):
            return None  # `12 15` is two numbers, not 1215 (`1 000` is one)
    text = text.replace(" ", "")
    text = text.removesuffix("%").rstrip(".")
    if not text:
        return None
    try:
        if (number := _plain_number(text)) is not None:
            return number
        if match := _SLASH_FRACTION_RE.match(text):
            numerator, denominator = match.groups()
        elif match := _LATEX_FRACTION_RE.match(text):
            sign, numerator, denominator = match.groups()
            numerator = sign + numerator
        else:
            return None
        numerator, denominator = _plain_number(numerator), _plain_number(denominator)
        if numerator is None or denominator is None:
            return None
        return numerator / denominator
    except (ValueError, ZeroDivisionError):
        return None


def _normalize_text(text: str) -> str:
    text = _clean(text).lower()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(text.split())


def answers_equal(prediction: str | None, gold: str) -> bool:
    """Whether a predicted answer matches the gold one.

    Exact rational equality when the gold answer parses as a number (`0.5 == 1/2`, `1,000 ==
    1000`, `2.50 == 2.5`; a prediction that does not parse is wrong); otherwise equality
    after lower-casing, removing whitespace and `$`, a trailing `.`, and spelling
    `\\dfrac`/`\\tfrac` as `\\frac`. None never matches.
    """
    if prediction is None:
        return False
    predicted_number, gold_number = parse_number(prediction), parse_number(gold)
    if gold_number is not None:
        # A numeric gold answer takes a number: text equality would count `12 15`, which
        # `parse_number` refuses (two numbers), as 1215 again once whitespace is removed.
        return predicted_number == gold_number
    return _normalize_text(prediction) == _normalize_text(gold)


def format_reward(text: str) -> float:
    """1.0 if the completion states exactly one final answer, else 0.0.

    Final-answer markers are complete `\\boxed{...}` groups and GSM8K `####` answer lines (a
    markdown `####` heading is none: `_hash_answers`). The
    reward is 1.0 only when there is exactly one marker in all and its content is not empty;
    no marker, an empty `\\boxed{}`, or several answers (even if equal) give 0.0.
    """
    answers = _boxed_contents(text) + _hash_answers(text)
    return 1.0 if len(answers) == 1 and _clean(answers[0]) else 0.0


def math_accuracy(completion: str, answer: str) -> float:
    """1.0 if the extracted final answer equals the gold answer, else 0.0."""
    return 1.0 if answers_equal(extract_answer(completion), answer) else 0.0


def final_answer_accuracy(completion: str, answer: str) -> float:
    """1.0 if the stated final answer (`extract_final_answer`) equals the gold one, else 0.0."""
    return 1.0 if answers_equal(extract_final_answer(completion), answer) else 0.0


def format_only(completion: str, answer: str) -> float:
    """`format_reward` as a reward function (the gold answer is ignored)."""
    del answer
    return format_reward(completion)


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_accuracy": math_accuracy,
    "final_answer": final_answer_accuracy,
    "format": format_only,
}


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch.

    Attributes:
      rewards: [B] float32, task reward + format_weight * format reward; 0 where scoring failed.
      correct: [B] bool, the task reward (before the format bonus) was > 0.
      num_errors: completions whose reward function raised or returned a non-finite value.
      num_timeouts: completions whose reward function ran past the timeout.
      first_error: the first errored completion's index and traceback ("" without errors).
    """

    rewards: np.ndarray
    correct: np.ndarray
    num_errors: int
    num_timeouts: int
    first_error: str = ""

    def to_json(self) -> dict:
        """Plain JSON values (float32 rewards round-trip exactly through Python floats)."""
        return {
            "rewards": [float(r) for r in self.rewards],
            "correct": [bool(c) for c in self.correct],
            "num_errors": int(self.num_errors),
            "num_timeouts": int(self.num_timeouts),
            "first_error": self.first_error,
        }

    @classmethod
    def from_json(cls, value: dict) -> "RewardResult":
        return cls(
            rewards=np.asarray(value["rewards"], np.float32),
            correct=np.asarray(value["correct"], bool),
            num_errors=value["num_errors"],
            num_timeouts=value["num_timeouts"],
            first_error=value["first_error"],
        )


_OK, _ERROR = "ok", "error"


def _score_from(
    fn: RewardFunction,
    completions: list[str],
    answers: list[str],
    start: int,
    format_weight: float,
    results: queue.SimpleQueue,
    abandoned: threading.Event,
) -> None:
    """Worker loop: scores completions[start:] in order, posting (index, status, task, total),
    the traceback in place of the total for an errored one; returns once `abandoned` is set
    (the caller timed it out and a fresh worker scores the rest: it would score them again)."""
    for index in range(start, len(completions)):
        if abandoned.is_set():
            return
        try:
            task_reward = float(fn(completions[index], answers[index]))
            if not math.isfinite(task_reward):
                raise ValueError(f"non-finite reward {task_reward}")
            total = task_reward + format_weight * format_reward(completions[index])
            results.put((index, _OK, task_reward, total))
        except Exception:  # any failure of user code is one errored sample
            results.put((index, _ERROR, 0.0, traceback.format_exc()))


def score_batch(
    fn_name_or_callable: str | RewardFunction,
    completions: list[str],
    answers: list[str],
    *,
    timeout_s: float = 5.0,
    format_weight: float = 0.0,
) -> RewardResult:
    """Scores completions against gold answers; failures and hangs cost only their sample.

    Timeouts use a daemon worker thread that scores the batch sequentially; the caller waits at
    most `timeout_s` for each completion's result. When one times out, that worker is abandoned
    (Python cannot kill a thread; its slow call finishes or hangs in the background, and being a
    daemon it never blocks interpreter exit; it scores nothing after it) and a fresh worker
    continues with the next completion, so every completion is scored once.
    Why threads rather than a process pool: reward functions are cheap pure Python and GIL
    bound, so parallelism buys nothing; a pool adds process start-up and pickling (lambdas and
    closures fail), and forking a process that has initialised JAX can deadlock. The cost: a
    function stuck inside C code that holds the GIL (e.g. a catastrophic regex) blocks the caller
    too until it returns. The extraction regexes here are linear-time.

    Args:
      fn_name_or_callable: a key of `REWARD_FUNCTIONS` or a `fn(completion, answer) -> float`.
      completions: [B] model outputs.
      answers: [B] gold answers, aligned with completions.
      timeout_s: per-completion time limit in seconds.
      format_weight: weight of `format_reward` added to each successful task reward.

    Returns:
      A `RewardResult`.
    """
    if isinstance(fn_name_or_callable, str):
        if fn_name_or_callable not in REWARD_FUNCTIONS:
            raise ValueError(
                f"reward function {fn_name_or_callable!r} is not one of {sorted(REWARD_FUNCTIONS)}"
            )
        fn = REWARD_FUNCTIONS[fn_name_or_callable]
    else:
        fn = fn_name_or_callable
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)=} != {len(answers)=}")
    if timeout_s <= 0:
        raise ValueError(f"{timeout_s=} must be > 0")

    count = len(completions)
    rewards = np.zeros(count, np.float32)
    correct = np.zeros(count, bool)
    num_errors = num_timeouts = 0
    first_error = ""
    index = 0
    while index < count:
        # A fresh queue per worker, so a late result from an abandoned worker is never read.
        results: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()
        threading.Thread(
            target=_score_from,
            args=(fn, completions, answers, index, format_weight, results, abandoned),
            daemon=True,
            name="score_batch",
        ).start()
        while index < count:
            try:
                done_index, status, task_reward, total = results.get(timeout=timeout_s)
            except queue.Empty:
                num_timeouts += 1
                index += 1
                abandoned.set()  # it stops once its slow call returns
                break  # abandon this worker; the outer loop starts a new one
            assert done_index == index, (done_index, index)  # one worker posts in order
            if status == _OK:
                rewards[index] = total
                correct[index] = task_reward > 0
            else:
                num_errors += 1
                first_error = first_error or f"completion {index}: {total}"
            index += 1
    if num_errors:  # scored 0, never silently: each batch logs its first error in full
        logging.warning("reward function %r failed on %d of %d completions (scored 0); the "
                        "first, %s", getattr(fn, "__name__", fn), num_errors, count,
                        first_error)  # fmt: skip
    return RewardResult(rewards, correct, num_errors, num_timeouts, first_error)
