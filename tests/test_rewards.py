"""Answer extraction, numeric equivalence, format reward and fault-tolerant batch scoring."""

import json
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from tlt_jax.rl import rewards
from tlt_jax.rl.rewards import RewardResult, score_batch


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # last one, nested braces
        (r"\boxed{ $3.5$ }.", "3.5"),
        (r"\boxed{x^{2}+1} and later \boxed{oops", "x^{2}+1"),  # unclosed box is skipped
        (r"\boxed{7} beats #### 8", "7"),  # boxed outranks ####
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,000.\n", "1,000"),
        ("#### 5\nrevised: #### 6", "6"),
        ("We get 3 apples, then 12.5 pears.", "12.5"),
        ("pages 3-5", "5"),  # hyphen, not a minus sign
        ("it drops to -7 degrees", "-7"),
        ("ratio is 3/4.", "3/4"),
        ("costs $1,234.50 in total", "1,234.50"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert rewards.extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}. The answer is 7", "42"),  # boxed first, as in extract_answer
        ("Mia has 14 + 6 = 20.\n#### 20\nThe answer is 21", "20"),  # then ####
        ("#### \nThe answer is 21", "21"),  # an empty #### line is no answer
        ("10 + 3 = 13\nZoe has 13 stickers now.\n\nThe answer is 13.", "13"),
        ("So, the final answer is: 22", "22"),
        ("The answer is **-3**.", "-3"),
        ("ANSWER = 1,000", "1,000"),
        ("The answer is 3/4.", "3/4"),
        ("The answer is 12 and the check is 5 + 7 = 12. Next answer is 9 apples", "9"),
        ("Add them: 17 + 16 = 33\n", "33"),  # the last line ends in = N
        ("18 + 1 = 19.", "19"),
        ("So the total is 14", "14"),
        ("The answer is correct.", None),  # "answer is" without a number
        ("The answer is 12/x", None),  # not a number
        ("so she has 17 apples", None),  # a last number that is not stated as the answer
        ("7 + 5 = 12 and 12 - 3 = 9 apples left", None),  # = N not at the end of the line
        ("7 + 5 = 12\nMax gets 8 from a friend", None),  # only the last line counts
        ("12 + 5 =", None),  # truncated mid-equation
        ("This is 5x faster", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert rewards.extract_final_answer(text) == expected


def test_final_answer_accuracy_needs_a_stated_answer():
    assert rewards.final_answer_accuracy("so 7 + 5 = 12.", "12") == 1.0
    assert rewards.final_answer_accuracy("The answer is 12.0", "12") == 1.0
    assert rewards.final_answer_accuracy("The answer is 13", "12") == 0.0
    # math_accuracy takes the last number; final_answer does not.
    assert rewards.math_accuracy("she has 12 apples", "12") == 1.0
    assert rewards.final_answer_accuracy("she has 12 apples", "12") == 0.0
    assert rewards.REWARD_FUNCTIONS["final_answer"] is rewards.final_answer_accuracy


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", Fraction(42)),
        ("-3", Fraction(-3)),
        ("+7", Fraction(7)),
        ("\u22125", Fraction(-5)),  # unicode minus
        ("1,234.5", Fraction(2469, 2)),
        ("1{,}000", Fraction(1000)),
        ("0.50", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-6/4", Fraction(-3, 2)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"-\tfrac{1}{3}", Fraction(-1, 3)),
        ("25%", Fraction(25)),  # percent sign dropped, not divided by 100
        (r"\$5.00", Fraction(5)),
        ("$18$", Fraction(18)),
        (r"18 \text{ dollars}", Fraction(18)),
        ("1,2", None),  # malformed thousands grouping
        ("1 000 000", Fraction(1_000_000)),  # spaces as thousands separators
        ("- 5", Fraction(-5)),
        ("12 15", None),  # two numbers (it read 1215)
        ("4 2", None),
        ("3.14 15", None),
        ("1/0", None),
        ("x+1", None),
        ("", None),
        ("-", None),
    ],
)
def test_parse_number(text, expected):
    assert rewards.parse_number(text) == expected


@pytest.mark.parametrize(
    "prediction, gold, expected",
    [
        ("0.5", "1/2", True),
        (r"\frac{1}{2}", "0.5", True),
        ("1,000", "1000", True),
        ("2.50", "2.5", True),
        ("-3", "-3.0", True),
        ("-3", "3", False),
        ("0.333", "1/3", False),  # exact, no tolerance
        ("72", "72", True),
        ("71", "72", False),
        ("Yes", " yes.", True),  # normalised strings
        (r"\dfrac{x}{2}", r"\frac{x}{2}", True),
        ("x + 1", "x+1", True),
        ("x+1", "x+2", False),
        ("12", "twelve", False),
        (None, "0", False),
        # A numeric gold answer takes a number: spaced digits are two numbers (`parse_number`),
        # not 1215 once whitespace is removed (the text comparison's normalisation).
        ("12 15", "1215", False),
        ("4 2", "42", False),
        ("1 000", "1000", True),
        ("twelve", "12", False),
    ],
)
def test_answers_equal(prediction, gold, expected):
    assert rewards.answers_equal(prediction, gold) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"thinking... \boxed{5}", 1.0),
        ("work\n#### 5", 1.0),
        ("the answer is 5", 0.0),  # no marker
        (r"\boxed{5} and \boxed{5}", 0.0),  # two answers
        (r"\boxed{5}\n#### 5", 0.0),
        (r"\boxed{}", 0.0),  # empty
        ("#### ", 0.0),
        # Markdown headings are no answer marker: one boxed answer is one answer.
        ("#### Step 1\n3 + 2 = 5\nSo the answer is \\boxed{5}", 1.0),
    ],
)
def test_format_reward(text, expected):
    assert rewards.format_reward(text) == expected


