"""What a Publisher does collectively, on every rank of its trainer group: pushes (whole, as a
delta, an adapter), rollbacks, engines joining and leaving, fingerprints, transport set-up.

Each call is a round (`ranks.Round`): every rank holds its weights (`hold`), the ranks agree
on the layout, the leader does the work that talks to the engines (`lead`), and the others do
what it announces until its outcome, which every rank returns or raises alike. In a group of
one the leader is alone and nothing is announced: the same code, nothing crosses a process.
"""

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import torch

from weightbus.core.finite import NOTHING_SERVED, NonFiniteWeightsError
from weightbus.core.fp8 import Fp8Block, describe
from weightbus.core.lora import adapter_tensors, check_adapter
from weightbus.core.publisher.adapter import AdapterState
from weightbus.core.publisher.delta import DeltaMode, DeltaState, check_delta_mode
from weightbus.core.publisher.fleet import Fleet
from weightbus.core.publisher.push_session import (
    PushArgs,
    PushRequest,
    catch_up,
    push_options,
    push_version,
    stream_refuses_nonfinite,
)
from weightbus.core.publisher.ranks import Round, TrainerRanks
from weightbus.core.publisher.results import PushResult
from weightbus.core.publisher.targets import EngineResult, EngineTarget, HttpEngineTarget
from weightbus.core.trainer.holdings import Holding, holdings_of
from weightbus.core.trainer.layout import TrainerLayout
from weightbus.core.trainer.quantize import quantized_holdings
from weightbus.core.weights import NameMap
from weightbus.core.wire import PauseMode

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Held:
    """What every rank holds of one round's weights, agreed, and this rank's own holdings."""

    layout: TrainerLayout
    holdings: dict[str, Holding]


