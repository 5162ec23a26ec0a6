"""`weightbus demo --ray`: the demo's engines placed by Ray.

A local Ray instance, `--replicas` reference-engine replicas of `--tp` rank actors each (one
placement group per replica, `STRICT_PACK`), rollouts spread over the replicas, and every
step's push into all of them at once (two-phase: all serve the new version or none does).
"""

from concurrent.futures import ThreadPoolExecutor

from weightbus.apps.demo.rollout import RolloutClient
from weightbus.apps.demo.task import Rollout

# Ray's minimum object store: nothing large travels through it (weights go over `shm`).
OBJECT_STORE_BYTES = 80 * 1024 * 1024


class FleetRolloutClient:
    """Rollouts from several replicas: prompt i goes to replica i mod n, with the seeds one
    engine would use, so a run samples the same completions whatever the number of replicas.

    Args:
        urls: the replicas' base URLs.
        token: bearer token of their admin routes.
        max_tokens, temperature: as for `RolloutClient`.
    """

    def __init__(self, urls: list[str], *, token: str, max_tokens: int, temperature: float) -> None:
        self.clients = [
            RolloutClient(url, max_tokens=max_tokens, temperature=temperature, token=token)
            for url in urls
        ]
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="replica")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()

    def sample(self, prompts: list[list[int]], group_size: int, seed: int) -> list[Rollout]:
        """`group_size` completions of every prompt, the samples of a prompt adjacent."""

        def one_prompt(index: int) -> list[Rollout]:
            client = self.clients[index % len(self.clients)]
            return client.sample([prompts[index]], group_size, seed + index * group_size)

        groups = self._pool.map(one_prompt, range(len(prompts)))
        return [rollout for group in groups for rollout in group]

    def weights(self) -> dict:
        """What every replica serves; a replica that differs shows as a mismatch."""
        states = [client.weights() for client in self.clients]
        served = {(state["version"], state["fingerprint"]) for state in states}
        if len(served) == 1:
            return states[0]
        return {"version": "(replicas differ)", "fingerprint": f"replicas serve {sorted(served)}"}
