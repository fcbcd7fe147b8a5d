"""The README's quick-start examples, run as written against `moe-serve` with no flags (the demo
model at its own sampling defaults), on the port the test picked instead of 8000.

The demo samples (temperature 0.2, from its generation_config.json), so each example runs
five times and a majority of the answers must be right; bench/RESULTS.md has the measured rate.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server.testing import RemoteServer

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
RUNS = 5  # a majority must be right: at the measured 96% a wrong majority of 5 is ~0.06% (of 3 it was ~0.5%)
MAJORITY = RUNS // 2 + 1
FRUITS = ("apple", "banana", "orange", "grape", "mango", "pear", "strawberr", "cherr", "peach", "pineapple",
          "lemon", "kiwi", "watermelon", "blueberr", "plum")


def readme_block(language: str, must_contain: str) -> str:
    """The first fenced `language` block of the README holding `must_contain` (the quick start's)."""
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if must_contain in b)


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([], ready_timeout=1200)  # as the quick start: `moe-serve`, nothing else
    with srv:
        yield srv


def on_port(example: str, port: int) -> str:
    assert "8000" in example
    return example.replace("8000", str(port))


def test_the_curl_example_answers_the_question(server):
    command = on_port(readme_block("bash", "curl -s localhost:8000/v1/chat/completions"), server.port)
    answers = []
    for _ in range(RUNS):
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600, check=True).stdout
        answers.append(json.loads(out)["choices"][0]["message"]["content"])
    assert sum("Paris" in a for a in answers) >= MAJORITY, answers


def test_the_openai_sdk_example_streams_a_list_of_three_fruits(server):
    script = on_port(readme_block("python", "from openai import OpenAI"), server.port)
    answers = []
    for _ in range(RUNS):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
        answers.append(out.stdout)
    named = [sum(fruit in a.lower() for fruit in FRUITS) for a in answers]
    assert sum(n >= 3 for n in named) >= MAJORITY, answers
