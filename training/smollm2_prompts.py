"""Chat prompts for distilling a SmolLM2 draft: templates over topics, and code tasks over stdlib functions.

Every prompt is made deterministically from the lists below and the training split of the standard
library (training/corpus.py). A prompt whose text hashes into bucket 0 of 10 is held out: never trained
on, used only to measure acceptance. The bench's own chat prompts (bench/smollm2_c1.py) are written
differently and are not among these.
"""

from __future__ import annotations

import hashlib
import random
import re

from training.corpus import SourceFile

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "compound interest",
    "machine learning", "the immune system", "climate change", "the printing press", "plate tectonics",
    "democracy", "the stock market", "vaccines", "the internet", "renewable energy", "the Roman Empire",
    "DNA", "gravity", "inflation", "the human heart", "volcanoes", "electric cars", "coffee", "sleep",
    "meditation", "recycling", "the moon", "earthquakes", "bees", "the piano", "chess", "marathon training",
    "sourdough bread", "public speaking", "time management", "budgeting", "learning a language",
    "the Renaissance", "quantum computing", "encryption", "operating systems", "databases", "cloud computing",
    "version control", "unit testing", "recursion", "sorting algorithms", "binary search", "linked lists",
    "hash functions", "neural networks", "the speed of light", "rainbows", "tides", "the seasons",
    "dinosaurs", "the Great Wall of China", "the Olympic Games", "jazz", "impressionist painting",
    "gardening", "composting", "first aid", "healthy eating", "job interviews", "writing a resume",
    "remote work", "electricity", "magnets", "batteries", "solar panels", "airplanes", "rockets",
    "the Amazon rainforest", "deserts", "coral reefs", "whales", "honey", "tea", "chocolate",
    "photography", "film making", "podcasts", "social media", "privacy online", "passwords",
    "open source software", "the Python language", "JavaScript", "regular expressions", "HTTP",
    "memory management", "concurrency", "APIs", "microservices", "caching", "compilers", "spreadsheets",
    "statistics", "probability", "prime numbers", "geometry", "calculus", "the Pythagorean theorem",
    "fractions", "negotiation", "friendship", "motivation", "habits", "procrastination", "travel packing",
    "camping", "cycling", "swimming", "yoga", "houseplants", "pets", "dogs", "cats", "birds", "the ocean",
    "mountains", "rivers", "maps", "libraries", "museums", "poetry", "novels", "fairy tales", "mythology",
)

TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a few sentences.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t} for a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} briefly.",
    "List five questions a student might ask about {t}.",
    "How would you explain {t} to a friend who has never heard of it?",
    "Give me some practical tips related to {t}.",
    "Write a four-line poem about {t}.",
    "What are common misconceptions about {t}?",
    "Describe {t} in one sentence, then in one paragraph.",
    "Why does {t} matter in everyday life?",
    "Create a short quiz with three questions about {t}, with answers.",
)

CODE_TASKS = (
    "Explain what this Python function does.",
    "Add type hints to this code and return the whole code.",
    "Add a docstring to this function and return the whole code.",
    "Rename the variables in this code to clearer names and return the whole code.",
    "Find a possible bug in this code, if any, and explain it.",
    "Rewrite this function to be shorter.",
    "Write a unit test for this function.",
)

_DEF = re.compile(r"^def \w+\(.*", re.M)


def _functions(f: SourceFile, max_lines: int = 14) -> list[str]:
    """Top-level functions of a file that are 3 to max_lines lines long, as text."""
    lines = f.text.splitlines()
    out = []
    for m in _DEF.finditer(f.text):
        start = f.text.count("\n", 0, m.start())
        end = start + 1
        while end < len(lines) and (not lines[end] or lines[end].startswith((" ", "\t"))):
            end += 1
        body = "\n".join(lines[start:end]).rstrip()
        if 3 <= body.count("\n") + 1 <= max_lines:
            out.append(body + "\n")
    return out


def held_out(prompt: str) -> bool:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 10 == 0


def build(files: list[SourceFile], seed: int, code_prompts: int) -> list[str]:
    """Every template over every topic, and `code_prompts` code tasks over stdlib functions, shuffled."""
    rng = random.Random(seed)
    prompts = [tpl.format(t=topic) for tpl in TEMPLATES for topic in TOPICS]
    funcs = [fn for f in files if not f.held_out for fn in _functions(f)]
    for fn in rng.sample(funcs, min(code_prompts, len(funcs))):
        prompts.append(f"{rng.choice(CODE_TASKS)}\n\n```python\n{fn}```")
    rng.shuffle(prompts)
    return prompts
