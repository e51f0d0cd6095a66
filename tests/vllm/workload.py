"""Requests of the end-to-end tests: short prompts of distinct words, generation to a fixed
length (`ignore_eos`: the tiny model's random weights would otherwise stop at random), so every
token count is known in advance."""

from __future__ import annotations

import random
from typing import List, Tuple

from gateway import CHAT, COMPLETIONS

WORDS = ("rank token step barrier decode route gateway engine batch cache expert attention "
         "lockstep load queue wait score group worker stream model prompt answer").split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request(rng: random.Random, path: str, max_tokens: int, words: int = 12, **extra) -> Tuple[str, dict]:
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "seed": 7, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt(rng, words)}]
    else:
        body["prompt"] = prompt(rng, words)
    return path, body


def mixed(n: int, seed: int, lengths=(16, 32, 64, 96)) -> List[Tuple[str, dict]]:
    """`n` streaming requests, completions and chat alternating, each asking for usage."""
    rng = random.Random(seed)
    return [
        request(rng, CHAT if i % 2 else COMPLETIONS, rng.choice(lengths), words=rng.randint(4, 40),
                stream=True, stream_options={"include_usage": True})
        for i in range(n)
    ]