def test_markdown_headings_are_not_final_answers():
    """`#### Step 2: Answer` is a markdown heading, not GSM8K's answer line: the answer is the
    stated one (it used to be 'Step 2: Answer', scoring a correct completion 0)."""
    text = "#### Step 1: Add the apples\n3 + 2 = 5\n#### Step 2: Answer\nThe answer is 5."
    assert rewards.extract_answer(text) == "5"
    assert rewards.extract_final_answer(text) == "5"
    assert rewards.math_accuracy(text, "5") == 1.0
    # GSM8K's own marker still wins, mid-text with a number or as the last line.
    assert rewards.extract_answer("#### Work\nx = 3\n#### 72\nbecause 8 * 9") == "72"
    assert rewards.extract_answer("#### Work\n3 apples\n#### twelve") == "twelve"


def test_spaced_digits_and_trailing_headings_score_as_written():
    """`#### 12 15` scored 1.0 against 1215 through the text comparison; a trailing markdown
    heading replaced an earlier `####` answer (a right 10 scored 0) and gave a response cut
    off after a heading a format reward of 1."""
    assert rewards.math_accuracy("#### 12 15", "1215") == 0.0
    assert rewards.math_accuracy(r"\boxed{4 2}", "42") == 0.0
    assert rewards.final_answer_accuracy("#### 1 2 3", "123") == 0.0
    assert rewards.math_accuracy("#### 1 000", "1000") == 1.0
    text = "#### 10\n#### 2. Check"
    assert rewards.extract_answer(text) == "10" and rewards.math_accuracy(text, "10") == 1.0
    assert rewards.format_reward(text) == 1.0
    assert rewards.format_reward("5 + 3 = 8\n#### Step 3") == 0.0  # cut off after a heading
    # ... and its number is a step's, not the answer: the last number before it is.
    for text, step in [("Total so far is 18\n#### Step 2", "2"),
                       ("We know 4 boxes.\n#### 3. Compute the total", "3"),
                       ("so 12\n#### Part 1:", "1")]:  # fmt: skip
        assert rewards.math_accuracy(text, step) == 0.0
    assert rewards.extract_answer("Total so far is 18\n#### Step 2") == "18"
    assert rewards.format_reward(r"\boxed{8}" + "\n#### Step 3") == 1.0
    assert rewards.format_reward("work\n#### Part 2:") == 0.0
    assert rewards.extract_answer("work\n#### twelve") == "twelve"  # a text answer stays


@pytest.mark.parametrize(
    "text, gold",
    [
        ("The answer is -$5.", "-5"),
        (r"So the answer is -\$12.50", "-12.5"),
        ("Total = -$7.", "-7"),
        ("so he ends with -$3", "-3"),
    ],
)
def test_a_sign_before_a_dollar_is_kept(text, gold):
    # "-$5" read as 5: a wrong answer scored right against gold 5, a right one wrong.
    stated = "answer" in text.lower() or "=" in text  # the last one is only a last number
    assert rewards.final_answer_accuracy(text, gold) == float(stated)
    assert rewards.math_accuracy(text, gold) == 1.0
    assert rewards.math_accuracy(text, gold.lstrip("-")) == 0.0


def test_score_batch_by_name_with_format_weight():
    completions = [r"\boxed{0.5}", "#### 1,000", "it is 7", r"\boxed{3} \boxed{4}"]
    answers = ["1/2", "1000", "8", "4"]
    result = rewards.score_batch("math_accuracy", completions, answers, format_weight=0.1)
    # accuracy [1, 1, 0, 1(last box)] + 0.1 * format [1, 1, 0, 0].
    np.testing.assert_allclose(result.rewards, [1.1, 1.1, 0.0, 1.0], rtol=1e-6)
    assert result.rewards.dtype == np.float32
    np.testing.assert_array_equal(result.correct, [True, True, False, True])
    assert (result.num_errors, result.num_timeouts) == (0, 0)


