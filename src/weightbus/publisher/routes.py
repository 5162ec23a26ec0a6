"""Each engine over the transport that fits where it runs: one push, several sinks.

`Publisher(engines, transport={url: name, ...})` builds a `RoutedSink`: one sink per transport
named, each serving the engines routed to it (e.g. `shm` for engines on the trainer's host,
`nixl` or `dist` for the others). The push stays one push: one plan, one set of digests, one
fingerprint, one two-phase commit over every engine. Each child sink gets a session of its own
engines that shares the push's digests; an engine answering early stops only its own sink's
wait (the others' engines still read), a child that fails stops the others, and the children
stream at the same time.
"""

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightbus.transport import BucketSink, PushSession, SourceDescription, make_sink
from weightbus.transport.base import EngineLink, EngineRoute, Progress, no_progress

logger = logging.getLogger(__name__)

# How long past the push's timeout a child's stream may take before it counts as hung.
_JOIN_MARGIN_S = 10.0


def normalize_routes(routes: Mapping[str, str], engine_urls: Sequence[str]) -> dict[str, str]:
    """`routes` keyed by normalized URL, checked against the engines.

    Raises:
        ValueError: an engine has no route, a route names no engine, or a transport is unknown.
    """
    from weightbus.transport import transport_names

    normalized = {url.rstrip("/"): name for url, name in routes.items()}
    missing = [url for url in engine_urls if url not in normalized]
    if missing:
        raise ValueError(f"transport: no transport is given for engines {missing}")
    extra = sorted(set(normalized) - set(engine_urls))
    if extra:
        raise ValueError(f"transport: routes name engines that are not given: {extra}")
    known = transport_names()
    unknown = sorted({name for name in normalized.values() if name not in known})
    if unknown:
        raise ValueError(f"transport: unknown transports {unknown}; registered: {known}")
    return normalized


class RoutedDescription(SourceDescription, frozen=True, kw_only=True):
    """What `RoutedSink.prepare` returns: each child's description, and each engine's route.
    It never leaves the publisher (no transport decodes it): `route` hands each engine its
    child's description."""

    parts: dict[str, SourceDescription]
    engines: list[tuple[str, int]]  # per engine of the push: (transport, index among its peers)


