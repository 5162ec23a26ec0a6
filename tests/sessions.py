"""One process driving a sink by hand: its sessions and what it sends, as a group of one (a
Publisher builds both itself: `push_session.PushRun`)."""

import secrets
import time
from collections.abc import Sequence

import torch

from weightbus.core.meta import metas_of
from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.trainer.group import TrainerGroup
from weightbus.core.trainer.holdings import whole_holding
from weightbus.core.trainer.layout import TrainerLayout, held_metas
from weightbus.core.transport import PushSession, RankSender, Sending, make_rank_sender


class SessionFactory:
    """Builds push sessions of one process, reusing the plan while the layout is unchanged."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._plan: Plan | None = None
        self._group = TrainerGroup.local()
        self._senders: dict[str, RankSender] = {}
        self._rounds = 0

    def plan_for(self, weights: Sequence[tuple[str, torch.Tensor]]) -> Plan:
        metas = tuple(metas_of(weights))
        if self._plan is None or self._plan.metas != metas:
            self._plan = plan_buckets(metas, self.bucket_bytes)
        return self._plan

    def session(
        self,
        weights: Sequence[tuple[str, torch.Tensor]],
        version: str,
        step: int | None,
        receivers: int = 1,
        *,
        verify: bool = True,
        engines: tuple[str, ...] = (),
    ) -> PushSession:
        return PushSession(
            session_id=secrets.token_hex(16),
            version=version,
            step=step,
            plan=self.plan_for(weights),
            receivers=receivers,
            verify=verify,
            engines=engines,
        )

    def sending(
        self,
        weights: Sequence[tuple[str, torch.Tensor]],
        *,
        timeout_s: float = 60.0,
        refuse_nonfinite: bool = False,
    ) -> Sending:
        """What this process sends of `weights` (every tensor whole), as a sink takes it."""
        holdings = [whole_holding(name, tensor) for name, tensor in weights]
        self._rounds += 1
        key = f"by-hand/{self._rounds}"
        steps = iter(range(1, 1 << 62))
        return Sending(
            layout=TrainerLayout((tuple(held_metas(holdings)),)),
            holdings={h.name: h for h in holdings},
            group=self._group,
            next_key=lambda: f"{key}/step/{next(steps)}",
            deadline=time.monotonic() + timeout_s,
            senders=self._sender,
            refuse_nonfinite=refuse_nonfinite,
        )

    def _sender(self, sink: str, transport: str) -> RankSender:
        if sink not in self._senders:
            self._senders[sink] = make_rank_sender(transport, self._group)
        return self._senders[sink]

    def close(self) -> None:
        """Free the senders (mapped files, agents)."""
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
