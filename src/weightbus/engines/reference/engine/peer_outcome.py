"""Rank 0's answer to "what became of this two-phase version here?" (`AskOutcome`).

A trainer that dies between its first and its last commit leaves some engines committed and
the others staged with no one to decide. The staged engines' API servers then ask the fleet's
peers (`server/peers.py`); rank 0 answers here from its own state, in the order its messages
arrive, so each answer is true at the moment it is given:

- `committed`: the version (with that fingerprint) is served, in the history, or its commit
  was accepted and waits for the pause mode;
- `staged`: it waits for its decision; the ask **fences** it: a commit that is not the peers'
  (`Decide.by_peers`) is refused from then on, so a peer that heard `staged` from everyone can
  discard without a late trainer commit landing behind its back;
- `receiving`: the stream is still arriving (no engine can have committed: the trainer commits
  only once every engine staged);
- `absent`: nothing of the version here (discarded, refused or never ordered).

`PeerOutcome` is mixed into `UpdateController`, whose pending update, history and replies it
reads.
"""

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.pending_update import PendingUpdate


class PeerOutcome:
    """`AskOutcome` and `SettleWithPeers` of `UpdateController`."""

    def settle_with_peers(self, update: PendingUpdate, now: float) -> None:
        """No decision came within `timeout_s`: fence the update and have the API server ask
        the peers (it answers with a `Decide` whose `by_peers` is set)."""
        update.settling_at, update.fenced = now, True
        self._send(
            messages.SettleWithPeers(
                version=update.version,
                fingerprint=self._staged_fingerprint(update),
                peers=list(update.peers),
                timeout_s=update.timeout_s,
            )
        )

    def on_ask_outcome(self, ask: messages.AskOutcome) -> None:
        outcome = self._outcome(ask.version, ask.fingerprint)
        self._send(
            messages.UpdateResult(
                update_id=ask.request_id, status_code=200, version=ask.version, outcome=outcome
            )
        )

    def _outcome(self, version: str, fingerprint: str | None) -> messages.Outcome:
        update: PendingUpdate | None = self._update
        if update is not None and update.version == version and update.two_phase:
            if update.commit_id is not None:
                return "committed"
            if update.awaiting_decision:
                update.fenced = True
                return "staged"
            return "receiving"
        served = [self._serving, *self.history]
        if any(e.version == version and fingerprint in (None, e.fingerprint) for e in served):
            return "committed"
        return "absent"
