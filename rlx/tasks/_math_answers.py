"""Final-answer extraction from model text and numeric comparison.

Extraction order: the first source PRESENT in the text decides (a marker that
holds no readable number gives None, never a number from elsewhere):

  1. "####": the first number after the LAST "####" (GSM8K's answer marker,
     https://github.com/openai/grade-school-math), e.g. "#### 1,234".
  2. "boxed": the LAST `\\boxed{...}` / `\\fbox{...}` (MATH / Qwen-Math / R1
     prompts), braces matched, LaTeX fractions `\\frac{a}{b}` read as a/b,
     `\\$`, `\\%`, `\\text{...}`, `\\!`, `\\,` dropped; the whole content if it
     is one number, else its last number; None if LaTeX commands remain
     (e.g. `\\sqrt`), since the value is then not a plain number.
  3. "last_number": the last number anywhere in the text (verl's "flexible"
     GSM8K rule, verl/utils/reward_score/gsm8k.py).

Numbers: optional sign, comma-grouped thousands ("1,234,567"), decimals
("3.50", ".5"), fractions ("3/4"); "$" and "%" around them are ignored. Values
are exact `fractions.Fraction`s, and `numbers_match` compares them with a
relative/absolute tolerance (exact for integers and fractions).
"""

import fractions
import re
from typing import NamedTuple

ANSWER_SOURCES = ("####", "boxed", "last_number")

# A minus is a sign unless it follows a word character or a closing bracket
# ("10-2" is two numbers, 10 and 2; "x = -2" is -2).
_NUMBER = re.compile(
  r"(?:(?<![\w)\]}])-)?(?<![\d.])"
  r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
  r"(?:/\d+(?:\.\d+)?)?"
)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


class ExtractedAnswer(NamedTuple):
  """A final answer found in a text.

  Attributes:
    text: the number as written (e.g. "1,234" or "3/4").
    value: its exact value.
    source: where it was found, one of `ANSWER_SOURCES`.
  """

  text: str
  value: fractions.Fraction
  source: str


def _numbers(text: str) -> list[tuple[str, fractions.Fraction]]:
  out = []
  for match in _NUMBER.finditer(text):
    raw = match.group(0)
    value = parse_number(raw)
    if value is not None:
      out.append((raw, value))
  return out


def parse_number(text: str) -> fractions.Fraction | None:
  """The exact value of one number written as text, or None.

  Accepts "42", "-7", "+3", "1,234", "3.50", ".5", "3/4", "$18", "50%",
  surrounded by spaces; anything else (words, two numbers, "1/0") is None.
  """
  if not isinstance(text, str):
    raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
  s = text.strip().replace("\\$", "").replace("\\%", "").strip("$% ")
  if s.startswith("+"):
    s = s[1:]
  if not s or not re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?", s):
    return None
  if not any(c.isdigit() for c in s.split("/")[0]):
    return None
  s = s.replace(",", "")
  try:
    if "/" in s:
      numerator, denominator = s.split("/")
      return fractions.Fraction(numerator) / fractions.Fraction(denominator)
    return fractions.Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def _boxed_contents(text: str) -> list[str]:
  """Contents of every `\\boxed{...}` (nested braces matched) or `\\boxed 5`."""
  out = []
  for match in _BOX.finditer(text):
    start = match.end()
    if start < len(text) and text[start] == "{":
      depth = 0
      for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
          out.append(text[start + 1 : end])
          break
    else:
      word = re.match(r"[^\s$]+", text[start:])
      if word:
        out.append(word.group(0))
  return out


def _frac(match: re.Match) -> str:
  numerator, denominator = parse_number(match.group(1)), parse_number(match.group(2))
  if numerator is None or denominator is None or denominator == 0:
    return f"({match.group(1)})/({match.group(2)})"
  value = numerator / denominator
  return (
    str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
  )


def _clean_latex(text: str) -> str:
  for token in ("\\!", "\\,", "\\;", "\\left", "\\right"):
    text = text.replace(token, "")
  for token in ("\\ ", "\\$", "\\%", "^\\circ", "^{\\circ}"):
    text = text.replace(token, " ")
  previous = None
  while previous != text:  # innermost first: \frac{\frac{1}{2}}{3} -> \frac{1/2}{3} -> 1/6
    previous = text
    text = _FRAC.sub(_frac, text)
    text = _TEXT.sub(lambda m: m.group(1), text)
  return text.strip()


def _from_boxed(content: str) -> tuple[str, fractions.Fraction] | None:
  cleaned = _clean_latex(content)
  if "\\" in cleaned:
    return None
  value = parse_number(cleaned)
  if value is not None:
    return cleaned, value
  numbers = _numbers(cleaned)
  return numbers[-1] if numbers else None


def extract_answer(
  text: str, *, sources: tuple[str, ...] = ANSWER_SOURCES
) -> ExtractedAnswer | None:
  """The final numeric answer of `text`, trying `sources` in order.

  Args:
    text: a model completion or a reference solution.
    sources: the sources to try, in priority order, a subsequence of
      `ANSWER_SOURCES` (e.g. `("####",)` for strict GSM8K format).

  Returns:
    The answer of the first source present in `text`, or None when no source
    is present or the present one holds no readable number.
  """
  if not isinstance(text, str):
    raise ValueError(f"`text` must be a str, got {type(text).__name__}.")
  unknown = [s for s in sources if s not in ANSWER_SOURCES]
  if unknown or isinstance(sources, str):
    raise ValueError(f"`sources` must be a tuple of {ANSWER_SOURCES}, got {sources!r}.")
  for source in sources:
    if source == "####" and "####" in text:
      line = text.rsplit("####", 1)[1].split("\n", 1)[0]
      numbers = _numbers(line.replace("\\$", " ").replace("$", " "))
      found = numbers[0] if numbers else None
    elif source == "boxed" and _BOX.search(text):
      contents = _boxed_contents(text)
      found = _from_boxed(contents[-1]) if contents else None
    elif source == "last_number":
      numbers = _numbers(text)
      found = numbers[-1] if numbers else None
    else:
      continue
    return None if found is None else ExtractedAnswer(text=found[0], value=found[1], source=source)
  return None


def numbers_match(
  prediction: fractions.Fraction | float | int | str | None,
  reference: fractions.Fraction | float | int | str | None,
  *,
  rtol: float = 1e-6,
  atol: float = 1e-9,
) -> bool:
  """Whether two numbers agree: `|p - r| <= atol + rtol * |r|` (exact when both tolerances are 0).

  Strings are read with `parse_number`; None or an unreadable string never matches.
  """
  if rtol < 0 or atol < 0:
    raise ValueError(f"`rtol` and `atol` must be >= 0, got {rtol=} {atol=}.")
  values = []
  for x in (prediction, reference):
    if isinstance(x, str):
      x = parse_number(x)
    if x is None or isinstance(x, bool):
      return False
    try:
      values.append(fractions.Fraction(x))
    except (TypeError, ValueError, OverflowError):  # nan / inf / not a number
      return False
  p, r = values
  return abs(p - r) <= fractions.Fraction(atol) + fractions.Fraction(rtol) * abs(r)
