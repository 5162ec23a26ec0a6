"""`GET /metrics`: Prometheus counters of weight updates and completions, per app.

Each app owns a `CollectorRegistry` (never the process-global one), so two apps in one process
(tests) count apart. The weights' version and status are read from the `EngineClient` mirror at
scrape time, so they cannot drift from `GET /v1/weights`.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from weightbus.engines.reference.engine import messages

# Prometheus text exposition format 0.0.4 (what every scraper reads).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Failed updates by cause: the status code rank 0 (or the server) answered with.
FAILURE_REASONS = {400: "rejected", 409: "conflict", 503: "unavailable", 504: "timeout"}
OTHER_FAILURE = "error"
WEIGHTS_STATUSES: tuple[messages.WeightsStatus, ...] = (
    "NORMAL",
    "UPDATING",
    "CLEARING",
    "CLEARED",
    "FAILED",
    "WAITING",
)
# From a small model over shm (tens of ms) to a large one over a slow link (minutes).
UPDATE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def failure_reason(status_code: int) -> str:
    """The `reason` label of a failed update.

    Args:
        status_code: the HTTP status the update was answered with.

    Returns:
        `rejected`, `conflict`, `unavailable`, `timeout`, or `error` for any other status.
    """
    return FAILURE_REASONS.get(status_code, OTHER_FAILURE)


class _WeightsCollector:
    """Exports the mirror of the engine's weights at each scrape."""

    def __init__(self, weights: Callable[[], messages.WeightsState | None]) -> None:
        self._weights = weights

    def collect(self) -> Iterator[Metric]:
        state = self._weights()
        if state is None:  # before Ready
            return
        info = InfoMetricFamily("weightbus_weights", "Weights version the engine serves")
        info.add_metric([], {"version": state.version, "fingerprint": state.fingerprint or ""})
        yield info
        status = GaugeMetricFamily(
            "weightbus_weights_status", "Weights status (1 for the current one)", labels=["status"]
        )
        for name in WEIGHTS_STATUSES:
            status.add_metric([name], float(state.status == name))
        yield status
        # counted by rank 0, which alone sees a staged update expire without a decision
        yield CounterMetricFamily(
            "weightbus_two_phase_aborts",
            "Staged two-phase updates discarded (aborted by the caller or no decision in time)",
            value=state.two_phase_aborts,
        )
        yield CounterMetricFamily(
            "weightbus_rollbacks", "Rollbacks to the previous version", value=state.rollbacks
        )
        rollback = GaugeMetricFamily(
            "weightbus_rollback_available", "1 when a previous version is held for a rollback"
        )
        rollback.add_metric([], float(state.rollback is not None))
        yield rollback


class _SpeculationCollector:
    """Exports the draft tokens rank 0 proposed and accepted (speculative decoding)."""

    def __init__(self, draft_tokens: Callable[[], tuple[int, int] | None]) -> None:
        self._draft_tokens = draft_tokens

    def collect(self) -> Iterator[Metric]:
        counts = self._draft_tokens()
        if counts is None:  # before Ready
            return
        num_draft, num_accepted = counts
        yield CounterMetricFamily(
            "weightbus_spec_draft_tokens",
            "Draft tokens proposed by speculative decoding",
            value=num_draft,
        )
        yield CounterMetricFamily(
            "weightbus_spec_accepted_tokens",
            "Draft tokens accepted by the model (speculative decoding)",
            value=num_accepted,
        )
        yield GaugeMetricFamily(
            "weightbus_spec_acceptance_rate",
            "Accepted / proposed draft tokens since start (0 before any was proposed)",
            value=acceptance_rate(num_draft, num_accepted),
        )


class _PrefixCacheCollector:
    """Exports the prompt tokens rank 0 looked up in its prefix cache and found there."""

    def __init__(self, counts: Callable[[], tuple[int, int] | None]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        if counts is None:  # before Ready
            return
        num_queries, num_hits = counts
        yield CounterMetricFamily(
            "weightbus_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (docs/serving.md)",
            value=num_queries,
        )
        yield CounterMetricFamily(
            "weightbus_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache (docs/serving.md)",
            value=num_hits,
        )


def acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    """Share of proposed draft tokens the model accepted.

    Args:
        num_draft_tokens: draft tokens proposed.
        num_accepted_tokens: draft tokens accepted.

    Returns:
        `num_accepted_tokens / num_draft_tokens`, or 0.0 when none was proposed.
    """
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


class Metrics:
    """The app's counters; `render` is the body of `GET /metrics`.

    Args:
        weights: returns the current weights mirror (None before the engine is ready).
        draft_tokens: returns (proposed, accepted) draft tokens of speculative decoding since
            the engine started (None before it is ready; the argument left out: not exported).
        prefix_cache: returns (looked up, found) prompt tokens of the prefix cache since the
            engine started (as `draft_tokens`).
    """

    def __init__(
        self,
        weights: Callable[[], messages.WeightsState | None],
        draft_tokens: Callable[[], tuple[int, int] | None] | None = None,
        prefix_cache: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.updates = Counter(
            "weightbus_weight_updates_total",
            "Weight updates answered (committed and failed)",
            registry=self.registry,
        )
        self.update_failures = Counter(
            "weightbus_weight_update_failures_total",
            "Weight updates that did not commit, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in (*FAILURE_REASONS.values(), OTHER_FAILURE):
            self.update_failures.labels(reason=reason)  # exported at 0 from the start
        self.update_bytes = Counter(
            "weightbus_weight_update_bytes_total",
            "Bytes of committed weight updates",
            registry=self.registry,
        )
        self.update_seconds = Histogram(
            "weightbus_weight_update_seconds",
            "Duration of committed weight updates, as the engine measured them",
            buckets=UPDATE_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.completions = Counter(
            "weightbus_completion_requests_total",
            "Completion requests answered, by HTTP status code",
            ["code"],
            registry=self.registry,
        )
        self.completions.labels(code="200")
        self.completion_tokens = Counter(
            "weightbus_completion_tokens_total",
            "Completion tokens returned",
            registry=self.registry,
        )
        self.registry.register(_WeightsCollector(weights))
        if draft_tokens is not None:
            self.registry.register(_SpeculationCollector(draft_tokens))
        if prefix_cache is not None:
            self.registry.register(_PrefixCacheCollector(prefix_cache))

    def observe_update(self, status_code: int, *, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Count one answered update.

        Args:
            status_code: the HTTP status it was answered with (200: committed).
            nbytes: bytes moved (committed updates only).
            seconds: the engine's duration of the update (committed updates only).
        """
        self.updates.inc()
        if status_code != 200:
            self.update_failures.labels(reason=failure_reason(status_code)).inc()
            return
        self.update_bytes.inc(nbytes)
        self.update_seconds.observe(seconds)

    def observe_completion(self, status_code: int, num_tokens: int = 0) -> None:
        """Count one answered completion request.

        Args:
            status_code: the HTTP status it was answered with.
            num_tokens: completion tokens returned.
        """
        self.completions.labels(code=str(status_code)).inc()
        self.completion_tokens.inc(num_tokens)

    def render(self) -> bytes:
        """Prometheus text of every metric of this app."""
        return generate_latest(self.registry)
