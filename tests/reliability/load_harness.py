"""Load on a served engine while a publisher pushes versions: request bodies, clients, pusher."""

import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch
from engine_harness import VOCAB_SIZE
from update_harness import trained_copy

from weightbus import Publisher, PushResult

MAX_TOKENS_CHOICES = (1, 4, 8, 16, 24)
PROMPT_TOKENS_RANGE = (2, 10)
SAMPLED_EVERY = 4  # one request in four samples (seeded); the others are greedy
NUM_TOP_LOGPROBS = 5  # alternatives per token: the checks compare them too
# Bound of one HTTP answer: generous for a loaded machine, finite so no client hangs.
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class LoadSize:
    """How much load one pause mode gets.

    Attributes:
        num_completions: completions to send at least.
        num_updates: versions to push while they run.
        num_clients: client threads, each with one request in flight at a time.
    """

    num_completions: int
    num_updates: int
    num_clients: int = 8


def request_body(number: int) -> dict:
    """Completion request `number`: a seeded mix of prompt lengths, max_tokens and sampling."""
    rng = random.Random(number)
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*PROMPT_TOKENS_RANGE))]
    body = {
        "prompt": prompt,
        "max_tokens": rng.choice(MAX_TOKENS_CHOICES),
        "temperature": 0.0,
        "logprobs": NUM_TOP_LOGPROBS,
    }
    if number % SAMPLED_EVERY == SAMPLED_EVERY - 1:
        body |= {"temperature": 0.8, "top_p": 0.9, "seed": number}
    return body


@dataclass(slots=True)
class Exchange:
    """One completion request and what came back (an HTTP answer, or the client's error)."""

    client: int
    body: dict
    status_code: int | None = None
    answer: dict | None = None
    error: str | None = None


class VersionBook:
    """Committed versions in commit order, each with the transformers model of its weights."""

    def __init__(self, version: str, model: torch.nn.Module) -> None:
        self.order = [version]
        self.models = {version: model}

    def commit(self, version: str, model: torch.nn.Module) -> None:
        self.order.append(version)
        self.models[version] = model

    def index(self, version: str) -> int:
        """Position of a committed version in commit order (ValueError for any other)."""
        return self.order.index(version)

    @property
    def latest_model(self) -> torch.nn.Module:
        return self.models[self.order[-1]]


@dataclass(slots=True)
class LoadRun:
    """`size.num_clients` threads send completions back to back while one thread pushes
    `size.num_updates` versions (each a training step on the last one), alternating atomic
    and in-place loading, all with one pause mode. Push k waits until k/(num_updates + 1) of
    the completions are answered, so the updates are spread over the load."""

    url: str
    publisher: Publisher
    book: VersionBook
    size: LoadSize
    pause_mode: str
    name: str  # prefix of the pushed versions' names
    first_request: int  # request numbers of this run start here (distinct bodies per run)
    exchanges: list[Exchange] = field(default_factory=list)
    pushes: list[PushResult] = field(default_factory=list)
    push_error: str | None = None
    num_sent: int = 0
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _pushes_done: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, timeout_s: float) -> list[str]:
        """Run the load; returns the names of threads still running after `timeout_s`."""
        threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client-{i}")
            for i in range(self.size.num_clients)
        ]
        threads.append(threading.Thread(target=self._pusher, name="pusher"))
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()  # stragglers end after their current request
        return [thread.name for thread in threads if thread.is_alive()]

    def _next_number(self) -> int | None:
        with self._lock:
            enough = self._pushes_done.is_set() and self.num_sent >= self.size.num_completions
            if enough or self._stop.is_set():
                return None
            self.num_sent += 1
            return self.first_request + self.num_sent

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as http:
            while (number := self._next_number()) is not None:
                exchange = Exchange(client=index, body=request_body(number))
                try:
                    response = http.post("/v1/completions", json=exchange.body)
                    exchange.status_code = response.status_code
                    exchange.answer = response.json()
                except (httpx.HTTPError, ValueError) as exc:  # lost: no parsable answer
                    exchange.error = repr(exc)
                with self._lock:
                    self.exchanges.append(exchange)
                    self._lock.notify_all()

    def _pusher(self) -> None:
        try:
            for k in range(self.size.num_updates):
                self._wait_answered(
                    (k + 1) * self.size.num_completions // (self.size.num_updates + 1)
                )
                model = trained_copy(self.book.latest_model, seed=len(self.book.order))
                version = f"{self.name}-v{k + 1}"
                result = self.publisher.push(
                    model, version=version, pause_mode=self.pause_mode, atomic=k % 2 == 0
                )
                self.book.commit(version, model)
                self.pushes.append(result)
        except Exception as exc:  # noqa: BLE001 - any failure of a push fails the test
            self.push_error = repr(exc)
        finally:
            self._pushes_done.set()

    def _wait_answered(self, count: int) -> None:
        with self._lock:
            reached = self._lock.wait_for(
                lambda: len(self.exchanges) >= count or self._stop.is_set(),
                timeout=REQUEST_TIMEOUT_S,
            )
        if not reached or self._stop.is_set():
            raise TimeoutError(f"only {len(self.exchanges)} of {count} completions answered")