class Pushes:
    """The collective calls of one Publisher (every rank has one; only the leader's has a
    fleet).

    Args:
        ranks: the trainer group.
        fleet: the engines (the leader; None on the others).
        timeout_s: bound of one round.
        quantize: block FP8 applied to what each rank holds before anything is sent.
        deltas: this rank's delta base and the decisions about it.
    """

    def __init__(
        self,
        ranks: TrainerRanks,
        fleet: Fleet | None,
        *,
        timeout_s: float,
        quantize: Fp8Block | None,
        deltas: DeltaState,
        delta_mode: DeltaMode,
        http: httpx.Client | None = None,
    ) -> None:
        self.ranks, self.fleet, self.timeout_s = ranks, fleet, timeout_s
        self.quantize, self.deltas, self.delta_mode = quantize, deltas, delta_mode
        self.adapter = AdapterState()
        self.http = http or httpx.Client()

    @classmethod
    def build(
        cls,
        engines: Sequence[str | EngineTarget] | None,
        ranks: TrainerRanks,
        *,
        transport: str | Mapping[str, str],
        token: str | None,
        timeout_s: float,
        transport_options: dict[str, Any],
        **options: Any,
    ) -> "Pushes":
        """The calls of a Publisher: on the leader, a fleet of `engines` over `transport`.

        Raises:
            ValueError: the leader has no engines, or an unknown transport.
        """
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        http = httpx.Client(headers=headers)
        fleet = None
        try:
            if ranks.is_leader:
                if not engines:
                    raise ValueError("engines: give at least one engine URL or target")  # noqa: TRY301
                targets = [_target(engine, http) for engine in engines]
                fleet = Fleet.build(targets, transport, transport_options, timeout_s)
        except Exception:
            http.close()
            raise
        return cls(ranks, fleet, timeout_s=timeout_s, http=http, **options)

    def target(self, engine: str | EngineTarget) -> EngineTarget:
        """`engine` as a target (a URL: the reference engine's HTTP API)."""
        return _target(engine, self.http)

    def close(self) -> None:
        """Free the fleet (leader), every sender of this rank and the HTTP connections."""
        if self.fleet is not None:
            self.fleet.close()
        self.ranks.close()
        self.http.close()

    @property
    def leader_fleet(self) -> Fleet:
        if self.fleet is None:
            raise ValueError(
                "only the leader (trainer rank 0) talks to the engines: ask it, not rank "
                f"{self.ranks.rank}"
            )
        return self.fleet

    # --- a round ---

    def round(self, timeout_s: float | None = None) -> Round:
        return self.ranks.begin(timeout_s or self.timeout_s)

    def hold(
        self, round_: Round, weights: Any, name_map: NameMap | None, *, quantized: bool = True
    ) -> Held:
        """This rank's holdings of `weights` (renamed, quantized with the Publisher's
        `quantize`), and the layout every rank agrees on.

        Raises:
            TypeError, ValueError, NonFiniteWeightsError: this rank's weights are refused (its
                own error; the others raise `TrainerRankError` naming it).
            TrainerRankError: another rank failed, died or did not report (named).
        """
        try:
            holdings, tied = holdings_of(weights, name_map)
            if quantized and self.quantize is not None:
                holdings = quantized_holdings(holdings, self.quantize)
        except Exception as exc:
            self.ranks.refuse_failure(round_, exc)
            raise
        layout = self.ranks.agree(round_, holdings, tied)
        names = layout.metas_by_name
        return Held(layout, {h.name: h for h in holdings if h.name in names})

    def collective(
        self, round_: Round, held: Held | None, lead: Callable[[], Any], result_type: Any
    ) -> Any:
        """The leader runs `lead`; the others follow it. Every rank returns its outcome."""
        if self.ranks.is_leader:
            if self.fleet is not None:  # a set-up the ranks join reaches them in this round
                self.fleet.steps = self.ranks.sending(round_, _NO_LAYOUT, {})
            return self.ranks.lead(round_, lead)
        layout = held.layout if held else _NO_LAYOUT
        holdings = held.holdings if held else {}
        return self.ranks.follow(round_, layout, holdings, result_type, self.deltas.step_handlers())

    # --- pushes ---

    def push(self, weights: Any, args: PushArgs) -> PushResult:
        """`Publisher.push` on this rank."""
        if args.adapter is not None:
            return self.push_adapter(weights, args)
        mode = self.delta_mode if args.delta is None else check_delta_mode(args.delta)
        round_ = self.round()
        held = self.hold(round_, weights, args.name_map)
        result = self.collective(
            round_, held, lambda: self._lead_push(round_, held, args, mode), PushResult
        )
        self.deltas.landed(result, held, args.version, mode)
        self.adapter.whole_pushed(result.fingerprint)
        if self.quantize is None:
            return result
        return dataclasses.replace(result, quantization=describe(self.quantize))

    def _lead_push(self, round_: Round, held: Held, args: PushArgs, mode: DeltaMode) -> PushResult:
        fleet = self.leader_fleet
        options = push_options(fleet, args)
        may_go_as_delta = mode != "never" and self.deltas.base is not None
        in_stream = not args.allow_nonfinite and stream_refuses_nonfinite(
            fleet, options, delta=may_go_as_delta
        )
        if not args.allow_nonfinite and not in_stream:
            self.ranks.check_nonfinite(round_, held.layout, held.holdings)
        request = PushRequest.of(held, round_, args, options, nonfinite_in_stream=in_stream)
        try:
            return push_version(fleet, self.ranks, self.deltas, request, mode)
        except NonFiniteWeightsError:
            # the stream named the first bad tensor it met: name them all, with counts
            self.ranks.check_nonfinite(round_, held.layout, held.holdings, NOTHING_SERVED)
            raise

    def push_adapter(self, weights: Any, args: PushArgs) -> PushResult:
        """A LoRA adapter push: each rank sends its shards of the adapter's matrices only."""
        if args.delta not in (None, "never") or args.name_map is not None or self.quantize:
            raise ValueError(
                "an adapter push goes whole and as trained: no delta, name_map or quantize"
            )
        spec = self.adapter.spec_for(args.adapter, args.base_fingerprint)
        round_ = self.round()
        held = self.hold(round_, _adapter_of(weights), None, quantized=False)
        check_adapter(_meta_tensors(held.layout), spec)
        return self._adapter_round(round_, held, args, spec, check=not args.allow_nonfinite)

    def remove_adapter(self, args: PushArgs) -> PushResult:
        """Zeros of the last adapter's shapes, with the adapter off (the leader sends them)."""
        zeros, spec = self.adapter.removal()
        round_ = self.round()
        held = self.hold(round_, zeros if self.ranks.is_leader else {}, None, quantized=False)
        return self._adapter_round(round_, held, args, spec, check=False)

    def _adapter_round(
        self, round_: Round, held: Held, args: PushArgs, spec: Any, *, check: bool
    ) -> PushResult:
        """Push `held` whole with the adapter `spec` (`check`: NaN/inf refused, in the stream's
        copies where `stream_refuses_nonfinite` allows, else before it); the adapter state
        follows once it landed."""

        def lead() -> PushResult:
            fleet = self.leader_fleet
            options = msgspec.structs.replace(push_options(fleet, args), adapter=spec)
            in_stream = check and stream_refuses_nonfinite(fleet, options, delta=False)
            if check and not in_stream:
                self.ranks.check_nonfinite(round_, held.layout, held.holdings)
            request = PushRequest.of(held, round_, args, options, nonfinite_in_stream=in_stream)
            try:
                result = push_version(fleet, self.ranks, self.deltas, request, "never")
            except NonFiniteWeightsError:  # the stream named the first: name them all
                self.ranks.check_nonfinite(round_, held.layout, held.holdings, NOTHING_SERVED)
                raise
            return dataclasses.replace(result, adapter=spec)

        result = self.collective(round_, held, lead, PushResult)
        self.adapter.committed(held.layout.metas, spec)
        return result

    # --- the fleet ---

    def rollback(self, pause_mode: PauseMode, timeout_s: float | None) -> PushResult:
        round_ = self.round(timeout_s)
        result = self.collective(
            round_, None, lambda: self.leader_fleet.rollback(pause_mode, timeout_s), PushResult
        )
        self.adapter.rolled_back(result.fingerprint)
        return result

    def add_engine(
        self,
        target: EngineTarget | None,
        weights: Any,
        name_map: NameMap | None,
        route: str | None,
        lock: Any,
    ) -> EngineResult | None:
        """The leader brings `target` to the fleet's version (every rank sends it what it
        holds; in a group of one, beside pushes to the members), then counts it as a member
        under `lock`."""
        round_ = self.round()
        held = None if weights is None else self.hold(round_, weights, name_map)

        def lead() -> EngineResult | None:
            fleet = self.leader_fleet
            if target is None:
                raise ValueError("engine: give the newcomer's URL or target")
            newcomer_route = fleet.newcomer_route(target.url, route)
            current, result = fleet.version, None
            if current is not None:
                result = catch_up(
                    fleet, self.ranks, target, round_=round_, held=held, route=newcomer_route
                )
            with lock:
                fleet.admit(target, newcomer_route, current)
            logger.info("engine %s joined the fleet", target.url)
            return result

        return self.collective(round_, held, lead, EngineResult | None)

    def remove_engine(self, url: str) -> None:
        self.collective(self.round(), None, lambda: self.leader_fleet.remove(url), type(None))

    def setup_transport(self, options: dict[str, Any]) -> Any:
        return self.collective(self.round(), None, lambda: self.leader_fleet.setup(**options), Any)

    def teardown_transport(self, timeout_s: float) -> None:
        round_ = self.round()
        self.collective(round_, None, lambda: self.leader_fleet.teardown(timeout_s), type(None))

    # --- digests ---

    def fingerprint(self, weights: Any, name_map: NameMap | None) -> str:
        """The fingerprint engines report after a push of `weights` (each rank digests its
        share: no gather)."""
        round_ = self.round()
        held = self.hold(round_, weights, name_map)
        return self.collective(
            round_, held, lambda: self.ranks.fingerprint(round_, held.layout, held.holdings), str
        )

    def set_delta_base(self, weights: Any, version: str, name_map: NameMap | None) -> str:
        """Take `weights` as the version the engines serve (each rank keeps a copy of what it
        holds): the next push may be a delta against it."""
        round_ = self.round()
        held = self.hold(round_, weights, name_map)
        digests = self.collective(
            round_, held, lambda: self.ranks.digests(round_, held.layout, held.holdings), dict
        )
        fingerprint = self.deltas.committed_full(held, version, digests)
        self.adapter.base_fingerprint = fingerprint
        return fingerprint


def _target(engine: str | EngineTarget, http: httpx.Client) -> EngineTarget:
    return HttpEngineTarget(engine, client=http) if isinstance(engine, str) else engine


def _adapter_of(weights: Any) -> Any:
    """The adapter's matrices of `weights` under peft's names; a rank holding none of them
    (a pipeline stage without adapted layers) holds nothing."""
    if isinstance(weights, dict) and not weights:
        return weights
    return adapter_tensors(weights)


def _meta_tensors(layout: TrainerLayout) -> dict[str, torch.Tensor]:
    return {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in layout.metas}


_NO_LAYOUT = TrainerLayout(((),))
