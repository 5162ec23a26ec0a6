"""vLLM's prefix cache across a push: dropped once the new weights are loaded, before vLLM
serves again, explicitly (`POST /reset_prefix_cache`, a route of vLLM's dev mode, which
weightbus's backend needs anyway).

vLLM's `/pause` clears the cache only through its `clear_cache` default, which vLLM's
docstring marks deprecated and which it ignores in mode `keep` (weightbus's `in_place`): a
prompt cached under the old weights was then served from their KV after a push (384 of 448
prompt tokens, tokens matching neither version). So weightbus pauses with `clear_cache=false`
and resets the cache itself, unless the order keeps it (`keep_prefix_cache`).

vLLM cannot drop cached blocks that running requests hold: in mode `keep` (an `in_place`
push) the reset preempts the running requests (`reset_running_requests`), which then compute
their KV again on the new weights (`running_kv="recompute"` in effect, whatever the order
asked; `keep_prefix_cache=True` keeps both the cache and the running requests' KV).
"""

import time
from collections.abc import Callable
from typing import Any

from weightbus.core.transport.base import EngineRequestError

# a reset with no request running fails only while blocks are still being freed: retried
_RESET_TRIES = 5
_RESET_RETRY_S = 0.2
_RESET_TIMEOUT_S = 30.0


def reset_prefix_cache(
    request: Callable[..., dict],
    url: str,
    order: Any,
    phases: dict[str, float],
    *,
    requests_running: bool,
) -> None:
    """Drop vLLM's prefix cache after `order`'s weights loaded (nothing when the order keeps
    it); `phases["prefix_reset_s"]` its time.

    Args:
        request: the target's `(method, path, timeout_s, **kwargs) -> JSON` call.
        order: the push, commit or rollback order (its `keep_prefix_cache`).
        requests_running: requests may hold blocks (vLLM paused in mode `keep`, or not
            paused at all): they are preempted and recompute on the new weights.

    Raises:
        EngineRequestError: vLLM kept its cache (it stays paused: fail closed).
    """
    if getattr(order, "keep_prefix_cache", False):
        return
    tick = time.perf_counter()
    params = {"reset_running_requests": "true" if requests_running else "false"}
    for _ in range(_RESET_TRIES):
        if request("POST", "/reset_prefix_cache", _RESET_TIMEOUT_S, params=params).get("success"):
            phases["prefix_reset_s"] = time.perf_counter() - tick
            return
        time.sleep(_RESET_RETRY_S)
    raise EngineRequestError(
        f"{url}: vLLM did not drop its prefix cache after the new weights loaded "
        f"({_RESET_TRIES} tries of /reset_prefix_cache), so it would serve KV of the old "
        "weights (vLLM stays paused until a good push)"
    )
