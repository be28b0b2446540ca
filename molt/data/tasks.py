"""Built-in tasks: generated prompt rows, demonstrations for SFT, and graders.

A task is a registered class with `rows(n, seed)` (dataset rows: `messages`, `label`), an SFT `demonstration(row, rng)`
(the row's messages plus assistant turns), and `grade(row, text)` in [0, 1]. Tasks are generated from a seed, so nothing
is downloaded and every machine sees the same data. Knows nothing about models or training."""

from __future__ import annotations

import random
import re
from typing import Any

from molt.data.formats import Row
from molt.registry import Registry

TASKS: Registry[type] = Registry("task")  # task classes by their `--data.task` name


class SeededTask:
    """What the built-in tasks share: `rows` draws each row (`row(rng)`) from one seeded generator; `grade` is
    an exact match of the stripped completion with the row's `label`."""

    env: str  # name of the built-in Env that runs it (molt/agents/builtin.py)

    def rows(self, n: int, seed: int) -> list[Row]:
        rng = random.Random(seed)
        return [self.row(rng) for _ in range(n)]

    def grade(self, row: Row, text: str) -> float:
        return float(text.strip() == row["label"])

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]:
        """The row's messages answered with its `label`."""
        return row["messages"] + [{"role": "assistant", "content": row["label"]}]


def get_task(name: str) -> SeededTask:
    """Instantiate built-in task `name`; unknown names are an error listing the choices."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]()


@TASKS.register("arithmetic")
class Arithmetic(SeededTask):
    """Single-turn sums of a 2-digit and a 1-digit number; the answer is the number alone."""

    env = "single_turn"

    def row(self, rng: random.Random) -> Row:
        a, b = rng.randint(10, 99), rng.randint(0, 9)
        return {"messages": [{"role": "user", "content": f"{a}+{b}="}], "label": str(a + b)}


TOOL_CALL = "<tool_call>{}</tool_call>"


def calculate(expression: str) -> str:
    """The calculator tool: `a op b` with non-negative integers and op in + - *; else an error text."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*([+\-*])\s*(\d{1,6})\s*", expression)
    if not m:
        return "error"
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


@TASKS.register("calculator")
class Calculator(SeededTask):
    """Multi-turn tool use: products of a 2-digit and a 3-digit number, with a calculator tool.

    The policy calls the tool as `<tool_call>347*29</tool_call>`, receives the result as a tool
    message, then answers with the number. The tiny model cannot multiply in its head, so the
    reward (exact final answer) needs the tool. Demonstrations are deliberately imperfect: some
    answer without the tool (a guess) and some mistype an operand in the call."""

    env = "calculator"
    demo_mix = (0.5, 0.25, 0.25)  # correct tool use, direct guess, mistyped tool call

    def row(self, rng: random.Random) -> Row:
        a, b = rng.randint(10, 99), rng.randint(100, 999)
        return {"messages": [{"role": "user", "content": f"{a}*{b}="}], "label": str(a * b), "a": a, "b": b}

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]:
        kind = rng.choices(["tool", "guess", "typo"], weights=self.demo_mix)[0]
        if kind == "guess":
            guess = str(int(row["label"]) + rng.choice([-1, 1]) * rng.randint(1, 500))
            return row["messages"] + [{"role": "assistant", "content": guess}]
        a, b = row["a"], row["b"]
        if kind == "typo":
            b = b + rng.choice([-1, 1]) * rng.randint(1, 9)
        value = calculate(f"{a}*{b}")
        return row["messages"] + [
            {"role": "assistant", "content": TOOL_CALL.format(f"{a}*{b}")},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]


COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (40, 60, 230), "yellow": (230, 210, 30)}


