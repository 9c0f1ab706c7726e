"""Reward service: the built-in verifiers, the scorer (plain logic), and the gRPC
service on loopback."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rlmesh.common import errors
from rlmesh.common.sample import (
    SampleGroup,
    Status,
)
from rlmesh.reward import verifiers
from rlmesh.reward.config import Settings
from rlmesh.reward.scoring import RewardSpec, Scorer
from rlmesh.reward.verifiers.extraction import last_boxed
from tests.helpers.reward import CUSTOM, GROUP, make_sample

# ---------------------------------------------------------------- verifiers

MATH_CASES = [
    # (response, label, expected)
    (r"So the result is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
    (r"\boxed{\tfrac{6}{8}}", "3/4", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{\$1,000}", "1000", 1.0),
    (r"\boxed{12.0}", "12", 1.0),
    (r"\boxed{5 \text{ dollars}}", "5", 1.0),
    (r"\boxed{\text{5 cm}^2}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{(1,2]}", "(1,2)", 0.0),
    (r"\boxed{(\frac{1}{2}, 3)}", "(0.5, 3)", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt2}", 1.0),
    (r"\boxed{2\pi}", r"2 \pi", 1.0),
    (r"\boxed{2x+1}", "1 + 2x", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\ln x}", r"\log(x)", 1.0),
    (r"\boxed{(x+1)^2}", "x^2 + 2x + 1", 1.0),
    (r"\boxed{(x+1)^{1000}}", "x^{1000} + 1", 0.0),  # decided without a slow symbolic simplify
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),
    (r"first \boxed{4}, then corrected: \boxed{5}", "5", 1.0),  # the last box counts
    (r"\boxed{\boxed{7}}", "7", 1.0),
    (r"\boxed 7", "7", 1.0),
    ("The answer is $42$.", "42", 1.0),
    ("Final answer: 1/2", r"\frac{1}{2}", 1.0),
    ("We get 3 apples, then 4 more: 7", "7", 1.0),  # last number as a last resort
    (r"\boxed{3}", "4", 0.0),
    ("I do not know.", "3", 0.0),  # no answer at all
    ("", "3", 0.0),
    (r"\boxed{9^{9^{9}}}", "1", 0.0),  # a power tower must not hang the verifier
    (r"\boxed{((9^{999})^{999})^{999}}", "5", 0.0),  # nor one built through the base
    (r"\boxed{\frac{1}{x^2}}", r"x^{-2}", 1.0),  # while reciprocals of powers still compare
    (r"\boxed{\frac{1}{(x^2)^{3}}}", r"x^{-6}", 0.0),  # nested powers are not compared (conservative)
    (r"\boxed{().__class__}", "1", 0.0),  # never evaluated as Python
    ("Work... The solution: \\boxed{6}", r"Step 1 ... so \boxed{6}", 1.0),  # label with a worked solution
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math_verifier(response, label, expected):
    assert verifiers.math(response, label, {}) == expected


GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"

GSM8K_CASES = [
    # (response, label, expected)
    ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_SOLUTION, 1.0),  # the dataset's own format
    ("The answer is 72.", GSM8K_SOLUTION, 1.0),
    (r"So she sold \boxed{72} clips.", "72", 1.0),
    ("48 in April and 24 in May, so 72 in total", "72", 1.0),  # the last number as a last resort
    ("The answer is 72 clips, since 48 + 24 = 72.", "72", 1.0),
    ("The answer is: 48 + 24 = 72", "72", 1.0),  # the result of the equation, not its first term
    ("#### 1,000", "1000", 1.0),  # thousands separators
    (r"\boxed{\$1,234.50}", "1234.5", 1.0),  # currency, trailing zero
    ("The answer is $18.", "#### 18", 1.0),
    ("It takes 3.50 hours.", "3.5", 1.0),
    ("72.00", "72", 1.0),
    ("The temperature dropped to −5 degrees", "-5", 1.0),  # a Unicode minus
    ("#### 50%", "50", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    ("The answer is 7. I double-checked with 3 + 4.", "7", 1.0),  # the stated answer beats later numbers
    ("#### 71", GSM8K_SOLUTION, 0.0),
    ("72 clips, but then 70 were returned, so 2", "72", 0.0),  # the final number counts
    ("#### 7\nActually it is 8", "8", 0.0),  # '####' marks the final answer
    ("0.72", "72", 0.0),
    ("1,00", "100", 0.0),  # not a thousands separator
    ("I do not know.", "72", 0.0),  # no number at all
    ("", "72", 0.0),
    (r"\boxed{1e999999999}", "999999999", 0.0),  # never turned into a huge number
]


@pytest.mark.parametrize("response,label,expected", GSM8K_CASES)
def test_gsm8k_verifier(response, label, expected):
    assert verifiers.gsm8k(response, label, {}) == expected


def test_gsm8k_label_must_state_a_number():
    with pytest.raises(ValueError, match="states no final number"):
        verifiers.gsm8k("#### 3", "three apples", {})


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("Paris", "paris", 1.0),
        ("  PARIS \n", "Paris", 1.0),
        ("The answer is Paris.", "Paris", 1.0),
        (r"\boxed{New   York}", "new york", 1.0),
        ("I think it is Paris", "Paris", 0.0),
        ("NYC", '["New York", "NYC"]', 1.0),  # a JSON list of accepted answers
        ("London", "Paris", 0.0),
    ],
)
def test_exact_match(response, label, expected):
    assert verifiers.exact_match(response, label, {}) == expected


def test_f1():
    assert verifiers.f1("the Eiffel Tower", "Eiffel tower", {}) == 1.0
    assert verifiers.f1("Eiffel", "Eiffel Tower", {}) == pytest.approx(2 / 3)
    assert verifiers.f1("London", "Paris", {}) == 0.0
    assert verifiers.f1(r"... \boxed{Eiffel Tower}", '["Louvre", "Eiffel Tower"]', {}) == 1.0


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("The answer is (B).", "B", 1.0),
        ("**C**", "C", 1.0),
        (r"So \boxed{\text{(D)}}", "D. forty-two", 1.0),
        ("Answer: E", "(e)", 1.0),
        ("(A) is wrong, (C) fits", "C", 1.0),
        ("The answer is (B).", "C", 0.0),
        ("the answer is a dog", "A", 0.0),  # an article, not a choice
        ("no idea", "A", 0.0),
    ],
)
def test_multiple_choice(response, label, expected):
    assert verifiers.multiple_choice(response, label, {}) == expected


def test_format():
    assert verifiers.format(r"... \boxed{3}", "", {}) == 1.0
    assert verifiers.format(r"... \boxed{}", "", {}) == 0.0
    assert verifiers.format("3", "", {}) == 0.0


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"\boxed{5}", "5"),
        (r"\boxed{ \frac{1}{2} }", r"\frac{1}{2}"),
        (r"\boxed{a{b{c}}d}", "a{b{c}}d"),  # nested braces
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are literal
        (r"\boxed{x \\} y}", r"x \\"),  # an escaped backslash escapes nothing
        (r"\boxed{1} then \boxed{2}", "2"),  # the last box
        (r"\boxed{2} then \boxed{3", "2"),  # an unclosed last box: the one before it
        (r"\fbox{4}", "4"),
        (r"\boxed{\boxed{7}}", "7"),
        (r"\boxed 9 apples", "9"),
        (r"\boxed {6}", "6"),
        (r"\boxedx{1}", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_adversarial_answers_are_read_in_linear_time():
    """Each of these took minutes or hours (a scan per box, or regex backtracking over every
    split of a run of spaces) before extraction was made linear."""
    unclosed = "\\boxed{" * 50_000
    assert last_boxed(unclosed) is None
    assert last_boxed(r"\boxed{7}" + unclosed) == "7"
    assert verifiers.math(unclosed, "1", {}) == 0.0
    assert last_boxed("\\boxed{" + "{" * 50_000 + "7" + "}" * 50_001) == "{" * 50_000 + "7" + "}" * 50_000
    assert verifiers.math("\\boxed{" + "\\text{" * 50_000 + "7" + "}" * 50_001, "7", {}) == 1.0
    assert verifiers.math(r"\boxed{5." + "0" * 100_000 + "}", "5", {}) == 1.0
    assert verifiers.math(r"\boxed{90^" + " " * 100_000 + "x}", "90", {}) == 0.0
    assert verifiers.multiple_choice("The answer" + " " * 100_000 + "is (B)", "B", {}) == 1.0
    assert verifiers.multiple_choice("answer" + " " * 100_000 + "x", "B", {}) == 0.0
    assert verifiers.exact_match("Answer:" + "\n" * 100_000, "x", {}) == 0.0
    assert verifiers.f1("x", "[" * 100_000, {}) == 0.0  # too deep for JSON: a plain label


def test_missing_label_is_an_error_not_a_zero():
    for name in ("math", "gsm8k", "exact_match", "f1", "multiple_choice"):
        with pytest.raises(ValueError, match="no label"):
            verifiers.VERIFIERS[name](r"\boxed{1}", "  ", {})
    with pytest.raises(ValueError, match="not a choice letter"):
        verifiers.multiple_choice("A", "forty-two", {})


# ---------------------------------------------------------------- scorer (plain logic)


@pytest.fixture
def scorer() -> Scorer:
    return Scorer.from_config({"exact_match": 1.0}, CUSTOM, GROUP)


def test_weighted_sum_of_components(scorer):
    s = make_sample(0, r"\boxed{12}", "12")
    asyncio.run(scorer.score_samples([s], RewardSpec({"math": 1.0, "format": 0.5, "length_bonus": -1.0})))
    assert s.reward_components == {"math": 1.0, "format": 1.0, "length_bonus": 1.0}
    assert s.reward == pytest.approx(0.5)
    assert s.status == Status.COMPLETED


def test_empty_spec_uses_the_defaults(scorer):
    s = make_sample(0, "yes", "YES")
    asyncio.run(scorer.score_samples([s], RewardSpec()))
    assert s.reward_components == {"exact_match": 1.0} and s.reward == 1.0


def test_dict_reward_needs_reward_key(scorer):
    right, wrong = make_sample(0, "it is 7", "7"), make_sample(1, "it is 8", "7")
    asyncio.run(scorer.score_samples([right, wrong], RewardSpec({"contains_label": 2.0}, reward_key="score")))
    assert (right.reward, wrong.reward) == (2.0, 0.0)

    s = make_sample(2, "it is 7", "7")
    asyncio.run(scorer.score_samples([s], RewardSpec({"contains_label": 1.0})))
    assert s.status == Status.FAILED
    assert "set reward_key" in s.metadata["reward_error"]


def test_per_sample_override_through_metadata(scorer):
    by_name = make_sample(0, r"\boxed{0.5}", r"\frac12", metadata={"reward": "math"})
    by_dict = make_sample(1, r"\boxed{B}", "B", metadata={"reward": {"multiple_choice": 3.0}})
    plain = make_sample(2, r"\boxed{0.5}", r"\frac12")
    asyncio.run(scorer.score_samples([by_name, by_dict, plain], RewardSpec({"exact_match": 1.0})))
    assert by_name.reward_components == {"math": 1.0} and by_name.reward == 1.0
    assert by_dict.reward_components == {"multiple_choice": 1.0} and by_dict.reward == 3.0
    assert plain.reward_components == {"exact_match": 0.0}


def test_failing_component_marks_the_sample_failed(scorer):
    ok, bad_label = make_sample(0, r"\boxed{1}", "1"), make_sample(1, r"\boxed{1}", "")
    asyncio.run(scorer.score_samples([ok, bad_label], RewardSpec({"math": 1.0})))
    assert ok.status == Status.COMPLETED and ok.reward == 1.0
    assert bad_label.status == Status.FAILED and bad_label.reward == 0.0
    assert "no label" in bad_label.metadata["reward_error"]

    for name, reason in (
        ("broken", "RuntimeError: the judge is down"),
        ("not_a_number", "returned str"),
        ("huge", "returned 1e+300, outside ±1e+09"),
    ):
        s = make_sample(2, "x", "x")
        asyncio.run(scorer.score_samples([s], RewardSpec({"exact_match": 1.0, name: 1.0})))
        assert s.status == Status.FAILED and reason in s.metadata["reward_error"]
        assert s.reward_components == {"exact_match": 1.0}  # what did work is kept for inspection


def test_a_weighted_total_too_large_to_train_on_marks_the_sample_failed(scorer):
    ok, too_large = make_sample(0, "x", "x"), make_sample(1, "x", "x")
    asyncio.run(scorer.score_samples([ok], RewardSpec({"large": 10.0})))
    assert ok.status == Status.COMPLETED and ok.reward == 1e9
    asyncio.run(scorer.score_samples([too_large], RewardSpec({"large": 11.0})))
    assert too_large.status == Status.FAILED and too_large.reward == 0.0
    assert "the weighted total 1.1e+09 is outside ±1e+09" in too_large.metadata["reward_error"]
    assert too_large.reward_components == {"large": 1e8}  # (kept for inspection)


def test_already_failed_samples_are_left_alone(scorer):
    s = make_sample(0, "", "3")
    s.status, s.metadata = Status.FAILED, {"error": "engine timed out"}
    asyncio.run(scorer.score_samples([s], RewardSpec({"broken": 1.0})))
    assert s.metadata == {"error": "engine timed out"} and s.reward_components == {}


def test_group_functions(scorer):
    group = SampleGroup("g0", 0, [make_sample(i, "x" * (i + 1), "x") for i in range(3)])
    asyncio.run(scorer.score_groups([group], RewardSpec({"shortest": 1.0, "exact_match": 1.0})))
    assert group.rewards == [2.0, 0.0, 0.0]

    group = SampleGroup("g1", 1, [make_sample(i, "x", "x") for i in range(3)])
    asyncio.run(scorer.score_groups([group], RewardSpec({"wrong_length": 1.0})))
    assert all(s.status == Status.FAILED for s in group.samples)
    assert "returned 1 rewards for a group of 3" in group.samples[0].metadata["reward_error"]


def test_bad_specs_are_invalid_arguments(scorer):
    s = make_sample(0, "x", "x")
    with pytest.raises(errors.InvalidArgument, match="unknown reward component 'nope'; known components: .*math"):
        asyncio.run(scorer.score_samples([s], RewardSpec({"nope": 1.0})))
    with pytest.raises(errors.InvalidArgument, match="scores whole groups; call ScoreGroups"):
        asyncio.run(scorer.score_samples([s], RewardSpec({"shortest": 1.0})))
    for weight in (float("nan"), 1e300):
        with pytest.raises(errors.InvalidArgument, match="a number within"):
            asyncio.run(scorer.score_samples([s], RewardSpec({"math": weight})))
    s.metadata["reward"] = ["math"]
    with pytest.raises(errors.InvalidArgument, match=r"sample 0: metadata\['reward'\]"):
        asyncio.run(scorer.score_samples([s], RewardSpec()))
    assert s.reward_components == {}  # nothing was scored


def test_settings_and_loading():
    with pytest.raises(ValidationError, match="built-in verifier"):
        Settings(custom_functions={"math": "tests.helpers.reward:length_bonus"})
    with pytest.raises(ValidationError, match="not an import path"):
        Settings(custom_functions={"mine": "os.system('x')"})
    with pytest.raises(ValidationError, match="unknown component 'mine'"):
        Settings(default_components={"mine": 1.0})
    with pytest.raises(ValidationError, match="cannot import module"):
        Settings(custom_functions={"mine": "no_such_module_xyz:fn"})
    with pytest.raises(ValidationError, match="has no attribute"):
        Settings(group_functions={"mine": f"{__name__}:no_such_function"})


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("RLMESH_REWARD_PORT", "6123")
    monkeypatch.setenv("RLMESH_REWARD_DEFAULT_COMPONENTS", '{"math": 1.0}')
    settings = Settings()
    assert settings.port == 6123 and settings.default_components == {"math": 1.0}


# ---------------------------------------------------------------- the gRPC service on loopback
