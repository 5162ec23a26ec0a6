"""Link faults at real speeds: a trainer host's or an engine host's link goes down in the middle
of a sharded push (two FSDP2 trainer ranks on their own hosts, one engine on a third, links at
100 Mbit/s), over `nixl` and `dist`. The push fails within its timeout naming what it lost, the
engine keeps serving the version before, and once the link is back the same publishers' next
push lands.

Each transport has hosts, ranks and an engine of its own, and one victim's cuts over both run at
the same time (the push's waits, not the cores, take the time): the first test of a victim runs
both, each test checks its own transport's outcome."""

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from weightbus.apps.bench.cluster.common import start_engines, write_checkpoint
from weightbus.apps.cluster import start_cluster, unavailable
from weightbus.apps.cluster.hosts import Cluster, Host
from weightbus.apps.cluster.ranks import TrainerRanks
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.publisher.targets.http import HTTP_MARGIN_S

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

LINK_BITS_PER_S = 100_000_000
# a push takes 1.5 s (2.5 s with the cores twice loaded); the cut lasts this + HTTP_MARGIN_S, and
# TCP's retransmission backoff after it grows with it: the follower's writes resume 2-3 s after
# the link is back at 5 s, 11 s after at 10 s
TIMEOUT_S = 5.0
MOVED_BYTES = 2 << 20  # the cut comes once this much crossed the victim's link
TRANSPORTS = ("nixl", "dist")


@dataclass(frozen=True)
class Rig:
    """One transport's trainer ranks (rank i on `trainers[i]`), its engine and the publishers
    (key: the transport) every rank opened."""

    transport: str
    ranks: TrainerRanks
    trainers: list[Host]
    engine: Host
    url: str


@dataclass(frozen=True)
class Cut:
    """What one cut push and the push after it gave."""

    started: float  # when the cut push was sent (`time.monotonic()`)
    leader: dict
    follower: dict
    served_after_cut: tuple[str, str]
    landed: list[dict]
    served_after: tuple[str, str]


@pytest.fixture(scope="module")
def rigs(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("cluster") / "model", 16 << 20)
    spec = {"checkpoint": str(checkpoint.directory)}
    with start_cluster(3 * len(TRANSPORTS), LINK_BITS_PER_S) as made:
        hosts = {t: made.hosts[3 * i : 3 * i + 3] for i, t in enumerate(TRANSPORTS)}
        engines = [hosts[t][2] for t in TRANSPORTS]
        urls = start_engines(made, engines, str(checkpoint.directory), 1, ("--dtype", "bfloat16"))
        # ranks left unclosed by a failed start are killed with the cluster
        with ThreadPoolExecutor(len(TRANSPORTS)) as pool:
            starting = [pool.submit(TrainerRanks, made, hosts[t][:2], spec) for t in TRANSPORTS]
        made_rigs = {
            t: Rig(t, started.result(), hosts[t][:2], hosts[t][2], url)
            for t, started, url in zip(TRANSPORTS, starting, urls, strict=True)
        }
        try:
            for rig in made_rigs.values():
                _open(made, rig)
            yield made, made_rigs, checkpoint.fingerprint
        finally:
            for rig in made_rigs.values():
                rig.ranks.close()


def _open(made: Cluster, rig: Rig) -> None:
    leader = rig.trainers[0].address
    options = (
        {"host": leader, "ucx_tls": "tcp"} if rig.transport == "nixl" else {"master_addr": leader}
    )
    rig.ranks.command(
        "open",
        key=rig.transport,
        kind="sharded",
        engines=[rig.url],
        options={
            "transport": rig.transport,
            "control_host": leader,
            "token": made.token,
            "timeout_s": TIMEOUT_S,
            "transport_options": options,
        },
    )


@pytest.fixture(scope="module")
def cuts(rigs) -> Callable[[str], dict[str, Future]]:
    """`victim` -> each transport's `Cut` (a future: its error, if any, is its test's), the
    transports' cuts run at the same time on the victim's first use."""
    made, by_transport, _ = rigs
    done: dict[str, dict[str, Future]] = {}

    def of(victim: str) -> dict[str, Future]:
        if victim not in done:
            with ThreadPoolExecutor(len(by_transport)) as pool:
                done[victim] = {
                    t: pool.submit(_cut, made, rig, victim) for t, rig in by_transport.items()
                }
        return done[victim]

    return of


def _served(url: str, token: str) -> tuple[str, str]:
    target = HttpEngineTarget(url, token=token)
    try:
        weights = target.weights(30.0)
    finally:
        target.close()
    return weights.version, weights.fingerprint


def _cut(made: Cluster, rig: Rig, victim: str) -> Cut:
    """A push, then a push cut once MOVED_BYTES crossed the victim's link (back up once rank 0
    answered), then the next push."""
    ranks, key = rig.ranks, rig.transport
    ranks.command("push", key=key, version=f"{key}-{victim}-before", options={}, timeout_s=120)
    host = rig.trainers[1] if victim == "trainer" else rig.engine
    moved = sum(host.nic_bytes())
    ranks.send("push", key=key, version=f"{key}-{victim}-cut", options={})
    started = time.monotonic()
    while sum(host.nic_bytes()) - moved < MOVED_BYTES:
        assert time.monotonic() - started < 30, f"{key}: the push moved nothing over the link"
        time.sleep(0.005)
    made.cut(host)
    try:
        # past the bound its test asserts: a late answer fails there, naming the error
        leader = ranks.answer(0, TIMEOUT_S + HTTP_MARGIN_S + 30, "push")
    finally:
        made.restore(host)
    follower = ranks.answer(1, 120, "push")
    served_after_cut = _served(rig.url, made.token)
    after = f"{key}-{victim}-after"
    landed = ranks.command("push", key=key, version=after, options={}, timeout_s=120)
    return Cut(started, leader, follower, served_after_cut, landed, _served(rig.url, made.token))


@pytest.mark.parametrize("victim", ["trainer", "engine"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_cut_link_fails_the_push_in_time_and_the_next_push_lands(rigs, cuts, transport, victim):
    _, by_transport, fingerprint = rigs
    rig, cut = by_transport[transport], cuts(victim)[transport].result()
    leader = cut.leader

    assert not leader["ok"]
    assert not cut.follower["ok"]
    # an engine that cannot answer is given up after the timeout and the HTTP margin
    assert leader["answered_at"] - cut.started < TIMEOUT_S + HTTP_MARGIN_S + 5, leader["error"]
    assert leader["error"].startswith("PushError: ")
    lost = "trainer rank 1" if victim == "trainer" else rig.url
    assert lost in leader["error"]
    assert cut.served_after_cut == (f"{transport}-{victim}-before", fingerprint)

    assert {answer["fingerprint"] for answer in cut.landed} == {fingerprint}
    assert cut.served_after == (f"{transport}-{victim}-after", fingerprint)
