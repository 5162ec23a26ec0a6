"""Link faults at real speeds: a trainer host's or an engine host's link goes down in the middle
of a sharded push (two FSDP2 trainer ranks on their own hosts, one engine on a third, links at
100 Mbit/s), over `nixl` and `dist`. The push fails within its timeout naming what it lost, the
engine keeps serving the version before, and once the link is back the same publishers' next
push lands."""

import time

import pytest

from weightbus.apps.bench.cluster.common import write_checkpoint
from weightbus.apps.cluster import start_cluster, unavailable
from weightbus.apps.cluster.ranks import TrainerRanks
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.publisher.targets.http import HTTP_MARGIN_S

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

LINK_BITS_PER_S = 100_000_000
TIMEOUT_S = 10.0
MOVED_BYTES = 2 << 20  # the cut comes once this much crossed the victim's link


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("cluster") / "model", 16 << 20)
    with start_cluster(3, LINK_BITS_PER_S) as made:
        url = made.start_engine(
            made.hosts[2], str(checkpoint.directory), 1, ["--dtype", "bfloat16"]
        )[1]
        with TrainerRanks(made, made.hosts[:2], {"checkpoint": str(checkpoint.directory)}) as ranks:
            leader = made.hosts[0].address
            for transport, options in (
                ("nixl", {"host": leader, "ucx_tls": "tcp"}),
                ("dist", {"master_addr": leader}),
            ):
                ranks.command(
                    "open",
                    key=transport,
                    kind="sharded",
                    engines=[url],
                    options={
                        "transport": transport,
                        "control_host": leader,
                        "token": made.token,
                        "timeout_s": TIMEOUT_S,
                        "transport_options": options,
                    },
                )
            yield made, ranks, url, checkpoint.fingerprint


def _served(url: str, token: str) -> tuple[str, str]:
    target = HttpEngineTarget(url, token=token)
    try:
        weights = target.weights(30.0)
    finally:
        target.close()
    return weights.version, weights.fingerprint


@pytest.mark.parametrize("victim", ["trainer", "engine"])
@pytest.mark.parametrize("transport", ["nixl", "dist"])
def test_a_cut_link_fails_the_push_in_time_and_the_next_push_lands(hosts, transport, victim):
    made, ranks, url, fingerprint = hosts
    before = f"{transport}-{victim}-before"
    ranks.command("push", key=transport, version=before, options={}, timeout_s=120)
    host = made.hosts[1] if victim == "trainer" else made.hosts[2]
    moved = sum(host.nic_bytes())
    ranks.send("push", key=transport, version=f"{transport}-{victim}-cut", options={})
    started = time.monotonic()
    while sum(host.nic_bytes()) - moved < MOVED_BYTES:
        assert time.monotonic() - started < 30, "the push moved nothing over the link"
        time.sleep(0.005)
    made.cut(host)
    try:
        leader = ranks.answer(0, 4 * TIMEOUT_S, "push")
    finally:
        made.restore(host)
    follower = ranks.answer(1, 120, "push")

    assert not leader["ok"]
    assert not follower["ok"]
    # an engine that cannot answer is given up after the timeout and the HTTP margin
    assert leader["answered_at"] - started < TIMEOUT_S + HTTP_MARGIN_S + 5, leader["error"]
    assert leader["error"].startswith("PushError: ")
    lost = "trainer rank 1" if victim == "trainer" else url
    assert lost in leader["error"]
    assert _served(url, made.token) == (before, fingerprint)

    after = f"{transport}-{victim}-after"
    landed = ranks.command("push", key=transport, version=after, options={}, timeout_s=120)
    assert {answer["fingerprint"] for answer in landed} == {fingerprint}
    assert _served(url, made.token) == (after, fingerprint)
