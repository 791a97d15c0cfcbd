"""Locust users for POST /classify: held-out IMDB test reviews cut to n tokens, one row per n.

    locust -f loadtest/classify.py --host http://127.0.0.1:8000 --headless -u 4 -r 4 -t 30s
    LOADTEST_LENGTHS=512,1024 locust -f loadtest/ ClassifyUser --host http://127.0.0.1:8001 --headless ...
    locust -f loadtest/ ClassifyUser --tags n2048 n4096 ...

Each request carries one text of exactly n tokens (BOS included, counted with the bundle's
tokenizer) and is named "/classify n=<n>", so Locust keeps one percentile row per length. The
service's reply says how many tokens it saw; a reply that disagrees with n counts as a failure, so a
mismatched tokenizer cannot pass unnoticed. `truncate: true` guards against a 413 should a text
ever come out longer than the model's n_max.

PairedClassifyUser is one user for two (or more) deployments at once (loadtest.sweep's one-user runs):
each text goes to each, one after the other, in rotating order, and each request is named
"/classify n=<n> <label>". Both deployments then answer under the same machine state, request by
request, instead of in separate runs seconds apart; with one user they still never compute at the same
time. It exists only when LOADTEST_PAIRED_HOSTS=label=url,label=url is set:

    LOADTEST_PAIRED_HOSTS=linformer=http://127.0.0.1:8000,transformer=http://127.0.0.1:8001 \
        locust -f loadtest/ PairedClassifyUser --headless -u 1 -t 1m

Env: LOADTEST_LENGTHS (default 128,...,4096), LOADTEST_TEXTS_PER_REQUEST (default 1),
LOADTEST_TOKEN_TOLERANCE (default 0: the reply must say exactly n tokens), LOADTEST_RESPONSE_TIMES
(a file for the exact time of every request, which loadtest.sweep reads), LOADTEST_PAIRED_HOSTS.
Tags: `classify` on every task, `n<length>` on each.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from locust import FastHttpUser, constant, events, tag

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `loadtest.texts` from any cwd
from loadtest.texts import (  # noqa: E402
    CLASSIFY_LENGTHS,
    lengths_from_env,
    record_response_times,
    texts_of_length,
)

LENGTHS = lengths_from_env("LOADTEST_LENGTHS", CLASSIFY_LENGTHS)
record_response_times(events, "/classify ")
TEXTS_PER_REQUEST = int(os.environ.get("LOADTEST_TEXTS_PER_REQUEST", "1"))
TOKEN_TOLERANCE = int(os.environ.get("LOADTEST_TOKEN_TOLERANCE", "0"))


PAIRED_HOSTS = [pair.split("=", 1) for pair in os.environ.get("LOADTEST_PAIRED_HOSTS", "").split(",") if pair]


def send(user: FastHttpUser, url: str, texts: list[str], n: int, name: str) -> None:
    """POST the texts; a non-200 reply, or one that saw other than n tokens, counts as a failure."""
    body = {"texts": texts, "truncate": True}
    with user.client.post(url, json=body, name=name, catch_response=True) as response:
        if response.status_code != 200:
            response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
            return
        seen = [result["tokens"] for result in response.json()["results"]]
        if any(abs(tokens - n) > TOKEN_TOLERANCE for tokens in seen):
            response.failure(f"the service saw {seen} tokens, not {n}: is the tokenizer the bundle's?")


def next_texts(user: FastHttpUser, n: int) -> list[str]:
    """The next texts of n tokens; variants rotate so consecutive requests differ."""
    rotation = user.rotations.setdefault(n, itertools.cycle(texts_of_length("classify", n)))
    return [next(rotation) for _ in range(TEXTS_PER_REQUEST)]


def classify_task(n: int):
    @tag("classify", f"n{n}")
    def classify(user: FastHttpUser) -> None:
        send(user, "/classify", next_texts(user, n), n, f"/classify n={n}")

    classify.__name__ = f"classify_n{n}"
    return classify


def paired_task(n: int):
    @tag("classify", f"n{n}")
    def classify_both(user: FastHttpUser) -> None:
        texts = next_texts(user, n)
        user.turns += 1
        first = user.turns % len(PAIRED_HOSTS)  # rotating order: A B, B A with two; A B C, B C A, C A B with three
        for label, base in PAIRED_HOSTS[first:] + PAIRED_HOSTS[:first]:
            send(user, f"{base}/classify", texts, n, f"/classify n={n} {label}")

    classify_both.__name__ = f"classify_both_n{n}"
    return classify_both


class ClassifyUser(FastHttpUser):
    """Closed loop: each user keeps one request in flight (no think time), so `-u` is the concurrency."""

    wait_time = constant(0)
    tasks = [classify_task(n) for n in LENGTHS]

    def on_start(self) -> None:
        self.rotations: dict[int, itertools.cycle] = {}


class PairedClassifyUser(FastHttpUser):
    """Closed loop over two or more deployments: the same texts to each, in rotating order. Run it with -u 1."""

    abstract = len(PAIRED_HOSTS) < 2  # without LOADTEST_PAIRED_HOSTS, `locust -f loadtest/` leaves it out
    host = PAIRED_HOSTS[0][1] if PAIRED_HOSTS else None  # requests carry full URLs; Locust wants a host
    wait_time = constant(0)
    tasks = [paired_task(n) for n in LENGTHS]

    def on_start(self) -> None:
        self.rotations: dict[int, itertools.cycle] = {}
        self.turns = 0