def shape_image(colour: str, rng: random.Random, size: int = 32) -> str:
    """A PNG data URI: one filled square or disc of `colour` at a random place on a grey background."""
    from PIL import Image, ImageDraw

    from molt.models.vision import image_data_uri

    image = Image.new("RGB", (size, size), (128, 128, 128))
    side = rng.randint(size // 3, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    draw = ImageDraw.Draw(image)
    box = (x, y, x + side - 1, y + side - 1)
    (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    return image_data_uri(image)  # a PIL image: PNG


@TASKS.register("shape_colour")
class ShapeColour(SeededTask):
    """Visual (needs a VLM, e.g. `--model.preset tiny-vlm`): name the colour of the shape in the image.

    Rows hold the image as a PNG data URI in an image content part. Without looking, the reward is
    1/4. Demonstrations are deliberately noisy (only `demo_correct` of them name the right colour),
    so the warm start reads the image only partly and RL has a visual signal to learn from."""

    env = "single_turn"
    demo_correct = 0.4

    def row(self, rng: random.Random) -> Row:
        colour = rng.choice(sorted(COLOURS))
        content = [{"type": "image", "image": shape_image(colour, rng)}, {"type": "text", "text": "Colour?"}]
        return {"messages": [{"role": "user", "content": content}], "label": colour}

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]:
        answer = row["label"] if rng.random() < self.demo_correct else rng.choice(sorted(COLOURS))
        return row["messages"] + [{"role": "assistant", "content": answer}]


NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena",
         "Mateo", "Nora")  # fmt: skip
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "eggs", "balloons")
PLACES = ("the market", "a shop", "the fair", "school", "the library sale")
Problem = tuple[str, list[str], int]  # (question, worked steps, integer answer)


def _add(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    a, b = rng.randint(2, 20), rng.randint(2, 10)
    more = f"{name} has {a} {item}. At {rng.choice(PLACES)}, {name} gets {b} more. How many {item} does {name} have?"
    together = f"{name} collected {a} {item} and {friend} collected {b}. How many {item} did they collect together?"
    return rng.choice([more, together]), [f"{a} + {b} = {a + b}"], a + b


def _take_away(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    a = rng.randint(5, 20)
    b = rng.randint(1, a - 1)
    gave = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?"
    took = f"There were {a} {item} in a box. {name} took out {b}. How many {item} are still in the box?"
    return rng.choice([gave, took]), [f"{a} - {b} = {a - b}"], a - b


def _groups(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    a, b = rng.randint(2, 6), rng.randint(2, 6)
    bags = f"{name} buys {a} bags of {item}. Each bag holds {b} {item}. How many {item} does {name} buy in all?"
    rows = f"{name} puts {item} into {a} rows with {b} in each row. How many {item} are there?"
    return rng.choice([bags, rows]), [f"{a} * {b} = {a * b}"], a * b


def _share(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    each, people = rng.randint(2, 6), rng.randint(2, 5)
    total = each * people
    text = f"{name} shares {total} {item} equally among {people} friends. How many {item} does each friend get?"
    return text, [f"{total} / {people} = {each}"], each


def _change(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    price, count = rng.randint(1, 5), rng.randint(2, 4)
    cost = price * count
    bill = rng.choice([b for b in (10, 20, 50) if b > cost])
    text = (
        f"One notebook costs ${price}. {name} buys {count} notebooks and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get?"
    )
    return text, [f"{count} * {price} = {cost}", f"{bill} - {cost} = {bill - cost}"], bill - cost


def _rate_then_extra(rng: random.Random, name: str, friend: str, item: str) -> Problem:
    per_day, days, extra = rng.randint(2, 6), rng.randint(2, 4), rng.randint(1, 10)
    text = (
        f"{name} reads {per_day} pages every day for {days} days, then reads {extra} more pages on the weekend. "
        f"How many pages does {name} read in total?"
    )
    read = per_day * days
    return text, [f"{per_day} * {days} = {read}", f"{read} + {extra} = {read + extra}"], read + extra


GSM_SHAPES = (_add, _take_away, _groups, _share, _change, _rate_then_extra)


@TASKS.register("gsm")
class GradeSchoolMath(SeededTask):
    """Single-turn grade-school math word problems with integer answers (one or two steps, `GSM_SHAPES`).

    Rows carry the reference in `answer` (and `label`), so the built-in `math` reward (`--rollout.reward math`)
    checks answers numerically; the task's own grade reads the completion's last number. Demonstrations (the
    `solution` column) show the arithmetic, then `\\boxed{N}`."""

    env = "single_turn"
    instruction = "Give the final answer as a number."

    def row(self, rng: random.Random) -> Row:
        name, friend = rng.sample(NAMES, 2)
        text, steps, answer = rng.choice(GSM_SHAPES)(rng, name, friend, rng.choice(ITEMS))
        solution = ". ".join(steps) + f". The answer is \\boxed{{{answer}}}."
        messages = [{"role": "user", "content": f"{text}\n{self.instruction}"}]
        return {"messages": messages, "answer": str(answer), "label": str(answer), "solution": solution}

    def demonstration(self, row: Row, rng: random.Random) -> list[dict[str, Any]]:
        return row["messages"] + [{"role": "assistant", "content": row["solution"]}]

    def grade(self, row: Row, text: str) -> float:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        return float(bool(numbers) and float(numbers[-1]) == float(row["answer"]))
