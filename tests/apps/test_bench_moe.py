"""`weightbus bench moe --trainer-ranks`, bounded: its rows on 2 expert-parallel trainer ranks
(real processes, FSDP2 on a gloo mesh) into the tiny Qwen3-MoE's shared EP-2 engine. Outcomes,
not times: every push's fingerprint is the checkpoint's, and each rank's bytes are
`weightbus plan --trainer-layout ep`'s."""

from typing import TYPE_CHECKING

import pytest
from safetensors.torch import load_file

from weightbus.apps.bench.moe_ranks import RankRun, check, planned_sends, run_ranks, table
from weightbus.core.digest import fingerprint

if TYPE_CHECKING:
    from process_pool import SharedProcesses

pytestmark = pytest.mark.e2e


def test_expert_parallel_rows_send_each_rank_its_experts_and_gather_for_the_baseline(
    shared_processes: "SharedProcesses", tmp_path
):
    # the EP-2 engine the MoE push tests share (tests/core/pushes/moe_fleet.py: `ep2`), its
    # experts placed linearly as the plan places them (another module may have moved them)
    engine = shared_processes.moe_engine("--tp", "2", "--expert-parallel", log_dir=tmp_path)
    response = engine.client.post("/v1/experts/place", json={"placement": "linear"})
    assert response.status_code == 200, response.text
    checkpoint = shared_processes.moe_checkpoint()
    run = RankRun(str(checkpoint), engine.url, tp=2, repeat=1, timeout_s=240)

    ranks = run_ranks(run, 2, tmp_path / "ranks")

    expected = fingerprint(load_file(checkpoint / "model.safetensors"))
    assert check({2: ranks}, expected) == []
    assert engine.client.get("/v1/weights").json()["fingerprint"] == expected
    rows = ranks[0]["rows"]
    assert list(rows) == [
        "floor", "gather alone", "shm: EP ranks", "shm: full_tensor + rank 0", "dist: EP ranks",
        "dist: full_tensor + rank 0",
    ]  # fmt: skip
    for transport in ("shm", "dist"):
        sent = [rank["rows"][f"{transport}: EP ranks"]["sent_bytes"] for rank in ranks]
        assert sent == planned_sends(run, transport, 2), transport
        assert all(nbytes > 0 for nbytes in sent), transport  # each rank its own experts
        gathered = [rank["rows"][f"{transport}: full_tensor + rank 0"] for rank in ranks]
        assert [row["sent_bytes"] for row in gathered] == [
            planned_sends(run, transport, 1)[0],
            0,
        ], transport
        assert all(row["fingerprint"] == expected for row in gathered[:1]), transport
    # the printed rows: the EP rows beside the plan, with the gather's cost over them
    lines = {line[1]: line for line in table(run, {2: ranks})}
    assert lines["shm: EP ranks"][5] == lines["shm: EP ranks"][6]  # sent == planned
    assert lines["shm: EP ranks"][4].endswith("x")
