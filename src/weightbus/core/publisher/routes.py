"""Each engine over the transport that fits where it runs: one push, several sinks.

`Publisher(engines, transport={url: name, ...})` builds a `RoutedSink`: one sink per transport
named, each serving the engines routed to it (e.g. `shm` for engines on the trainer's host,
`nixl` or `dist` for the others). The push stays one push: one plan, one set of digests, one
fingerprint, one two-phase commit over every engine. Each child sink gets a session of its own
engines that shares the push's digests and byte counter (the push's `sent_bytes` sums the
children's); an engine answering early stops only its own sink's wait (the others' engines
still read), a child that fails stops the others, and the children stream at the same time.
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from weightbus.core.transport import (
    BucketSink,
    PushSession,
    Sending,
    SourceDescription,
    has_setup,
    make_sink,
    transport_names,
)
from weightbus.core.transport.base import EngineLink, EngineRoute, Progress, no_progress

logger = logging.getLogger(__name__)

# How long past the push's timeout the children's streams may take before they count as hung.
_JOIN_MARGIN_S = 10.0
# Bound of tearing down a set-up left with no engine (the set-up's own `timeout_s` if given).
_TEARDOWN_TIMEOUT_S = 60.0


def normalize_routes(routes: Mapping[str, str], engine_urls: Sequence[str]) -> dict[str, str]:
    """`routes` keyed by normalized URL, checked against the engines.

    Raises:
        ValueError: an engine is given twice or has no route, a route names no engine, or a
            transport is unknown.
    """
    twice = sorted({url for url in engine_urls if list(engine_urls).count(url) > 1})
    if twice:
        raise ValueError(f"engines: {twice} given twice")
    normalized = {url.rstrip("/"): name for url, name in routes.items()}
    missing = [url for url in engine_urls if url not in normalized]
    if missing:
        raise ValueError(f"transport: no transport is given for engines {missing}")
    extra = sorted(set(normalized) - set(engine_urls))
    if extra:
        raise ValueError(f"transport: routes name engines that are not given: {extra}")
    for name in set(normalized.values()):
        check_transport(name)
    return normalized


def check_transport(name: str) -> None:
    """Raises: ValueError: `name` is not a registered transport."""
    known = transport_names()
    if name not in known:
        raise ValueError(f"transport: unknown transport {name!r}; registered: {known}")


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
        self.routes: dict[str, str] = {}
        self.children: dict[str, BucketSink] = {}
        self.name = ""
        self._session_id = ""
        self._sessions: dict[str, PushSession] = {}
        self._streams: dict[str, threading.Thread] = {}  # by transport, of the last push
        options = dict(options or {})
        try:
            for url, name in routes.items():
                self.add_route(url, name, options.get(name, {}))
        except Exception:
            self.close()
            raise

    def add_route(self, url: str, name: str, options: dict[str, Any]) -> None:
        """Route engine `url` over transport `name` from now on (its sink is made if needed).

        Raises:
            ValueError: unknown transport, or options its sink refuses.
        """
        if name not in self.children:
            self.children[name] = make_sink(name, **options)
            self.children = dict(sorted(self.children.items()))
            self.name = "+".join(self.children)
        self.routes[url.rstrip("/")] = name

    def remove_route(self, url: str) -> None:
        """Stop routing engine `url` (its transport's sink stays, for later newcomers)."""
        self.routes.pop(url.rstrip("/"), None)

    @property
    def carries_any_tensors(self) -> bool:  # type: ignore[override]
        return all(child.carries_any_tensors for child in self.children.values())

    def carries_any_tensors_from(self, ranks: int) -> bool:
        return all(child.carries_any_tensors_from(ranks) for child in self.children.values())

    @property
    def copies_locally(self) -> bool:  # type: ignore[override]
        return all(child.copies_locally for child in self.children.values())

    @property
    def mode(self) -> str:
        names = sorted(self._sessions) or list(self.children)
        return ", ".join(f"{name}: {self.children[name].mode}" for name in names)

    def _transport_of(self, url: str) -> str:
        try:
            return self.routes[url.rstrip("/")]
        except KeyError:
            raise ValueError(f"engine {url} has no transport; routes: {self.routes}") from None

    # --- set-up ---

    def keys(self) -> list[str]:
        return [key for child in self.children.values() for key in child.keys()]  # noqa: SIM118

    def setup(
        self, engines: Sequence[EngineLink], steps: Sending | None = None, **options: Any
    ) -> dict[str, Any]:
        """Set up each transport that has a set-up (`dist`) over its own engines; one left
        with no engine is torn down.

        Returns:
            Each set-up transport's report, by name.

        Raises:
            ValueError: no routed transport has a set-up.
        """
        if not any(has_setup(name) for name in self.children):
            raise ValueError(f"transports {list(self.children)} need no set-up")
        groups: dict[str, list[EngineLink]] = {}
        for engine in engines:
            groups.setdefault(self._transport_of(engine.url), []).append(engine)
        reports = {}
        for name, child in self.children.items():
            if not has_setup(name):
                continue
            if groups.get(name):
                reports[name] = child.setup(groups[name], steps=steps, **options)
            else:
                child.teardown(options.get("timeout_s", _TEARDOWN_TIMEOUT_S))
        return reports

    def teardown(self, timeout_s: float) -> None:
        for child in self.children.values():
            child.teardown(timeout_s)

    def setup_on_push(self, steps: Sending | None) -> dict[str, Any] | None:
        found = (child.setup_on_push(steps) for child in self.children.values())
        return next((options for options in found if options is not None), None)

    def setup_broken(self) -> str | None:
        reasons = (child.setup_broken() for child in self.children.values())
        return next((reason for reason in reasons if reason is not None), None)

    def teardown_engine(self, engine: EngineLink, timeout_s: float) -> None:
        self.children[self._transport_of(engine.url)].teardown_engine(engine, timeout_s)

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        siblings: dict[str, Any] = dict(sink_options)  # transports with no sink yet: as given
        for name, child in self.children.items():
            siblings[name], child_setup = child.sibling_options(
                dict(sink_options.get(name, {})), setup_options
            )
            if has_setup(name):
                setup_options = child_setup
        return siblings, setup_options

    # --- one push ---

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> RoutedDescription:
        busy = [name for name, thread in self._streams.items() if thread.is_alive()]
        if busy:  # a child sink is not made to serve two pushes at once
            raise RuntimeError(
                f"the previous push's streams are still running past its timeout: {busy}"
            )
        groups: dict[str, list[str]] = {}  # each transport's engines, in push order
        engines = []  # each engine's (transport, index among its peers)
        for url in session.engines:
            transport = self._transport_of(url)
            peers = groups.setdefault(transport, [])
            engines.append((transport, len(peers)))
            peers.append(url)
        self._session_id, self._sessions = session.session_id, {}
        parts = {}
        for position, (name, urls) in enumerate(groups.items()):
            # shares the push's digests (same dict) and byte counter (the push's `sent_bytes`
            # is the sum of its children's); an engine's answer stops its own sink only
            child_session = dataclasses.replace(
                session,
                receivers=len(urls),
                engines=tuple(urls),
                abandon_reasons=[],
                sent=session.sent,
            )
            self._sessions[name] = child_session
            child_progress = progress if position == 0 else no_progress
            parts[name] = self.children[name].prepare(child_session, sending, child_progress)
        return RoutedDescription(parts=parts, engines=engines)

    def route(self, description: SourceDescription, engine_index: int, verify: str) -> EngineRoute:
        assert isinstance(description, RoutedDescription)
        name, peer_index = description.engines[engine_index]
        return self.children[name].route(description.parts[name], peer_index, verify)

    def engine_answered(self, session: PushSession, url: str, reason: str) -> None:
        """Only the sink serving `url` stops waiting: the others' engines still read. (An
        answer to an earlier push, arriving late, concerns no current session.)"""
        name = self.routes.get(url.rstrip("/"))
        if session.session_id == self._session_id and name in self._sessions:
            self._sessions[name].abandon(reason)

    def stream(
        self,
        session: PushSession,
        sending: Sending,
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """Every child streams to its engines at the same time (in a group of several ranks,
        each rank runs the children's steps one after another, in the order announced).

        Raises:
            TimeoutError: a child timed out (the message names each child that failed).
            OSError: a child failed otherwise (the same).
        """
        errors: dict[str, BaseException] = {}
        self._streams = {}
        for position, name in enumerate(self._sessions):
            child_progress = progress if position == 0 else no_progress
            self._streams[name] = threading.Thread(
                target=self._stream_child,
                args=(name, sending, timeout_s, child_progress, errors),
                name=f"stream-{name}",
                daemon=True,
            )
            self._streams[name].start()
        deadline = time.monotonic() + timeout_s + _JOIN_MARGIN_S
        for name, thread in self._streams.items():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                errors.setdefault(name, TimeoutError("did not return"))
        _raise_combined(errors)

    def _stream_child(
        self,
        name: str,
        sending: Sending,
        timeout_s: float,
        progress: Progress,
        errors: dict[str, BaseException],
    ) -> None:
        child_session = self._sessions[name]
        try:
            self.children[name].stream(child_session, sending, timeout_s, progress)
        except BaseException as exc:  # reported by stream() with the others
            if not isinstance(exc, TimeoutError | OSError | ValueError):
                logger.exception("transport %s failed while streaming", name)
            errors[name] = exc
            for other, other_session in self._sessions.items():
                if other != name:  # the push fails: the other sinks need not wait it out
                    other_session.abandon(f"transport {name} failed: {exc}")

    def close(self) -> None:
        for child in self.children.values():
            child.close()


def _raise_combined(errors: dict[str, BaseException]) -> None:
    """One error for the push, naming every child that failed; an unexpected one (logged with
    its traceback) is reported like the others, so the Publisher still aborts every engine."""
    if not errors:
        return
    message = "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in errors.items())
    if any(isinstance(exc, TimeoutError) for exc in errors.values()):
        raise TimeoutError(message)
    raise OSError(message)
