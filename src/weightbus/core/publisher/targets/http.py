"""An engine that speaks weightbus's HTTP control plane: the reference engine (`weightbus serve`),
in the conventions of SGLang's `/v1/update_weights`; any transport's set-up travels through
`/v1/setup_transport` and `/v1/teardown_transport`."""

import dataclasses

import httpx
import msgspec

from weightbus.core.fixes import with_fix
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.targets.base import (
    EngineResult,
    EngineTarget,
    EngineWeights,
    PushOrder,
    RollbackOrder,
)
from weightbus.core.transport.base import EngineRequestError
from weightbus.core.wire.messages import SliceSpec
from weightbus.core.wire.phases import EnginePhases

# Margin on top of an update's own timeout for the HTTP answer to travel back.
HTTP_MARGIN_S = 10.0
# Where any transport's rank set-up and tear-down go (`{transport, request}`).
SETUP_ROUTE = "/v1/setup_transport"
TEARDOWN_ROUTE = "/v1/teardown_transport"
# Bound of a probe's scoring call and of the rollback after a failed probe.
PROBE_TIMEOUT_S = 30.0


def error_reason(response: httpx.Response) -> str:
    """`HTTP <status>: <message>` of an error answer, with the offending tensors if named."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else body
    names = body.get("names") if isinstance(body, dict) else None
    suffix = f" (tensors: {names})" if names else ""
    return f"HTTP {response.status_code}: {message}{suffix}"


def request_json(
    http: httpx.Client,
    method: str,
    url: str,
    path: str,
    timeout_s: float,
    *,
    name_path: bool = False,
    **kwargs: object,
) -> dict:
    """One request whose answer must be 200; its JSON body (`{}` when empty).

    Raises:
        EngineRequestError: no answer, or another status (`error_reason`; prefixed with the
            path when `name_path`, for APIs where one update takes several calls).
    """
    prefix = f"{path}: " if name_path else ""
    try:
        response = http.request(method, f"{url}{path}", timeout=timeout_s, **kwargs)
    except httpx.ConnectError as exc:  # the first error of a newcomer: nothing listens there
        reason = f"{prefix}{type(exc).__name__}: {exc}"
        fix = f"start the engine (`weightbus serve`, or vLLM: docs/vllm.md) or check the URL {url}"
        raise EngineRequestError(with_fix(reason, fix)) from None
    except httpx.HTTPError as exc:
        raise EngineRequestError(f"{prefix}{type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise EngineRequestError(f"{prefix}{error_reason(response)}")
    return response.json() if response.content else {}


class EngineExperts(msgspec.Struct, frozen=True, kw_only=True):
    """A mixture-of-experts engine's live expert map (`GET /v1/experts`): `expert_map[r][s]`
    is the expert that slot `s` of expert-parallel rank `r` holds; `hash` identifies it."""

    expert_map: list[list[int]]
    hash: str
    placement: str
    redundant_experts: int
    num_experts: int


def _engine_phases(body: object) -> EnginePhases | None:
    """The engine's phases from an answer's `engine_phases` (None when absent or malformed:
    they only report where the time went)."""
    try:
        return None if body is None else msgspec.convert(body, EnginePhases)
    except msgspec.ValidationError:
        return None


class HttpEngineTarget(EngineTarget):
    """An engine reached at `url` over weightbus's HTTP API.

    Args:
        url: the engine's base URL.
        token: bearer token of the admin routes, if the engine requires one.
        client: an HTTP client to share between targets (the target then does not close it).
    """

    supports_two_phase = True
    stages_before_loading = True
    answers_peers = True
    scores_probes = True

    def __init__(
        self, url: str, *, token: str | None = None, client: httpx.Client | None = None
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owns_client = client is None
        self._http = client if client is not None else httpx.Client(headers=headers)
        # a two-phase push's probe, checked once its version is committed: (version, probe)
        self._pending_probe: tuple[str, LogprobProbe] | None = None

    def _request(self, method: str, path: str, timeout_s: float, **kwargs: object) -> dict:
        return request_json(self._http, method, self.url, path, timeout_s, **kwargs)

    def update(self, order: PushOrder) -> EngineResult:
        body = order.engine_fields()
        answer = self._request(
            "POST", "/v1/update_weights", order.timeout_s + HTTP_MARGIN_S, json=body
        )
        result = self._result(answer)
        self._pending_probe = None
        if order.probe is not None and result.staged:
            self._pending_probe = (order.version, order.probe)
        elif order.probe is not None:
            self._check_probe(order.probe, order.version)
        return result

    def _result(self, answer: dict) -> EngineResult:
        return EngineResult(
            url=self.url,
            version=answer["version"],
            fingerprint=answer.get("fingerprint"),
            nbytes=answer.get("bytes", 0),
            seconds=answer.get("seconds", 0.0),
            phases=answer.get("phases", {}),
            staged=answer.get("staged", False),
            rank_nbytes=answer.get("rank_bytes", []),
            engine_phases=_engine_phases(answer.get("engine_phases")),
        )

    def slice_maps(self, timeout_s: float) -> list[list[SliceSpec]] | None:
        answer = self._request("GET", "/v1/weights/layout", timeout_s)
        try:
            return msgspec.convert(answer["ranks"], list[list[SliceSpec]])
        except (KeyError, TypeError, msgspec.ValidationError) as exc:
            raise EngineRequestError(f"{self.url}: unreadable slice maps: {exc}") from None

    def expert_map(self, timeout_s: float) -> EngineExperts | None:
        """The engine's live expert map, read with the slice maps that follow it
        (`GET /v1/weights/layout`); None for a dense model.

        Raises:
            EngineRequestError: no answer, another status, or an unreadable map.
        """
        answer = self._request("GET", "/v1/weights/layout", timeout_s)
        try:
            raw = answer.get("expert_map")
            return None if raw is None else msgspec.convert(raw, EngineExperts)
        except msgspec.ValidationError as exc:
            raise EngineRequestError(f"{self.url}: unreadable expert map: {exc}") from None

    def expert_map_hash(self, timeout_s: float) -> str | None:
        experts = self.expert_map(timeout_s)
        return None if experts is None else experts.hash

    def commit(self, version: str, fingerprint: str | None, timeout_s: float) -> EngineResult:
        body = {"version": version, "fingerprint": fingerprint, "timeout_s": timeout_s}
        answer = self._request("POST", "/v1/commit_weights", timeout_s + HTTP_MARGIN_S, json=body)
        pending, self._pending_probe = self._pending_probe, None
        if pending is not None and pending[0] == version:
            self._check_probe(pending[1], version)
        return self._result(answer)

    def abort(self, version: str, reason: str, timeout_s: float) -> None:
        self._pending_probe = None
        body = {"version": version, "reason": reason[:1000]}
        self._request("POST", "/v1/abort_weights", timeout_s, json=body)

    def rollback(self, order: RollbackOrder) -> EngineResult:
        body = dataclasses.asdict(order)  # version, fingerprint, pause_mode, two_phase, timeout_s
        answer = self._request(
            "POST", "/v1/rollback_weights", order.timeout_s + HTTP_MARGIN_S, json=body
        )
        return self._result(answer)

    def score(self, token_ids: tuple[int, ...] | list[int]) -> list[float]:
        """The engine's logprob of each token after the first, teacher-forced
        (`prompt_logprobs` on `/v1/completions`)."""
        body = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0}
        body["prompt_logprobs"] = True
        answer = self._request("POST", "/v1/completions", PROBE_TIMEOUT_S, json=body)
        return answer["choices"][0]["prompt_logprobs"][1:]

    def _check_probe(self, probe: LogprobProbe, version: str) -> None:
        """Fail closed: a gap above the tolerance, a non-finite logprob on either side, or a
        scoring call that fails each roll the engine back to the version it held before (an
        atomic push keeps it), or say it still serves `version`.

        Raises:
            EngineRequestError: the probe failed (the gap, and what the engine serves now).
        """
        try:
            gap = probe.gap(self.score(probe.token_ids))
        except (EngineRequestError, KeyError, IndexError, TypeError, ValueError) as exc:
            reason = f"the engine could not score the probe ({exc})"
        else:
            if gap <= probe.tolerance:
                return
            reason = f"{probe.gap_reason(gap)}, so the engine does not serve the pushed weights"
        raise EngineRequestError(
            f"logprob probe failed after loading {version!r}: {reason}; {self._undo(version)}"
        )

    def _undo(self, version: str) -> str:
        """Roll back after a failed probe, if the engine still serves `version`; what it
        serves then (never raises: the probe's failure is the error to report)."""
        try:
            weights = self.weights(PROBE_TIMEOUT_S)
            if weights.version != version:
                return f"it serves {weights.version!r} now: not rolled back"
            held = weights.rollback
            if held is None:
                return f"it still serves {version!r}: it holds no previous version to roll back to"
            order = RollbackOrder(
                version=held["version"],
                fingerprint=held["fingerprint"],
                pause_mode="drain",
                two_phase=False,
                timeout_s=PROBE_TIMEOUT_S,
            )
            served = self.rollback(order).version
        except EngineRequestError as exc:
            return f"the rollback failed ({exc}): it may still serve {version!r}"
        return f"rolled back to {served!r}"

    def weights(self, timeout_s: float) -> EngineWeights:
        answer = self._request("GET", "/v1/weights", timeout_s)
        return EngineWeights(
            url=self.url,
            version=answer["version"],
            fingerprint=answer["fingerprint"],
            status=answer["status"],
            step=answer.get("step"),
            history=answer.get("history", []),
            rollback=answer.get("rollback"),
            rollback_unavailable=answer.get("rollback_unavailable", ""),
            draft=answer.get("draft"),
        )

    def tp_size(self, timeout_s: float) -> int:
        return self._request("GET", "/v1/server_info", timeout_s)["tp_size"]

    def setup_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        self._post_setup(SETUP_ROUTE, transport, info, timeout_s)

    def teardown_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        self._post_setup(TEARDOWN_ROUTE, transport, info, timeout_s)

    def _post_setup(
        self, path: str, transport: str, info: msgspec.Struct, timeout_s: float
    ) -> None:
        body = {"transport": transport, "request": msgspec.to_builtins(info)}
        self._request("POST", path, timeout_s, json=body)

    def close(self) -> None:
        if self._owns_client:
            self._http.close()
