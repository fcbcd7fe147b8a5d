"""How often the README's quick-start questions get a right answer from the demo model at its defaults.

    python -m bench.readme_answers [--runs 10]

Each question goes through the engine as the README sends it (chat template, the model's
own sampling defaults from generation_config.json, no max_tokens), `--runs` times.
"""

from __future__ import annotations

import argparse
import json

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from tests.test_readme_examples import FRUITS

QUESTIONS = {
    "What is the capital of France?": lambda answer: "Paris" in answer,
    "What are three common fruits?": lambda answer: sum(fruit in answer.lower() for fruit in FRUITS) >= 3,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    engine = Engine.load(EngineConfig())
    results = {}
    for question, right in QUESTIONS.items():
        ids = engine.apply_chat_template([{"role": "user", "content": question}])
        answers = []
        for i in range(args.runs):
            events = engine.generate(GenerationRequest(f"r{i}", ids, SamplingParams(**engine.sampling_defaults)))
            answers.append("".join(event.text for event in events))
        results[question] = {"right": sum(map(right, answers)), "runs": args.runs,
                             "tokens_max": max(len(engine.encode(a)) for a in answers)}
    engine.close()
    print(json.dumps({"defaults": engine.sampling_defaults, "results": results}, indent=1))


if __name__ == "__main__":
    main()
