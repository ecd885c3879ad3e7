"""Synthetic prose prompts for draft training: explanations, essays, letters, stories and plans.

The shared prompt corpus is led by GSM8K and code, and the shipped draft accepts least on MT-Bench's
writing, humanities and STEM questions (about 2.0 against 2.6 on code and math at 128 tokens; see
results/DRAFT_TRAINING.md). This script writes prompts of that kind, built from hand-written topics (by
kind: concepts, events, places, activities, issues, professions, objects) crossed with instruction
templates and optional audience and format clauses; `mleagle train-draft generate --extra-prompts FILE
--sources prose_synth` then has the target answer them. What matters for the draft is the target's
own prose, not the prompts' quality: they only have to make it explain, argue, describe and narrate.

The topics leave out the subjects of MT-Bench's own questions on purpose, and every prompt sharing an
8-word sequence with any MT-Bench or GSM8K test turn is dropped (counted in the summary line), so the
evaluation stays a measure of a genre, not of remembered questions. Deterministic for a seed.

    python scripts/prose_prompts.py --out prose.jsonl --n 30000 [--data-dir ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

CONCEPTS = """
plate tectonics|the water cycle|black holes|vaccination|the immune system|natural selection|inflation in economics|
compound interest|supply and demand|opportunity cost|the greenhouse effect|ocean currents|the carbon cycle|
nuclear fission|nuclear fusion|the theory of relativity|entropy|electric circuits|magnetism|sound waves|
the electromagnetic spectrum|antibiotic resistance|the human digestive system|sleep and memory|neurons and synapses|
blood pressure|the placebo effect|cognitive biases|game theory|the scientific method|statistical significance|
correlation and causation|probability|prime numbers|the Pythagorean theorem|exponential growth|algorithms|
recursion in programming|public-key cryptography|how the internet routes data|cloud computing|databases|
operating systems|computer viruses|open-source software|blockchains|3D printing|GPS navigation|
lithium-ion batteries|wind turbines|hydroelectric power|desalination|recycling plastics|soil erosion|
coral reefs|rainforests|migration of birds|pollination|fermentation|yeast in bread making|the Maillard reaction|
volcanoes|earthquakes|hurricanes|tides|the phases of the Moon|the seasons|the life cycle of stars|comets|
exoplanets|the Big Bang|dark matter|gravity|friction|buoyancy|aerodynamic lift|the combustion engine|
electric cars|the printing press|the steam engine|vaccines and herd immunity|genetic inheritance|mutations|
stem cells|clinical trials|nutrition labels|dietary fibre|caffeine|hydration|muscle growth|
the circadian rhythm|stress hormones|mindfulness|habit formation|motivation|emotional intelligence|
critical thinking|logical fallacies|democracy|separation of powers|
federalism|the rule of law|human rights|taxation|central banks|the stock market|bonds|index funds|
budgeting|credit scores|small business loans|globalisation|free trade|minimum wage laws|universal basic income|
urbanisation|public transport|the gig economy|remote work|automation and jobs|artificial intelligence|
computer vision|speech recognition|recommendation systems|privacy online|social media algorithms|
misinformation|copyright|patents|brand loyalty|marketing funnels|customer retention|
negotiation|leadership styles|project management|agile development|design thinking|user experience design|
typography|colour theory|perspective drawing|musical scales|rhythm and tempo|the sonnet|the hero's journey|
satire|irony in literature|unreliable narrators|magical realism|impressionism|cubism|baroque music|jazz|
hip hop|film editing|documentary photography|stage lighting|architecture of cathedrals|minimalism in design|
stoicism|utilitarianism|existentialism|the social contract|free will|the trolley problem|cultural relativism|
language acquisition in children|bilingualism|dialects|the origins of writing|mythology|folk tales|
rites of passage|tea ceremonies|the history of coffee|spices and trade|the invention of money|banking
""".replace("\n", "").split("|")

EVENTS = """
the fall of the Roman Empire|the Renaissance|the Protestant Reformation|the Industrial Revolution|
the French Revolution|the American Civil War|the abolition of slavery|the Meiji Restoration|
the First World War|the Great Depression|the Second World War|the Marshall Plan|the Cold War|
the space race|the Moon landing|the fall of the Berlin Wall|the end of apartheid|the civil rights movement|
women's suffrage|the founding of the United Nations|the invention of the telephone|the first powered flight|
the discovery of penicillin|the eradication of smallpox|the Black Death|the Silk Road trade|
the voyages of Zheng He|the Age of Exploration|the building of the pyramids|the Olympic Games in antiquity|
the Magna Carta|the Ottoman Empire's rise|the Mughal Empire|the unification of Germany|the Irish famine|
the gold rush|the Dust Bowl|the invention of the World Wide Web|the first computers|the Apollo 13 mission|
the Chernobyl disaster|the 2008 financial crisis|the printing of the Gutenberg Bible|the Scientific Revolution|
the Enlightenment|the Haitian Revolution|the independence of India|the Mexican Revolution|the Harlem Renaissance|
the construction of the Panama Canal|the Transcontinental Railroad|the Green Revolution in agriculture|
the human genome project|the COVID-19 pandemic|the rise of smartphones|the Hundred Years' War|the Crusades
""".replace("\n", "").split("|")

PLACES = """
Kyoto|Lisbon|Marrakesh|Reykjavik|Cape Town|Buenos Aires|Istanbul|Hanoi|Vancouver|Edinburgh|Prague|
Cartagena|Petra|the Scottish Highlands|Patagonia|the Amazon basin|the Sahara|Iceland's south coast|
the Norwegian fjords|Tuscany|Provence|the Greek islands|Bali|New Zealand's South Island|Yellowstone|
the Grand Canyon|Banff|Havana|Seoul|Singapore|Mexico City|Oaxaca|Lima|Cusco|Nairobi|Zanzibar|Cairo|
Jordan's Wadi Rum|Tbilisi|Budapest|Vienna|Krakow|Copenhagen|Amsterdam|Barcelona|Seville|Sicily|
the Amalfi coast|the Swiss Alps|Quebec City|New Orleans|Chicago|San Francisco|Montreal|Sydney|Tasmania|
Rajasthan|Kerala|Kathmandu|Bhutan|Mongolia|Taipei|Hong Kong|Shanghai|Luang Prabang|Siem Reap|
the Galapagos Islands|Costa Rica|Patagonia's glaciers|the Dolomites|Dubrovnik|Porto|Bruges|Oslo|Helsinki
""".replace("\n", "").split("|")

ACTIVITIES = """
learning to play the guitar|running a first marathon|starting a vegetable garden|baking sourdough bread|
learning a second language|public speaking|rock climbing|birdwatching|photography|painting with watercolours|
writing a novel|keeping a journal|meditation|chess|cycling to work|camping in the wilderness|scuba diving|
knitting|woodworking|home brewing|volunteering at a food bank|learning to code|saving for retirement|
training a puppy|cooking for a large family|hosting a dinner party|planning a wedding|moving to a new city|
starting a podcast|running a book club|studying for exams|preparing for a job interview|negotiating a salary|
learning to swim|yoga|surfing|skiing|hiking long-distance trails|composting|decluttering a home|
building a personal website|restoring old furniture|playing in an amateur orchestra|amateur astronomy|
coaching a youth football team|teaching an evening class|making pottery|calligraphy|learning to dance tango
""".replace("\n", "").split("|")

ISSUES = """
climate change|plastic pollution in the oceans|food waste|housing affordability|traffic congestion|
screen time for children|online privacy|fake news|the digital divide|access to clean water|
loneliness among older people|student debt|the cost of healthcare|obesity|mental health at work|
gender pay gaps|animal welfare|fast fashion|overtourism|light pollution|noise in cities|
endangered species|deforestation|the future of libraries|homework in primary schools|standardised testing|
four-day working weeks|self-driving cars|facial recognition in public places|cryptocurrency regulation|
the ethics of gene editing|space tourism|nuclear power|school uniforms|banning single-use plastics|
voting age|compulsory voting|museums returning artefacts|working from home|the decline of local newspapers|
water scarcity in farming|antibiotics in livestock|sugar taxes|cycling infrastructure|rewilding|
the ethics of zoos|video games and violence|tipping culture|artificial sweeteners|urban green spaces
""".replace("\n", "").split("|")

PROFESSIONS = """
a nurse|an air traffic controller|a primary school teacher|a software engineer|a marine biologist|an architect|
a firefighter|a chef|a librarian|a journalist|a pilot|a farmer|an electrician|a translator|a museum curator|
a park ranger|a pharmacist|a civil engineer|a data analyst|a veterinarian|a social worker|a film director|
a carpenter|an astronaut|a diplomat|a paramedic|a game designer|a beekeeper|a lighthouse keeper|a sommelier|
an urban planner|a psychologist|a lawyer|an accountant|a physiotherapist|a fashion designer|a sound engineer
""".replace("\n", "").split("|")

OBJECTS = """
the bicycle|the refrigerator|the smartphone|the mechanical clock|the microscope|the telescope|paper money|
the compass|glass|concrete|the light bulb|the washing machine|the camera|the vaccine syringe|the pencil|
the umbrella|the elevator|the shipping container|the barcode|the credit card|the radio|the typewriter|
the piano|the wheel|the zipper|eyeglasses|the helmet|the solar panel|the thermometer|the map
""".replace("\n", "").split("|")

TEMPLATES: dict[str, list[str]] = {
    "concept": [
        "Explain {t} in simple terms.", "What is {t}, and why does it matter?", "Write a short essay about {t}.",
        "Describe how {t} works, step by step.", "Give an overview of {t} with examples from everyday life.",
        "What are the most common misconceptions about {t}?", "Summarise the key ideas behind {t}.",
        "Write a blog post that introduces {t} to newcomers.", "Compare {t} with a related idea and explain the differences.",
        "Why is {t} important for society?", "Write a lesson plan for teaching {t}.",
        "Create a short FAQ about {t}.", "Explain {t} using an analogy.", "Describe the history of {t}.",
        "What are the advantages and disadvantages of {t}?", "Write an encyclopedia-style entry on {t}.",
    ],
    "event": [
        "Describe the causes and consequences of {t}.", "Write a short essay on {t}.",
        "What were the most important effects of {t}?", "Explain {t} to a student who has never heard of it.",
        "Write a diary entry from the point of view of someone living through {t}.",
        "How did {t} change everyday life?", "Summarise {t} in a few paragraphs.",
        "What lessons can we learn today from {t}?", "Write a newspaper article reporting on {t} as if it had just happened.",
        "Compare {t} with another turning point in history.",
    ],
    "place": [
        "Write a travel blog post about a week in {t}.", "Describe a day spent exploring {t}.",
        "What should a first-time visitor know about {t}?", "Write a guide to the food and culture of {t}.",
        "Describe {t} using vivid sensory details.", "Plan a five-day itinerary for {t}, with reasons for each stop.",
        "Write a letter to a friend describing your trip to {t}.", "Explain how geography has shaped life in {t}.",
        "Write a short story set in {t}.", "What are the pros and cons of living in {t}?",
    ],
    "activity": [
        "Give advice to a beginner who is interested in {t}.", "Write an essay about the benefits of {t}.",
        "Describe the first month of {t} and what to expect.", "What are common mistakes people make when {t}?",
        "Write a motivational blog post about {t}.", "Write a personal story about {t}.",
        "Explain how to get started with {t}, step by step.", "Persuade a sceptical friend to try {t}.",
        "What skills does {t} teach that are useful elsewhere in life?", "Write a short speech about {t}.",
    ],
    "issue": [
        "Write a persuasive essay on {t}.", "Discuss the arguments for and against action on {t}.",
        "Write a letter to a local newspaper about {t}.", "What can individuals do about {t}?",
        "Explain {t} and propose three practical solutions.", "Write a balanced report on {t}.",
        "How might {t} change in the next twenty years?", "Write a speech for a town meeting about {t}.",
        "Explain {t} to a teenager.", "Write an opinion column about {t}.",
        "What role should governments play in {t}?", "Describe how different countries approach {t}.",
    ],
    "profession": [
        "Describe a typical day in the life of {t}.", "What skills and training does it take to become {t}?",
        "Write a short story about {t} facing an unexpected challenge.", "Write a job advertisement for {t}.",
        "Write an interview with {t} about their work.", "What are the rewards and difficulties of working as {t}?",
        "Write a cover letter from someone applying to work as {t}.", "Give career advice to someone who wants to be {t}.",
    ],
    "object": [
        "Describe the history of {t}.", "How has {t} changed the way people live?", "Explain how {t} works.",
        "Write a product description for a modern version of {t}.", "Imagine a world without {t}. Describe it.",
        "Write a short story in which {t} plays a central role.", "Write a persuasive advertisement for {t} from a century ago.",
    ],
}

GENERIC = [
    "Write a professional email to a colleague asking for help with {a}.",
    "Draft a polite complaint letter about {a}.", "Write a thank-you note to a teacher who helped with {a}.",
    "Write a short poem about {a}.", "Write a story that begins with a character discovering {a}.",
    "Write a product review of {a}.", "Describe a memorable experience with {a}.",
]
GENERIC_SLOTS = ["a late delivery", "a broken laptop", "a community garden", "a new neighbour", "a lost wallet",
                 "an old photograph", "a rainy afternoon", "a surprise party", "a job offer", "a school reunion",
                 "a noisy flat upstairs", "a delayed train", "a first day at work", "a charity bake sale",
                 "a mysterious letter", "a power cut", "a stray cat", "a family recipe", "a broken promise",
                 "a hiking trip", "a science fair project", "a library book returned forty years late"]

AUDIENCE = ["", "", "", " Write it for a high school student.", " Aim it at a general audience.",
            " Keep it accessible to beginners.", " Write for readers who already know the basics.",
            " Use a friendly, conversational tone.", " Use a formal tone.", " Make it engaging and vivid."]
FORMAT = ["", "", "", " Use about three paragraphs.", " Organise it with short headings.",
          " Include a numbered list of key points.", " Keep it under 300 words.", " End with a short conclusion.",
          " Give concrete examples.", " Include a surprising fact."]
KINDS = {"concept": CONCEPTS, "event": EVENTS, "place": PLACES, "activity": ACTIVITIES, "issue": ISSUES,
         "profession": PROFESSIONS, "object": OBJECTS}


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def banned_ngrams(ddir: Path) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for name in ("mt_bench.jsonl", "gsm8k_test.jsonl"):
        f = ddir / name
        if f.is_file():
            for line in f.read_text(encoding="utf-8").split("\n"):
                if line.strip():
                    for t in json.loads(line).get("turns", []):
                        out |= ngrams(t)
    return out


def candidates() -> list[str]:
    out = [tpl.format(t=t.strip()) for kind, topics in KINDS.items() for t in topics if t.strip()
           for tpl in TEMPLATES[kind]]
    out += [tpl.format(a=a) for tpl in GENERIC for a in GENERIC_SLOTS]
    return out


def make(n: int, seed: int, banned: set[tuple[str, ...]]) -> tuple[list[str], int]:
    """Up to n distinct prompts: every base prompt once with random clauses, then more clause variants."""
    rng = random.Random(seed)
    base = candidates()
    rng.shuffle(base)
    seen: set[str] = set()
    out: list[str] = []
    dropped = 0
    tries = 0
    while len(out) < n and tries < 20 * n:
        p = base[tries % len(base)] + rng.choice(AUDIENCE) + rng.choice(FORMAT)
        tries += 1
        if p in seen:
            continue
        seen.add(p)
        if ngrams(p) & banned:
            dropped += 1
            continue
        out.append(p)
    rng.shuffle(out)
    return out, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSONL file to write ({prompt, source} rows)")
    ap.add_argument("--n", type=int, default=30000, help="number of prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="evaluation sets to decontaminate against "
                    "(default: $MLEAGLE_DATA_DIR or ../shared/data)")
    a = ap.parse_args(argv)
    from mleagle.engine.contract.config import data_dir

    ddir = Path(a.data_dir) if a.data_dir else data_dir()
    banned = banned_ngrams(ddir)
    if not banned:
        print(f"error: no MT-Bench or GSM8K test turns under {ddir} to decontaminate against", file=sys.stderr)
        return 2
    prompts, dropped = make(a.n, a.seed, banned)
    Path(a.out).write_text("".join(json.dumps({"prompt": p, "source": "prose_synth"}) + "\n" for p in prompts),
                           encoding="utf-8")
    print(f"{len(prompts)} prompts from {len(candidates())} base prompts -> {a.out}; "
          f"{dropped} dropped for an 8-gram shared with an evaluation turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
