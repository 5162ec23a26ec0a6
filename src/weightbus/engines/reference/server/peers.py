"""A two-phase version the trainer left undecided is settled by the fleet's engines themselves.

The trainer of a two-phase push commits every engine once all staged. If it dies after its
first commit, the committed engines serve the new version and the others would discard it
when their `timeout_s` runs out: a split fleet. So each engine of a two-phase push learns its
peers from the order (`UpdateOrder.peers`), and when no decision came within `timeout_s` of its
"staged" answer, rank 0 fences the version and sends `SettleWithPeers`; the API server then
asks every peer `POST /v1/weights/outcome`:

- any peer `committed` → this engine commits too (the trainer had decided to commit);
- every peer answered and none committed → it discards (the trainer never committed anyone:
  it commits only after every engine staged, and an asked peer that waits is fenced, so no
  late commit lands after its answer; see `engine/peer_outcome.py`);
- a peer that does not answer is asked again until `RESOLUTION_S`; if none of those that
  answered committed, the engine discards then and names the silent peers in its log. (A
  silent peer may have committed before it went silent: an engine cut off from its peers but
  not from its clients can still end on another version. No system in the field closes that
  case; it is documented in docs/fleet.md.)

Peers are asked with this engine's own `--api-token` (a fleet's engines share theirs).
"""

import asyncio
import logging
import secrets
import time

import httpx
from fastapi import APIRouter, Request

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.pending_update import PEER_RESOLUTION_S
from weightbus.engines.reference.server.engine_client import EngineClient, EngineDeadError
from weightbus.engines.reference.server.errors import APIError
from weightbus.engines.reference.server.protocol import (
    OutcomeRequest,
    OutcomeResponse,
    error_responses,
)

logger = logging.getLogger(__name__)

# How long the peers are asked before an engine decides on the answers it has (rank 0 keeps
# the staged version `PEER_RESOLUTION_S` past its `timeout_s`, longer than this).
RESOLUTION_S = PEER_RESOLUTION_S - 5.0
# Bound of one question to one peer, and the pause before asking the silent ones again.
PEER_ASK_TIMEOUT_S = 2.0
RETRY_S = 0.5
# Bound of this engine's own rank 0 answering a question or taking the decision.
RANK0_TIMEOUT_S = 10.0


async def ask_rank0(client: EngineClient, version: str, fingerprint: str | None) -> str:
    """Rank 0's outcome of `version` (asking fences a staged update).

    Raises:
        APIError: 503 when the engine died, 504 when rank 0 did not answer.
    """
    ask = messages.AskOutcome(
        request_id=secrets.token_hex(16), version=version, fingerprint=fingerprint
    )
    try:
        result = await client.update(ask, timeout_s=RANK0_TIMEOUT_S)
    except EngineDeadError as exc:
        raise APIError(503, f"engine unavailable: {exc}") from None
    except TimeoutError:
        raise APIError(504, f"rank 0 did not answer within {RANK0_TIMEOUT_S} s") from None
    assert result.outcome is not None, "rank 0 answers an AskOutcome with its outcome"
    return result.outcome


def add_outcome_route(router: APIRouter) -> None:
    @router.post("/v1/weights/outcome", responses=error_responses(400, 413, 422, 503, 504))
    async def outcome_route(body: OutcomeRequest, request: Request) -> OutcomeResponse:
        outcome = await ask_rank0(request.app.state.client, body.version, body.fingerprint)
        return OutcomeResponse(version=body.version, outcome=outcome)


class PeerResolver:
    """The settlements this engine's server runs: one per staged two-phase version rank 0
    heard no decision on (`SettleWithPeers`).

    Args:
        client: this engine's rank 0; its `SettleWithPeers` messages start a settlement.
        api_token: the bearer token the peers are asked with (None: none).
    """

    def __init__(self, client: EngineClient, api_token: str | None) -> None:
        self._client = client
        self._headers = {} if api_token is None else {"Authorization": f"Bearer {api_token}"}
        self._tasks: set[asyncio.Task] = set()
        client.on_settle = self.settle

    def settle(self, order: messages.SettleWithPeers) -> None:
        """Ask the peers what became of `order.version`, then tell rank 0 (in the background)."""
        task = asyncio.create_task(self._settle(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _settle(self, order: messages.SettleWithPeers) -> None:
        answers = await self._ask_peers(order.peers, order.version, order.fingerprint)
        committed = [peer for peer, outcome in answers.items() if outcome == "committed"]
        silent = [peer for peer in order.peers if peer not in answers]
        if committed:
            decision, reason = "commit", f"peer {committed[0]} committed it"
        else:
            decision, reason = "abort", "no peer committed it"
            if silent:
                reason += f" (no answer from {', '.join(silent)})"
        logger.warning(
            "no decision on %s from the trainer within %s s: %s, as the fleet's peers say (%s)",
            order.version,
            order.timeout_s,
            decision,
            reason,
        )
        await self._decide(order, decision, reason)

    async def _ask_peers(
        self, peers: list[str], version: str, fingerprint: str | None
    ) -> dict[str, str]:
        """Every peer's outcome, or those that answered by `RESOLUTION_S` (one committed
        answer ends the questions)."""
        answers: dict[str, str] = {}
        deadline = time.monotonic() + RESOLUTION_S
        body = {"version": version, "fingerprint": fingerprint}
        async with httpx.AsyncClient(timeout=PEER_ASK_TIMEOUT_S, headers=self._headers) as http:
            while True:
                silent = [peer for peer in peers if peer not in answers]
                outcomes = await asyncio.gather(*(_ask(http, peer, body) for peer in silent))
                answers.update((p, o) for p, o in zip(silent, outcomes, strict=True) if o)
                done = "committed" in answers.values() or len(answers) == len(peers)
                if done or time.monotonic() >= deadline:
                    return answers
                await asyncio.sleep(RETRY_S)

    async def _decide(self, order: messages.SettleWithPeers, decision: str, reason: str) -> None:
        message = messages.Decide(
            request_id=secrets.token_hex(16),
            version=order.version,
            decision=decision,
            fingerprint=order.fingerprint if decision == "commit" else None,
            reason=f"the fleet's peers: {reason}",
            timeout_s=order.timeout_s,
            by_peers=True,
        )
        try:
            result = await self._client.update(message, timeout_s=order.timeout_s + RANK0_TIMEOUT_S)
        except (EngineDeadError, TimeoutError):
            logger.exception("the peers' %s of %s did not land", decision, order.version)
            return
        if result.status_code != 200:
            logger.error("the peers' %s of %s: %s", decision, order.version, result.error)


async def _ask(http: httpx.AsyncClient, peer: str, body: dict) -> str | None:
    """One peer's outcome, or None when it did not answer."""
    try:
        response = await http.post(f"{peer.rstrip('/')}/v1/weights/outcome", json=body)
    except httpx.HTTPError as exc:
        logger.info("peer %s did not answer: %r", peer, exc)
        return None
    if response.status_code != 200:
        logger.info("peer %s answered %d: %s", peer, response.status_code, response.text[:200])
        return None
    return response.json().get("outcome")
