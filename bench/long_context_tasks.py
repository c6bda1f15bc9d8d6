"""A long-context task suite in the style of RULER (Hsieh et al., 2024),
generated here (no download): every case is a chat prompt of a given length
whose answer is written somewhere in a long, uninformative text.

* ``niah_single``: one 5-digit pass key hidden in filler (after Mohtashami &
  Jaggi's pass-key test, the form RULER's single needle takes);
* ``niah_multikey``: four "special magic numbers", each for another word; the
  question asks for one of them (the other three are distractors);
* ``niah_multivalue``: one word with two magic numbers at two depths; both must
  be answered;
* ``niah_multiquery``: four words with their numbers; the question asks for
  two of them;
* ``variable_tracking``: ``VAR X = 12345`` and a chain of two assignments
  ``VAR Y = VAR X`` scattered through the filler; every variable holding the
  value must be named.

Needles sit at depths spread evenly over the text (case ``i`` of ``n``), the
values come from a seeded generator, and the prompt is plain text (Mohtashami
& Jaggi's instruction, the filler, the question) cut to the requested number
of tokens with the model's own tokenizer; the answer starts with a prefix the
prompt already holds ("The pass key is"), so a greedy continuation is scored
as RULER scores it: the share of the expected values that appear in it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
WORDS = ["apple", "river", "candle", "forest", "violin", "harbor", "pepper", "lantern", "meadow", "copper",
         "falcon", "glacier", "orchid", "saddle", "thunder", "walnut", "ember", "quartz", "tulip", "canyon"]
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")


@dataclass
class Case:
    task: str
    length: int            # the prompt length asked for (tokens)
    tokens: int            # the prompt's length (tokens), at most ``length``
    depth: float           # where the (first) needle sits, as a share of the filler
    prompt_ids: list[int]
    answers: list[str]     # the values the output must hold

    def score(self, output: str) -> float:
        """RULER's string match: the share of the expected values found in the output."""
        return sum(a in output for a in self.answers) / len(self.answers)


def _number(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _var(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _needles(task: str, rng: random.Random) -> tuple[list[str], str, str, list[str]]:
    """(needle sentences in order of depth, question, answer prefix, answers)."""
    if task == "niah_single":
        key = _number(rng)
        return ([f"The pass key is {key}. Remember it. {key} is the pass key. "],
                "What is the pass key?", "The pass key is", [key])
    if task == "niah_multivalue":
        word, values = rng.choice(WORDS), [_number(rng) for _ in range(2)]
        return ([f"One of the special magic numbers for {word} is: {v}. " for v in values],
                f"What are all the special magic numbers for {word}?",
                f"The special magic numbers for {word} are", values)
    if task == "variable_tracking":
        value, names = _number(rng), [_var(rng) for _ in range(3)]
        chain = [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
        return (chain, f"Find all variables that are assigned the value {value} in the text above.",
                f"According to the chain of variable assignments in the text above, {len(names)} variables are "
                f"assigned the value {value}, they are:", names)
    words = rng.sample(WORDS, 4)
    values = [_number(rng) for _ in words]
    needles = [f"One of the special magic numbers for {w} is: {v}. " for w, v in zip(words, values)]
    if task == "niah_multikey":
        i = rng.randrange(4)
        return (needles, f"What is the special magic number for {words[i]}?",
                f"The special magic number for {words[i]} is", [values[i]])
    if task == "niah_multiquery":
        i, j = sorted(rng.sample(range(4), 2))
        return (needles, f"What are the special magic numbers for {words[i]} and {words[j]}?",
                f"The special magic numbers for {words[i]} and {words[j]} are", [values[i], values[j]])
    raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")


def make_case(tokenizer, task: str, tokens: int, index: int, cases: int, seed: int = 0) -> Case:
    """Case ``index`` of ``cases`` of ``task``, ``tokens`` tokens long (chat template
    included), its (first) needle at depth ``(index + 0.5) / cases``."""
    rng = random.Random(f"{seed}/{task}/{tokens}/{index}")
    needles, question, prefix, answers = _needles(task, rng)
    depth = (index + 0.5) / cases
    # the other needles spread over the rest of the text, in order
    depths = sorted([depth] + [rng.random() for _ in needles[1:]])

    def build(n_filler: int) -> list[int]:
        units = [FILLER] * n_filler
        for d, needle in reversed(list(zip(depths, needles))):
            units.insert(round(d * n_filler), needle)
        text = (INTRO + "".join(units) + "\n" + question + " " + prefix)
        return tokenizer(text)["input_ids"]

    base = len(build(0))
    per_unit = (len(build(64)) - base) / 64            # units merge at their seams: measure them in a row
    n = max(1, int((tokens - base) / per_unit))
    while len(build(n + 1)) <= tokens:
        n += 1
    while n > 1 and len(build(n)) > tokens:
        n -= 1
    ids = build(n)
    return Case(task, tokens, len(ids), depth, ids, answers)


def suite(tokenizer, tasks: list[str], lengths: list[int], cases: int, seed: int = 0) -> list[Case]:
    return [make_case(tokenizer, task, length, i, cases, seed)
            for task in tasks for length in lengths for i in range(cases)]
