"""Locust users for POST /translate: held-out EN-DE test sources joined and cut to n tokens.

    locust -f loadtest/translate.py --host http://127.0.0.1:8000 --headless -u 2 -r 2 -t 30s
    LOADTEST_TRANSLATE_LENGTHS=32,64 locust -f loadtest/ TranslateUser --host ... --headless ...

Each request carries one English text of exactly n source tokens (the bundle's tokenizer and
specials) and is named "/translate n=<n>". Source lengths above the deployed model's n_max (read
from GET /v1/models at the start of the test) are left out with a warning; `truncate: true` guards
the rest. The decoder's work grows with the output, so max_new_tokens is fixed per length.

Env: LOADTEST_TRANSLATE_LENGTHS (default 16,32,64,128), LOADTEST_BEAM_SIZE (default 1),
LOADTEST_MAX_NEW_TOKENS (default 2n + 8, at most 4096), LOADTEST_RESPONSE_TIMES (as for classify).
Tags: `translate` on every task, `t<length>` on each.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

import gevent
from locust import FastHttpUser, constant, events, tag

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `loadtest.texts` from any cwd
from loadtest.texts import (  # noqa: E402
    TRANSLATE_LENGTHS,
    lengths_from_env,
    record_response_times,
    texts_of_length,
    translate_max_new_tokens,
)

LENGTHS = lengths_from_env("LOADTEST_TRANSLATE_LENGTHS", TRANSLATE_LENGTHS)
record_response_times(events, "/translate ")
BEAM_SIZE = int(os.environ.get("LOADTEST_BEAM_SIZE", "1"))
log = logging.getLogger(__name__)


def translate_task(n: int):
    @tag("translate", f"t{n}")
    def translate(user: FastHttpUser) -> None:
        if user.n_max is not None and n > user.n_max:
            gevent.sleep(1.0)  # this deployment cannot take n tokens: on_start warned once
            return
        rotation = user.rotations.setdefault(n, itertools.cycle(texts_of_length("translate", n)))
        # whole texts of n tokens, as the model-level timings take them (not cut into sentences)
        body = {"texts": [next(rotation)], "truncate": True, "beam_size": BEAM_SIZE, "split_sentences": False,
                "max_new_tokens": translate_max_new_tokens(n)}  # fmt: skip
        with user.client.post("/translate", json=body, name=f"/translate n={n}", catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")

    translate.__name__ = f"translate_n{n}"
    return translate


class TranslateUser(FastHttpUser):
    """Closed loop, like ClassifyUser: `-u` is the number of requests in flight."""

    wait_time = constant(0)
    tasks = [translate_task(n) for n in LENGTHS]
    n_max: int | None = None  # the deployed translate model's, once known

    def on_start(self) -> None:
        self.rotations: dict[int, itertools.cycle] = {}
        if TranslateUser.n_max is None:
            response = self.client.get("/v1/models", name="/v1/models")
            models = response.json().get("models", []) if response.status_code == 200 else []
            limits = [m["n_max"] for m in models if m.get("task") == "translate"]
            if limits:
                TranslateUser.n_max = limits[0]
                too_long = [n for n in LENGTHS if n > limits[0]]
                if too_long:
                    log.warning("translate n_max is %d: lengths %s are skipped", limits[0], too_long)


@events.test_start.add_listener
def _reset_n_max(**_kwargs) -> None:
    TranslateUser.n_max = None  # a new test may target another host