def test_score_batch_survives_errors_and_timeouts(caplog):
    release = threading.Event()

    def flaky(completion, answer):
        if completion == "raise":
            raise RuntimeError("bad reward code")
        if completion == "hang":
            release.wait(5.0)  # far past the timeout; released at the end of the test
        if completion == "nan":
            return float("nan")
        return rewards.math_accuracy(completion, answer)

    completions = ["#### 1", "raise", "hang", "#### 2", "nan", "#### 9"]
    answers = ["1", "1", "1", "2", "1", "3"]
    start = time.monotonic()
    result = rewards.score_batch(flaky, completions, answers, timeout_s=0.2)
    elapsed = time.monotonic() - start
    release.set()
    # Samples after the hung one are still scored, by a fresh worker.
    np.testing.assert_array_equal(result.rewards, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(result.correct, [True, False, False, True, False, False])
    assert result.num_errors == 2  # the raise and the NaN
    assert result.first_error.startswith("completion 1: Traceback")
    assert "RuntimeError: bad reward code" in result.first_error
    assert "failed on 2 of 6 completions" in caplog.text and "bad reward code" in caplog.text
    assert result.num_timeouts == 1
    assert elapsed < 2.0, elapsed  # waited ~0.2 s for the hang, not the 5 s it would take


def test_a_timed_out_worker_scores_nothing_after_its_slow_call():
    """Once its slow call returns, the abandoned worker stops: every completion is scored
    exactly once (it used to go on through the rest of the batch, calling the reward function
    again on every completion the fresh worker had scored)."""
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def slow_first(completion, answer):
        with lock:
            calls[completion] = calls.get(completion, 0) + 1
        if completion == "slow":
            time.sleep(0.3)
        return 1.0

    completions = ["slow", "0", "1", "2", "3", "4"]
    result = rewards.score_batch(slow_first, completions, ["1"] * 6, timeout_s=0.1)
    time.sleep(0.5)  # the abandoned worker's call returns meanwhile
    assert result.num_timeouts == 1
    assert calls == dict.fromkeys(completions, 1)


def test_score_batch_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match=r"'nope' is not one of \['final_answer', 'format', 'math_accuracy'\]"
    ):
        rewards.score_batch("nope", ["a"], ["a"])
    with pytest.raises(ValueError, match="len"):
        rewards.score_batch("math_accuracy", ["a", "b"], ["a"])


def test_score_batch_empty():
    result = rewards.score_batch("format", [], [])
    assert result.rewards.shape == (0,) and (result.num_errors, result.num_timeouts) == (0, 0)


@pytest.mark.parametrize("blank", [" ", "\n"])
def test_stated_answer_patterns_are_linear_in_a_run_of_blanks(blank):
    # `\s*\**\s*` after "answer is" backtracked in cubic time: 1,500 blanks took about 30 s
    # inside `re`, which holds the GIL, so `score_batch`'s timeout could not stop it.
    texts = ["The answer is" + blank * 1500 + "unclear", "x =" + " " * 3000 + "y",
             "x = 5" + " " * 3000 + "y", "answer is :" + blank * 3000 + "."]  # fmt: skip
    start = time.monotonic()
    result = rewards.score_batch("final_answer", texts, ["5"] * len(texts), timeout_s=1.0)
    assert time.monotonic() - start < 1.0
    assert result.num_timeouts == 0 and not result.rewards.any()
    # The patterns still take what they took before.
    assert rewards.extract_final_answer("The answer is:  ** 7 **.") == "7"
    assert rewards.extract_final_answer("so 3 + 4 = 7 .") == "7"


@pytest.mark.parametrize(
    "text, gold",
    [
        ("The answer is $42$.", "42"),  # a stated answer in math mode
        ("The answer is $18.", "18"),  # money
        (r"The answer is \$18.", "18"),
        (r"So the answer is \(42\).", "42"),
        ("Total = $7.", "7"),  # a last line ending in = N
        ("#### **42**", "42"),  # markdown bold on the #### line (its format reward is 1)
        (r"\boxed{**-5**}", "-5"),
        ("The answer is \u22127.", "-7"),  # unicode minus
    ],
)
def test_stated_answers_wrapped_in_dollars_bold_or_unicode_minus(text, gold):
    assert rewards.final_answer_accuracy(text, gold) == 1.0
    assert rewards.math_accuracy(text, gold) == 1.0


def test_a_unicode_minus_is_not_dropped_from_the_last_number():
    # The sign used to be lost, so "x = -7" (unicode minus) scored as correct for gold 7.
    assert rewards.extract_answer("so x = \u22127") == "\u22127"
    assert rewards.math_accuracy("so x = \u22127", "7") == 0.0
    assert rewards.math_accuracy("so x = \u22127", "-7") == 1.0


def test_scores_round_trip_exactly_through_json():
    """Process 0's scores reach the other processes as JSON (`Trainer._score`): each process
    scoring against its own clock let a reward near the timeout differ between them."""
    scored = score_batch(lambda c, a: float(c) / 3, ["1", "2", "x"], ["", "", ""],
                         format_weight=0.1)  # fmt: skip
    back = RewardResult.from_json(json.loads(json.dumps(scored.to_json())))
    assert back.rewards.dtype == np.float32 and back.rewards.tobytes() == scored.rewards.tobytes()
    np.testing.assert_array_equal(back.correct, scored.correct)
    assert (back.num_errors, back.num_timeouts, back.first_error) == (
        scored.num_errors,
        scored.num_timeouts,
        scored.first_error,
    )
    assert back.num_errors == 1 and "ValueError" in back.first_error
