"""A varied prompt set for recording routing traces: chat, code, maths, several languages.

Each prompt is (kind, text). The kinds matter: requests of one kind should route alike,
which is what the EAMC learns. `prompts(n, seed)` samples a deterministic mix.
"""

from __future__ import annotations

import random

TOPICS = [
    "the water cycle", "black holes", "the French Revolution", "photosynthesis", "the stock market",
    "machine learning", "the Roman Empire", "climate change", "vaccines", "the printing press",
    "volcanoes", "jazz music", "the human heart", "electric cars", "the Great Wall of China",
    "honey bees", "quantum computers", "the Olympic Games", "coffee", "the internet",
]  # fmt: skip
CHAT = [
    "Explain {t} to a ten-year-old.",
    "What are three surprising facts about {t}?",
    "Write a short poem about {t}.",
    "Give me a one-paragraph summary of {t}.",
    "What is the history of {t}?",
    "Why does {t} matter today?",
]
CODE = [
    "Write a Python function that returns the {n}th Fibonacci number.",
    "Write a Python function that checks whether a string of length {n} is a palindrome.",
    "Write a JavaScript function that sorts an array of {n} numbers.",
    "Explain what this code does: `sum(x * x for x in range({n}))`",
    "Write a SQL query that selects the top {n} customers by total sales.",
    "Write a bash command that finds files larger than {n} MB.",
    "Fix the bug: `def mean(xs): return sum(xs) / len(xs) + {n}`",
]
MATH = [
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "Solve for x: {a}x + {b} = 0.",
    "Is {a} a prime number? Explain.",
    "What is {a}% of {b}?",
    "A train travels {a} km in {b} hours. What is its average speed?",
]
LANGUAGES = [
    "Quelle est la capitale de la France ?",
    "Explique-moi {t} en quelques phrases.",
    "¿Cuál es la montaña más alta del mundo?",
    "Explícame {t} de forma sencilla.",
    "Was ist die Hauptstadt von Deutschland?",
    "Erkläre mir {t} in einfachen Worten.",
    "Qual è il fiume più lungo d'Italia?",
    "Translate to Spanish: 'The weather is nice today.'",
    "Translate to German: 'I would like a cup of tea, please.'",
    "日本の首都はどこですか？",
    "请用简单的话解释{t}。",
]
SIMPLE_QA = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "What is the boiling point of water in Celsius?",
    "Name three fruits.",
    "What is the largest planet in our solar system?",
]


def prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    makers = {
        "chat": lambda: rng.choice(CHAT).format(t=rng.choice(TOPICS)),
        "code": lambda: rng.choice(CODE).format(n=rng.randint(3, 50)),
        "math": lambda: rng.choice(MATH).format(a=rng.randint(2, 999), b=rng.randint(2, 999)),
        "language": lambda: rng.choice(LANGUAGES).format(t=rng.choice(TOPICS)),
        "qa": lambda: rng.choice(SIMPLE_QA),
    }
    kinds = list(makers)
    return [(kind, makers[kind]()) for kind in (rng.choice(kinds) for _ in range(n))]
