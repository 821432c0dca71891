"""Chat requests to self-distil draft heads on, available offline on every machine.

Draft heads serve chat: they read hidden states of the target answering a
user, after the chat template's system and user turns. So the built-in
training data is user requests, not documents: templates of the kinds of
things people ask an assistant (explain, list, compare, write, plan, fix)
crossed with everyday and technical subjects, in a fixed shuffled order. The
target's own greedy answers to them are what the heads learn from
(``train_heads.self_generate``).

Subjects are split in two disjoint sets: training requests never mention a
subject of the held-out requests that the agreement report is measured on.
"""

from __future__ import annotations

import random

TEMPLATES = (
    "Explain {s} in simple terms.",
    "What are three interesting facts about {s}?",
    "Write a short poem about {s}.",
    "Give me five tips related to {s}.",
    "What are the pros and cons of {s}?",
    "Write a short story that involves {s}.",
    "How would you explain {s} to a child?",
    "Summarize the history of {s} in a paragraph.",
    "What are common misconceptions about {s}?",
    "Write a friendly email to a colleague about {s}.",
    "List the steps to get started with {s}.",
    "Why do people care about {s}?",
    "Describe {s} in three sentences.",
    "What questions should I ask an expert on {s}?",
    "Write a product description for something related to {s}.",
    "Compare {s} with something similar and explain the differences.",
    "Give me a study plan to learn about {s} in a week.",
    "What is the most important thing to know about {s}?",
    "Write a limerick about {s}.",
    "Tell me a fun fact about {s} and explain why it is true.",
    "What could go wrong with {s}, and how can it be avoided?",
    "Write a tweet announcing something new about {s}.",
    "Create a short quiz with answers about {s}.",
    "How has {s} changed over the last fifty years?",
)
SUBJECTS = (
    "volcanoes", "the moon", "honeybees", "bread baking", "electric cars", "the immune system", "chess",
    "the Roman Empire", "saving money", "houseplants", "machine learning", "rainforests", "jazz music",
    "the stock market", "coral reefs", "public libraries", "sleep", "composting", "the printing press",
    "earthquakes", "learning a new language", "solar panels", "the human heart", "video games", "recycling",
    "ancient Egypt", "coffee", "running a marathon", "black holes", "the internet", "vaccines", "penguins",
    "time management", "renewable energy", "the Olympic Games", "photography", "gardening", "origami",
    "the French Revolution", "dinosaurs", "cloud computing", "meditation", "bicycles", "tea ceremonies",
    "the ocean tides", "password security", "public speaking", "3D printing", "wolves", "the Great Wall of China",
    "budget travel", "cheese making", "the periodic table", "remote work", "classical music", "glaciers",
    "smartphones", "the water we drink", "board games", "electric guitars", "airplanes", "healthy breakfasts",
    "mushrooms", "the Renaissance", "spreadsheets", "hiking safety", "octopuses", "wind turbines",
    "Python programming", "databases", "volunteering", "the solar system", "knitting", "city parks",
    "deserts", "sourdough starters", "robots", "family budgets", "the printing of money", "snow",
    "butterflies", "open source software", "the history of writing", "trains", "lighthouses", "bridges",
)
HELD_OUT_EVERY = 8  # every eighth subject is kept out of training


def chat_requests(limit: int, held_out: bool = False, seed: int = 0) -> list[str]:
    """Up to ``limit`` user requests in a fixed shuffled order: training ones, or the held-out subjects' ones."""
    subjects = [s for i, s in enumerate(SUBJECTS) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]
    requests = [t.format(s=s) for s in subjects for t in TEMPLATES]
    random.Random(seed + int(held_out)).shuffle(requests)
    return requests[:limit]


REQUEST_MARK = "\x1frequest\x1f"  # stands for the user's message when the chat template is split around it
MAX_REQUEST_TOKENS = 64  # a sampled request that has not ended by then is dropped
REQUEST_ROUNDS = 4  # sampling rounds before giving up on reaching ``limit`` distinct requests


def sampled_requests(engine, limit: int, seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
                     progress: bool = True) -> list[str]:
    """Up to ``limit`` distinct user requests written by the target itself (Magpie's recipe, Xu et al. 2024).

    An instruction-tuned model continues its chat template, cut where the user's message begins, with
    the kind of request it was trained to answer: sampled at ``temperature`` until the user's turn
    ends, they follow the target's own idea of a chat, not the few templates of ``chat_requests``.
    Requests that run past ``MAX_REQUEST_TOKENS`` without ending, empty ones and repeats are dropped.
    """
    from executor_svc.speculative.self_generation import Sampling, self_generate, tokenizer_eos_ids
    from scheduler_svc.tokenizer import Tokenizer

    tokenizer = Tokenizer(engine.engine_dir)
    if not tokenizer.has_chat_template:
        raise ValueError(f"the engine's tokenizer ({engine.engine_dir}) has no chat template to sample requests in")
    rendered = tokenizer.hf.apply_chat_template([{"role": "user", "content": REQUEST_MARK}], tokenize=False,
                                                add_generation_prompt=False)
    head, found, tail = rendered.partition(REQUEST_MARK)
    if not found:
        raise ValueError("the chat template does not place the user's message verbatim: no requests to sample")
    prefix = list(tokenizer.hf.encode(head, add_special_tokens=False))
    tail_ids = tokenizer.hf.encode(tail, add_special_tokens=False)
    stops = tokenizer_eos_ids(tokenizer.hf) | set(tail_ids[:1])  # the token that ends the user's turn
    max_tokens = len(prefix) + MAX_REQUEST_TOKENS
    if max_tokens > engine.max_seq_len:
        raise ValueError(f"sampling requests needs {max_tokens} tokens of context, "
                         f"the engine holds {engine.max_seq_len}")
    sampling = Sampling(temperature, top_p, seed)
    requests: list[str] = []
    seen: set[str] = set()
    for _ in range(REQUEST_ROUNDS):
        wanted = limit - len(requests)
        if wanted <= 0:
            break
        drawn = self_generate(engine, [prefix] * (wanted + wanted // 4 + 2), max_tokens, stops, progress, sampling)
        added = 0
        for ids in drawn:
            body = ids[len(prefix):]
            if not body or body[-1] not in stops:
                continue  # ran out of room mid-request
            text = tokenizer.hf.decode(body[:-1], skip_special_tokens=True).strip()
            if text and text.casefold() not in seen and len(requests) < limit:
                seen.add(text.casefold())
                requests.append(text)
                added += 1
        if not added:
            break
    return requests
