"""Final-answer extraction table and the numeric checker."""

import fractions

import pytest

from rlx import tasks

F = fractions.Fraction

EXTRACTION = [
  # text, expected value (None: no answer), source
  ("#### 72", F(72), "####"),
  ("She sold 48/2 = 24 clips.\n#### 1,234", F(1234), "####"),
  ("#### $18 dollars\nsome later text 5", F(18), "####"),
  ("#### -5", F(-5), "####"),
  ("#### 3.50", F(7, 2), "####"),
  ("#### 3/4", F(3, 4), "####"),
  ("first #### 1 then #### 2", F(2), "####"),  # the last marker
  ("#### no number here", None, "####"),  # a marker without a number decides: None
  ("\\boxed{5} and later #### 6", F(6), "####"),  # "####" outranks \boxed
  ("The answer is \\boxed{72}.", F(72), "boxed"),
  ("\\boxed{1} then \\boxed{2}", F(2), "boxed"),  # the last box
  ("\\boxed{\\frac{3}{4}}", F(3, 4), "boxed"),
  ("\\boxed{-\\dfrac{1}{2}}", F(-1, 2), "boxed"),
  ("\\boxed{\\frac{\\frac{1}{2}}{3}}", F(1, 6), "boxed"),
  ("\\boxed{\\$18.00}", F(18), "boxed"),
  ("\\boxed{18 \\text{ dollars}}", F(18), "boxed"),
  ("\\boxed{1\\,234}", F(1234), "boxed"),
  ("\\boxed{50\\%}", F(50), "boxed"),
  ("\\boxed{x = 5}", F(5), "boxed"),
  ("\\boxed 7 is it", F(7), "boxed"),
  ("\\fbox{9}", F(9), "boxed"),
  ("\\boxed{\\frac{\\sqrt{2}}{2}} 2", None, "boxed"),  # not a plain number
  ("\\boxed{1/0} 7", None, "boxed"),
  ("so 10-2=8", F(8), "last_number"),
  ("x = -2.5 then", F(-5, 2), "last_number"),
  ("answer 3/4 or 0.75.", F(3, 4), "last_number"),
  ("12,345,678 apples", F(12345678), "last_number"),
  ("1,2345", F(2345), "last_number"),  # not a thousands group
  ("(1,2)", F(2), "last_number"),
  ("costs $1,234.56 total", F(123456, 100), "last_number"),
  ("it is .5", F(1, 2), "last_number"),
  ("v1.2.3", F(6, 5), "last_number"),
  ("no numbers", None, None),
  ("", None, None),
]


@pytest.mark.parametrize("text, value, source", EXTRACTION)
def test_extract_answer_table(text, value, source):
  found = tasks.extract_answer(text)
  if value is None:
    assert found is None
  else:
    assert found is not None and found.value == value and found.source == source
    assert tasks.parse_number(found.text) == value


def test_sources_restrict_the_search():
  text = "we get 41 and \\boxed{42}"
  assert tasks.extract_answer(text, sources=("####",)) is None
  assert tasks.extract_answer(text, sources=("last_number",)).value == 42  # "42}" -> 42
  assert tasks.extract_answer("we get 41", sources=("####", "boxed")) is None
  assert tasks.extract_answer("we get 41", sources=("last_number",)).value == 41
  with pytest.raises(ValueError, match="sources"):
    tasks.extract_answer(text, sources=("regex",))
  with pytest.raises(ValueError, match="sources"):
    tasks.extract_answer(text, sources="boxed")
  with pytest.raises(ValueError, match="str"):
    tasks.extract_answer(42)


@pytest.mark.parametrize(
  "text, value",
  [
    ("42", F(42)),
    (" -7 ", F(-7)),
    ("+3", F(3)),
    ("1,234", F(1234)),
    ("3.50", F(7, 2)),
    (".5", F(1, 2)),
    ("3/4", F(3, 4)),
    ("-3/4", F(-3, 4)),
    ("$18", F(18)),
    ("50%", F(50)),
    ("1/0", None),
    ("12,34", None),
    ("forty", None),
    ("1 2", None),
    ("-", None),
    ("", None),
  ],
)
def test_parse_number(text, value):
  assert tasks.parse_number(text) == value


def test_numbers_match():
  assert tasks.numbers_match("0.75", "3/4")
  assert tasks.numbers_match("1,000", 1000.0)
  assert tasks.numbers_match(F(1, 3), "1/3", rtol=0, atol=0)
  assert not tasks.numbers_match(0.333, "1/3")
  assert tasks.numbers_match(0.333, "1/3", rtol=1e-2)
  assert tasks.numbers_match(1 + 1e-9, 1)
  assert not tasks.numbers_match(1.01, 1)
  assert tasks.numbers_match(-2, "-2") and not tasks.numbers_match(-2, "2")
  assert tasks.numbers_match(0, "0") and tasks.numbers_match(1e-12, 0)
  for bad in (float("nan"), float("inf"), None, "abc", True):
    assert not tasks.numbers_match(bad, 1)
  with pytest.raises(ValueError, match="rtol"):
    tasks.numbers_match(1, 1, rtol=-1)