class RoutedSink(BucketSink):
    """Sinks of several transports behind one, each engine routed by its URL.

    Args:
        routes: engine URL -> transport name (every engine of the push needs one).
        options: transport name -> keyword arguments of that transport's sink.
    """

    def __init__(
        self, routes: Mapping[str, str], options: Mapping[str, dict[str, Any]] | None = None
    ) -> None:
        self.routes = {url.rstrip("/"): name for url, name in routes.items()}
        options = dict(options or {})
        self.children: dict[str, BucketSink] = {}
        for name in sorted(set(self.routes.values())):
            self.children[name] = make_sink(name, **options.get(name, {}))
        self.name = "+".join(self.children)
        self._sessions: dict[str, PushSession] = {}

    def add_route(self, url: str, name: str, options: dict[str, Any]) -> None:
        """Route engine `url` over transport `name` from now on (a sink is made if needed)."""
        if name not in self.children:
            self.children[name] = make_sink(name, **options)
            self.name = "+".join(sorted(self.children))
        self.routes[url.rstrip("/")] = name

    @property
    def mode(self) -> str:
        return ", ".join(f"{name}: {child.mode}" for name, child in self.children.items())

    def _transport_of(self, url: str) -> str:
        try:
            return self.routes[url.rstrip("/")]
        except KeyError:
            raise ValueError(f"engine {url} has no transport; routes: {self.routes}") from None

    def _split(self, urls: Sequence[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for url in urls:
            groups.setdefault(self._transport_of(url), []).append(url)
        return groups

    def setup(self, engines: Sequence[EngineLink], **options: Any) -> dict[str, Any]:
        """Set up each transport that has a set-up (`dist`) over its own engines.

        Returns:
            Each set-up transport's report, by name.

        Raises:
            ValueError: no routed transport has a set-up.
        """
        groups: dict[str, list[EngineLink]] = {}
        for engine in engines:
            groups.setdefault(self._transport_of(engine.url), []).append(engine)
        with_setup = {n: e for n, e in groups.items() if _has_setup(self.children[n])}
        if not with_setup:
            raise ValueError(f"transports {sorted(groups)} need no set-up")
        return {
            name: self.children[name].setup(links, **options) for name, links in with_setup.items()
        }

    def teardown(self, timeout_s: float) -> None:
        for child in self.children.values():
            child.teardown(timeout_s)

    def teardown_engine(self, engine: EngineLink, timeout_s: float) -> None:
        self.children[self._transport_of(engine.url)].teardown_engine(engine, timeout_s)

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        siblings: dict[str, Any] = {}
        for name, child in self.children.items():
            siblings[name], child_setup = child.sibling_options(
                dict(sink_options.get(name, {})), setup_options
            )
            if _has_setup(child):
                setup_options = child_setup
        return siblings, setup_options

    def prepare(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        progress: Progress = no_progress,
    ) -> RoutedDescription:
        groups = self._split(session.engines)
        parts, self._sessions = {}, {}
        for position, (name, urls) in enumerate(groups.items()):
            # shares the push's digests (same dict); an engine's answer stops its own sink only
            child_session = dataclasses.replace(
                session, receivers=len(urls), engines=tuple(urls), abandon_reasons=[]
            )
            self._sessions[name] = child_session
            child_progress = progress if position == 0 else no_progress
            parts[name] = self.children[name].prepare(child_session, tensors, child_progress)
        engines = [
            (name, groups[name].index(url))
            for url in session.engines
            for name in (self._transport_of(url),)
        ]
        return RoutedDescription(parts=parts, engines=engines)

    def route(self, description: SourceDescription, engine_index: int, verify: str) -> EngineRoute:
        assert isinstance(description, RoutedDescription)
        name, peer_index = description.engines[engine_index]
        return self.children[name].route(description.parts[name], peer_index, verify)

    def engine_answered(self, session: PushSession, url: str, reason: str) -> None:
        """Only the sink serving `url` stops waiting: the others' engines still read."""
        self._sessions[self._transport_of(url)].abandon(reason)

    def stream(
        self,
        session: PushSession,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """Every child streams to its engines at the same time.

        Raises:
            TimeoutError: a child timed out (the message names each child that failed).
            OSError: a child failed otherwise.
        """
        errors: dict[str, BaseException] = {}
        threads = []
        for position, name in enumerate(self._sessions):
            child_progress = progress if position == 0 else no_progress
            thread = threading.Thread(
                target=self._stream_child,
                args=(name, tensors, timeout_s, child_progress, errors),
                name=f"stream-{name}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout_s + _JOIN_MARGIN_S)
            if thread.is_alive():
                errors.setdefault(thread.name[len("stream-") :], TimeoutError("did not return"))
        _raise_combined(errors)

    def _stream_child(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        timeout_s: float,
        progress: Progress,
        errors: dict[str, BaseException],
    ) -> None:
        child_session = self._sessions[name]
        try:
            self.children[name].stream(child_session, tensors, timeout_s, progress)
        except Exception as exc:  # noqa: BLE001 - re-raised by stream() with the others
            errors[name] = exc
            for other, other_session in self._sessions.items():
                if other != name:  # the push fails: the other sinks need not wait it out
                    other_session.abandon(f"transport {name} failed: {exc}")

    def close(self) -> None:
        for child in self.children.values():
            child.close()


def _has_setup(sink: BucketSink) -> bool:
    return type(sink).setup is not BucketSink.setup


def _raise_combined(errors: dict[str, BaseException]) -> None:
    if not errors:
        return
    unexpected = [
        e for e in errors.values() if not isinstance(e, TimeoutError | OSError | ValueError)
    ]
    if unexpected:
        raise unexpected[0]
    message = "; ".join(f"{name}: {exc}" for name, exc in errors.items())
    if any(isinstance(exc, TimeoutError) for exc in errors.values()):
        raise TimeoutError(message)
    raise OSError(message)
