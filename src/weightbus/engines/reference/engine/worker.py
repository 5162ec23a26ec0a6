"""The per-rank worker process and its event loop.

Every rank runs the same loop, one iteration per model step:

    _recv_requests -> _schedule -> _broadcast_batch -> _forward -> _sample -> _send_outputs

With a draft model (`num_speculative_tokens` > 0), a step whose sequences all decode is a
speculative one instead (`engine/speculative.py`): its plan follows the batch broadcast, and
`_forward` + `_sample` become draft passes, one verifying pass and rank 0's acceptance.

Rank 0 (the driver) owns the scheduler and talks to the API server over ZMQ `ipc://`; it
decides the batch and broadcasts it to the other ranks as int64 tensors on the TP gloo group
(a fixed-size header, then slots/positions/token ids, then the step's prefix-cache KV copies,
which every rank runs before the forward pass: `engine/prefix_cache.py`). All ranks run the
forward pass; rank 0 samples and sends the new tokens back. When idle, rank 0 still broadcasts
an IDLE header every `idle_wait_s`, so other ranks' waits stay bounded and a per-step broadcast
(e.g. a weights status) always has a carrier. Run as
`python -m weightbus.engines.reference.engine.worker CONFIG_JSON`.
"""

import contextlib
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import zmq

from weightbus.core.digest import fingerprint_of_digests
from weightbus.core.log import setup_logging
from weightbus.core.meta import DRAFT_PREFIX, dtype_from_name
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.actions import Action, StepAction, mask_to_tags
from weightbus.engines.reference.engine.expert_placement import experts_info
from weightbus.engines.reference.engine.forward_threads import ForwardThreads
from weightbus.engines.reference.engine.model_runner import DraftSource, ModelInput, ModelRunner
from weightbus.engines.reference.engine.prefix_cache import PrefixCache
from weightbus.engines.reference.engine.sampler import SampleResult, sample
from weightbus.engines.reference.engine.scheduler import Scheduler
from weightbus.engines.reference.engine.sequence import SamplingParams, Sequence
from weightbus.engines.reference.engine.speculative import (
    SpecPlan,
    SpeculativeDecoder,
    emit,
    plan_step,
)
from weightbus.engines.reference.engine.transport_setup import SetupChange, SetupOrder
from weightbus.engines.reference.engine.update_control import UpdateController
from weightbus.engines.reference.engine.verdicts import (
    all_flags,
    gather_slice_maps,
    gather_verdicts,
    poll_verdicts,
)
from weightbus.engines.reference.engine.weights_manager import WeightsManager
from weightbus.engines.reference.layers.attention import AttentionMetadata
from weightbus.engines.reference.layers.parallel import destroy_tp_group, init_tp_group
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.experts import ExpertMap
from weightbus.engines.reference.models.loader import (
    expert_layout,
    lora_shape,
    resolve_config,
    weights_records,
)
from weightbus.engines.reference.process_exit import exit_now

logger = logging.getLogger(__name__)

# Header of every step, broadcast from rank 0:
# [command, num_seqs, num_tokens, weights action, action payload bytes, memory tags,
#  speculative plan values (0: a plain step), all logits, prefix-cache KV copies].
# The weights action rides in the header rank 0 broadcasts anyway, so while the weights status
# is NORMAL an engine pays nothing for live updates; collectives of an update (flags, verdicts)
# run only while one is in flight.
CMD, NUM_SEQS, NUM_TOKENS, ACTION, PAYLOAD_BYTES, TAGS, SPEC_VALUES, ALL_LOGITS = range(8)
NUM_COPIES = 8  # prefix caching: (dst, src, n) KV copies after the batch
HEADER_SIZE = 9
# weights actions after which the step's forward runs on other weights: no prefix-cache lookup
SWAPS = (Action.COMMIT, Action.ROLLBACK, Action.LOAD)
IDLE, RUN, STOP = 0, 1, 2
# While an update is in flight and nothing else runs, rank 0 steps this often to poll it; while
# its own staged receive runs, it waits for that receive's end instead (each poll step is a
# collective on every rank: at 2 ms, a 1 GiB push paid ~0.08 CPU-s of the cores it copies on).
UPDATE_POLL_S = 0.002


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker process needs; passed as JSON on its command line."""

    tp_rank: int
    tp_size: int
    model: str
    dtype: str
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    seed: int
    store_host: str
    store_port: int
    ipc_dir: str
    dist_timeout_s: float
    idle_wait_s: float
    parent_pid: int
    weight_version: str = "init"
    shm_weights: bool = True
    wait_for_initial_weights: bool = False
    draft_model: str | None = None
    draft_seed: int = 0
    num_speculative_tokens: int = 0
    quantization: str | None = None
    lora_rank: int = 0  # LoRA adapters served (`--lora-rank`; 0: none)
    lora_targets: tuple[str, ...] = ()
    lora_dtype: str = "float32"
    # how a mixture-of-experts model holds its experts (`--expert-parallel`, ...)
    expert_parallel: bool = False
    expert_placement: str = "linear"
    redundant_experts: int = 0
    # reuse the KV of cached prompt prefixes (`--enable-prefix-caching`; off with a draft model)
    enable_prefix_caching: bool = True


def ipc_addresses(ipc_dir: str) -> tuple[str, str]:
    """ZMQ addresses (requests to rank 0, outputs from rank 0) inside a private directory."""
    return f"ipc://{Path(ipc_dir) / 'requests'}", f"ipc://{Path(ipc_dir) / 'outputs'}"


class Worker:
    """One rank: its model shard, and for rank 0 the scheduler and the API-server link."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.is_driver = config.tp_rank == 0
        self.tp_size = config.tp_size
        self._join_tp_group()
        lora = lora_shape(config.lora_rank, config.lora_targets, config.lora_dtype)
        experts = expert_layout(
            config.expert_parallel, config.expert_placement, config.redundant_experts
        )
        model_config = resolve_config(config.model, config.quantization, lora, experts)
        self.draft_source = self._draft_source()
        # a staged receive's end wakes rank 0's wait for requests (`_wake_up`)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._load_model(model_config)
        self._init_step_state()
        if self.is_driver:
            self._init_driver(model_config)
        # every rank has loaded its shard before rank 0 reports ready
        dist.barrier()
        if self.is_driver:
            self._report_ready(model_config)

    def _join_tp_group(self) -> None:
        init_tp_group(
            tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
            store_host=self.config.store_host,
            store_port=self.config.store_port,
            timeout_s=self.config.dist_timeout_s,
        )

    def _load_model(self, model_config: ModelConfig) -> None:
        config = self.config
        self.runner = ModelRunner(
            config=model_config,
            source=config.model,
            dtype=dtype_from_name(config.dtype),
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            seed=config.seed,
            draft=self.draft_source,
        )
        self.weights = WeightsManager(
            self.runner,
            dtype_from_name(config.dtype),
            config.tp_rank,
            config.tp_size,
            shm_weights=config.shm_weights,
            on_staged_done=self._wake_up,
        )
        # every rank's slice map (`GET /v1/weights/layout`; again after an expert re-placement)
        self.rank_slices = gather_slice_maps(self.weights.slices)
        self.forward_threads = ForwardThreads(torch.get_num_threads())

    def _live_experts(self) -> messages.ExpertsInfo | None:
        """The live expert map, as rank 0 reports it (None: a dense model)."""
        expert_map = self.runner.served.main.expert_map
        return None if expert_map is None else experts_info(expert_map)

    def _draft_source(self) -> DraftSource | None:
        config = self.config
        if config.draft_model is None:
            return None
        return DraftSource(
            resolve_config(config.draft_model), config.draft_model, config.draft_seed
        )

    def _init_step_state(self) -> None:
        self.header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        self.batch: list[Sequence] = []
        self.stopping = False
        self.step_action = StepAction()
        self.update_request: messages.UpdateWeights | None = None
        self.setup_change: SetupChange | None = None
        self.spec_plan: SpecPlan | None = None
        self.spec_payload: torch.Tensor | None = None  # rank 0: the packed plan
        self.kv_copies: list[tuple[int, int, int]] = []  # the step's (dst, src, n) KV copies
        self.speculator: SpeculativeDecoder | None = None
        if self.config.num_speculative_tokens > 0 and self.runner.draft is not None:
            self.speculator = SpeculativeDecoder(
                self.runner, is_driver=self.is_driver, tp_size=self.tp_size
            )

    def _init_driver(self, model_config: ModelConfig) -> None:
        # rank 0 only: the scheduler, the API-server link and the weights status
        config = self.config
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            vocab_size=model_config.vocab_size,
            eos_token_ids=model_config.eos_token_ids,
            prefix_cache=self._prefix_cache(),
        )
        self._connect()
        fingerprint, draft_fingerprint = self._initial_fingerprints(model_config)
        self.control = UpdateController(
            version=config.weight_version,
            fingerprint=fingerprint,
            send=self._send,
            abort=self._abort_sequences,
            wait_for_initial_weights=config.wait_for_initial_weights,
            draft_fingerprint=draft_fingerprint,
            lora=model_config.lora,
            experts=self._live_experts(),
            on_new_weights=self._on_new_weights,
        )

    def _prefix_cache(self) -> PrefixCache | None:
        # a draft model's KV shares the slots: copying it too is not done, so no cache then
        if not self.config.enable_prefix_caching or self.draft_source is not None:
            return None
        return PrefixCache()

    def _on_new_weights(self, *, keep_prefix_cache: bool, recompute_running: bool) -> None:
        """Rank 0, as other weights serve: drop the prefix cache of the old ones (unless the
        order keeps it); with `recompute_running`, running sequences compute their KV again."""
        if not keep_prefix_cache:
            self.scheduler.drop_cached(new_epoch=True)
        if recompute_running:
            self.scheduler.recompute_running()

    def _initial_fingerprints(self, model_config: ModelConfig) -> tuple[str, str | None]:
        """The fingerprint of the weights loaded at start-up (both models), and the draft's
        as a model of its own (None: no draft); each checkpoint is read once."""
        config, draft = self.config, self.draft_source
        dtype = dtype_from_name(config.dtype)
        records = weights_records(config.model, model_config, config.seed, dtype)
        if draft is None:
            return fingerprint_of_digests(records), None
        draft_records = weights_records(draft.source, draft.config, draft.seed, dtype)
        prefixed = [(DRAFT_PREFIX + name, *rest) for name, *rest in draft_records]
        return fingerprint_of_digests(records + prefixed), fingerprint_of_digests(draft_records)

    def _report_ready(self, model_config: ModelConfig) -> None:
        self._send(
            messages.Ready(
                protocol_version=messages.PROTOCOL_VERSION,
                tp_size=self.config.tp_size,
                vocab_size=model_config.vocab_size,
                max_model_len=self.config.max_model_len,
                eos_token_ids=list(model_config.eos_token_ids),
                weight_version=self.config.weight_version,
                rank_slices=self.rank_slices,
                experts=self.control.experts,
            )
        )
        self.control.publish_state()

    def _connect(self) -> None:
        requests_addr, outputs_addr = ipc_addresses(self.config.ipc_dir)
        self.zmq_context = zmq.Context()
        self.requests = self.zmq_context.socket(zmq.PULL)
        self.requests.connect(requests_addr)
        self.wakeups = zmq.Poller()
        self.wakeups.register(self.requests, zmq.POLLIN)
        self.wakeups.register(self._wake_read, zmq.POLLIN)
        self.outputs = self.zmq_context.socket(zmq.PUSH)
        # a stalled API server must not hang the engine forever
        self.outputs.setsockopt(zmq.SNDTIMEO, int(self.config.dist_timeout_s * 1000))
        self.outputs.connect(outputs_addr)

    def close(self) -> None:
        """Leave the TP group and close sockets."""
        if self.is_driver:
            self.requests.close(linger=0)
            self.outputs.close(linger=1000)
            self.zmq_context.term()
        self.weights.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        destroy_tp_group()

    def run(self) -> None:
        """Run steps until rank 0 broadcasts STOP."""
        while self.step():
            pass
        logger.info("worker stopped")

    def step(self) -> bool:
        """One iteration of the event loop; False once the engine stops."""
        if self.is_driver:
            self._recv_requests()
            self._plan_weights_action()
            self._schedule()
        command, model_input = self._broadcast_batch()
        if command == STOP:
            return False
        self._apply_weights_action()
        if model_input is None:
            return True
        if self.kv_copies:
            self.runner.copy_kv(self.kv_copies)
        self.forward_threads.fit(receiving=self.weights.receiving_staged)
        if self.spec_plan is not None:
            self._speculative_step(model_input, self.spec_plan)
            return True
        # a prefill asking for prompt logprobs: every rank computes every token's logits
        all_logits = bool(self.header[ALL_LOGITS])
        logits = self.runner.forward(model_input, all_logits=all_logits)
        if self.is_driver:
            if all_logits:
                logits = self._keep_prompt_logprobs(logits, model_input)
            result = self._sample(logits)
            self._send_outputs(result)
        return True

    def _keep_prompt_logprobs(self, logits: torch.Tensor, model_input: ModelInput) -> torch.Tensor:
        """Rank 0, after a forward with every token's logits: record the prompt logprobs of
        the sequences that asked; return each sequence's last row (what it samples from)."""
        counts = model_input.meta.num_new_tokens
        ends = torch.tensor(counts).cumsum(0)
        for seq, end, count in zip(self.batch, ends.tolist(), counts, strict=True):
            if seq.params.prompt_logprobs and seq.prompt_logprobs is None:
                rows = logits[end - count : end - 1].log_softmax(-1)
                targets = torch.tensor(seq.token_ids[1:count])
                scores = rows.gather(1, targets[:, None])[:, 0].tolist()
                seq.prompt_logprobs = [None, *scores]
        return logits[ends - 1]

    # --- steps ---

    def _recv_requests(self) -> None:
        # wait only when there is nothing to compute; otherwise just drain what arrived
        busy = self.scheduler.has_work() and self.control.may_run()
        # an update's swap is due (every rank staged it): no wait before the step that swaps
        busy = busy or self.control.acts_next_step(len(self.scheduler.running))
        polling = self.control.updating or self.control.setting_up
        own_receive_runs = polling and self.weights.receiving_staged  # its end wakes us
        idle_wait_s = UPDATE_POLL_S if polling and not own_receive_runs else self.config.idle_wait_s
        timeout_ms = 0 if busy else int(idle_wait_s * 1000)
        if not self._wait_for_requests(timeout_ms):
            if not busy and os.getppid() != self.config.parent_pid:
                logger.error("launcher is gone; stopping")
                self.stopping = True
            return
        while True:
            try:
                data = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(data)

    def _wait_for_requests(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for a request or a wake-up; whether a request is waiting."""
        ready = dict(self.wakeups.poll(timeout_ms))
        if self._wake_read in ready:
            os.read(self._wake_read, 4096)
        return self.requests in ready

    def _wake_up(self) -> None:
        """End `_wait_for_requests` now (a staged receive ended: poll it at once)."""
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the wait already
            os.write(self._wake_write, b"\0")

    def _handle(self, data: bytes) -> None:
        try:
            message = messages.decode_to_engine(data)
        except msgspec.DecodeError:
            logger.exception("dropping a malformed message")
            return
        if isinstance(message, messages.Shutdown):
            self.stopping = True
        elif isinstance(message, messages.UpdateWeights):
            self.control.on_update(message)
        elif isinstance(message, messages.Control):
            self.control.on_control(message)
        elif isinstance(message, messages.TransportSetup):
            self.control.on_transport_setup(message, self.tp_size)
        elif isinstance(message, messages.Decide):
            self.control.on_decide(message)
        elif isinstance(message, messages.Rollback):
            self.control.on_rollback(message)
        elif isinstance(message, messages.AskOutcome):
            self.control.on_ask_outcome(message)
        elif isinstance(message, messages.PlaceExperts):
            self.control.on_place_experts(message)
        elif isinstance(message, messages.AbortRequest):
            self.scheduler.abort(message.request_id)
        else:
            self._add(message)

    def _add(self, request: messages.AddRequest) -> None:
        blocked = self.control.blocked_reason()
        if blocked is not None:
            self._send(messages.Aborted(request_ids=[request.request_id], reason=blocked))
            return
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            num_logprobs=request.num_logprobs,
            ignore_eos=request.ignore_eos,
            prompt_logprobs=request.prompt_logprobs,
        )
        try:
            self.scheduler.add(Sequence(request.request_id, request.prompt_token_ids, params))
        except ValueError as exc:
            self._send(messages.RequestError(request_id=request.request_id, message=str(exc)))

    def _abort_sequences(self, reason: str, include_waiting: bool) -> None:
        aborted = self.scheduler.abort_all(include_waiting=include_waiting)
        if aborted:
            ids = [seq.request_id for seq in aborted]
            self._send(messages.Aborted(request_ids=ids, reason=reason))

    def _plan_weights_action(self) -> None:
        self.step_action = self.control.next_action(len(self.scheduler.running))

    def _schedule(self) -> None:
        if self.stopping:
            self.batch = []
            return
        self.batch = self.scheduler.schedule(
            run=self.control.may_run(),
            admit=self.control.may_admit(),
            use_cache=self.step_action.action not in SWAPS,
        )

    def _broadcast_batch(self) -> tuple[int, ModelInput | None]:
        payload = self._pack_batch() if self.is_driver else self.header
        if self.tp_size > 1:
            dist.broadcast(self.header, src=0)
        self._broadcast_action()
        command = int(self.header[CMD])
        if command != RUN:
            return command, None
        num_seqs, num_tokens = int(self.header[NUM_SEQS]), int(self.header[NUM_TOKENS])
        num_copies = int(self.header[NUM_COPIES])
        if not self.is_driver:
            payload = torch.empty(3 * num_seqs + num_tokens + 3 * num_copies, dtype=torch.int64)
        if self.tp_size > 1:
            dist.broadcast(payload, src=0)
        self.spec_plan = self._broadcast_spec_plan(num_seqs)
        self.kv_copies = []
        if num_copies:
            copies = payload[len(payload) - 3 * num_copies :]
            self.kv_copies = [tuple(c) for c in copies.view(num_copies, 3).tolist()]
            payload = payload[: len(payload) - 3 * num_copies]
        return command, _unpack_batch(payload, num_seqs)

    def _broadcast_spec_plan(self, num_seqs: int) -> SpecPlan | None:
        """Every rank learns this step's speculative plan (None: a plain step)."""
        num_values = int(self.header[SPEC_VALUES])
        if num_values == 0:
            return None
        if self.is_driver:
            payload = self.spec_payload
        else:
            payload = torch.empty(num_values, dtype=torch.int64)
        if self.tp_size > 1:
            dist.broadcast(payload, src=0)
        return SpecPlan.unpack(payload, num_seqs)

    def _broadcast_action(self) -> None:
        """Every rank learns this step's weights action (and its payload, if any)."""
        if not self.is_driver:
            num_bytes = int(self.header[PAYLOAD_BYTES])
            payload = torch.empty(num_bytes, dtype=torch.uint8)
            if num_bytes:
                dist.broadcast(payload, src=0)
            self.step_action = StepAction(
                Action(int(self.header[ACTION])), bytes(payload.numpy()), int(self.header[TAGS])
            )
        elif self.step_action.payload and self.tp_size > 1:
            data = torch.frombuffer(bytearray(self.step_action.payload), dtype=torch.uint8)
            dist.broadcast(data, src=0)

    def _pack_batch(self) -> torch.Tensor:
        self.header.zero_()
        self.header[ACTION] = self.step_action.action
        self.header[PAYLOAD_BYTES] = len(self.step_action.payload)
        self.header[TAGS] = self.step_action.tags_mask
        if self.stopping:
            self.header[CMD] = STOP
            return self.header
        if not self.batch:
            self.header[CMD] = IDLE
            return self.header
        new_tokens = [seq.new_token_ids for seq in self.batch]
        layout = [
            [seq.slot for seq in self.batch],
            [seq.num_cached_tokens for seq in self.batch],
            [len(tokens) for tokens in new_tokens],
        ]
        flat_tokens = [t for tokens in new_tokens for t in tokens]
        self.header[CMD] = RUN
        self.header[NUM_SEQS] = len(self.batch)
        self.header[NUM_TOKENS] = len(flat_tokens)
        self.header[ALL_LOGITS] = any(
            seq.params.prompt_logprobs and seq.num_cached_tokens == 0 for seq in self.batch
        )
        self._pack_spec_plan()
        copies = [value for copy in self.scheduler.kv_copies for value in copy]
        self.header[NUM_COPIES] = len(self.scheduler.kv_copies)
        return torch.tensor([*layout[0], *layout[1], *layout[2], *flat_tokens, *copies])

    def _pack_spec_plan(self) -> None:
        # rank 0: speculate when every sequence decodes (steps with a prefill run plainly)
        plan = None
        if self.speculator is not None:
            plan = plan_step(self.batch, self.config.num_speculative_tokens, self.scheduler)
        self.spec_payload = None if plan is None else plan.pack()
        self.header[SPEC_VALUES] = 0 if plan is None else len(self.spec_payload)

    def _apply_weights_action(self) -> None:
        """Run this step's weights action on every rank (nothing while the status is NORMAL)."""
        action = self.step_action
        if action.action == Action.NONE:
            return
        if action.action == Action.TRANSPORT_SETUP:
            self._start_setup_change(action.payload)
            return
        if action.action == Action.SETUP_POLL:
            self._poll_setup_change()
            return
        if action.action == Action.PLACE_EXPERTS:
            self._place_experts(action.payload)
            return
        if action.payload:
            request = messages.decode_to_engine(action.payload)
            assert isinstance(request, messages.UpdateWeights)
            self.update_request = request
        handlers = {
            Action.BEGIN_STAGED: lambda: self.weights.begin_staged(self.update_request),
            Action.POLL: self._poll_staged,
            Action.COMMIT: self._commit_staged,
            Action.ROLLBACK: self._roll_back,
            Action.ABORT: self.weights.discard_staged,
            Action.LOAD: self._load_in_place,
            Action.RELEASE: lambda: self._release(action.tags_mask),
            Action.RESUME: lambda: self._resume(action.tags_mask),
        }
        handlers[action.action]()

    def _start_setup_change(self, payload: bytes) -> None:
        message = messages.decode_to_engine(payload)
        assert isinstance(message, messages.TransportSetup)
        order = SetupOrder.decode(message)  # rank 0 decoded it before sending the action
        self.setup_change = SetupChange(
            order, self.config.tp_rank, self.tp_size, self.weights.slices
        )

    def _poll_setup_change(self) -> None:
        change = self.setup_change
        assert change is not None, "SETUP_POLL without a transport set-up"
        outcome = change.outcome()
        (all_done,) = all_flags(outcome is not None)
        if not all_done:
            return
        verdicts = gather_verdicts(change.order.message.request_id, change.outcome())
        self.setup_change = None
        if self.is_driver:
            self.control.on_transport_setup_done(change.order, verdicts)

    def _place_experts(self, payload: bytes) -> None:
        """Move the experts to the requested map (every rank, now), refresh this rank's slice
        map and gather every rank's; rank 0 answers."""
        message = messages.decode_to_engine(payload)
        assert isinstance(message, messages.PlaceExperts)
        live = self.runner.served.main.expert_map
        assert live is not None, "rank 0 accepted a re-placement on a dense model"
        expert_map = ExpertMap(live.num_experts, tuple(map(tuple, message.expert_map)))
        result = self.weights.place_experts(expert_map)
        verdicts = gather_verdicts(message.request_id, result)
        self.rank_slices = gather_slice_maps(self.weights.slices)
        if self.is_driver:
            experts = self._live_experts()
            assert experts is not None
            self.control.on_experts_placed(message, verdicts, self.rank_slices, experts)

    def _commit_staged(self) -> None:
        self.weights.commit_staged()
        if self.is_driver:
            self.control.on_committed()

    def _roll_back(self) -> None:
        self.weights.roll_back()
        if self.is_driver:
            self.control.on_committed()

    def _load_in_place(self) -> None:
        result = self.weights.load_in_place(self.update_request)
        verdicts = gather_verdicts(self.update_request.update_id, result)
        if self.is_driver:
            draft = self.weights.draft_info(self.update_request, result)
            self.control.on_loaded(verdicts, result.nbytes, result.phases, draft)

    def _release(self, tags_mask: int) -> None:
        self.weights.release(mask_to_tags(tags_mask))
        if self.is_driver:
            self.scheduler.drop_cached(new_epoch=True)  # its KV or its weights are gone
            self.control.on_released(tags_mask)

    def _resume(self, tags_mask: int) -> None:
        self.weights.resume(mask_to_tags(tags_mask))
        if self.is_driver:
            self.control.on_resumed(tags_mask)

    def _poll_staged(self) -> None:
        result = self.weights.staged_result()
        verdicts = poll_verdicts(self.update_request.update_id, result)
        if verdicts is None:  # a rank's receive still runs
            return
        if not all(v.ok for v in verdicts):
            self.weights.discard_staged()
        if self.is_driver:
            draft = self.weights.draft_info(self.update_request, result)
            self.control.on_staged(verdicts, result.nbytes, result.phases, draft)

    def _speculative_step(self, model_input: ModelInput, plan: SpecPlan) -> None:
        """Draft passes, one verifying pass (all ranks), then acceptance and outputs (rank 0)."""
        assert self.speculator is not None, "rank 0 planned a speculative step without a draft"
        batch = self.batch if self.is_driver else None
        proposals = self.speculator.propose(model_input, plan, batch)
        logits = self.speculator.verify(model_input, plan, proposals)
        if not self.is_driver:
            return
        outcome = self.speculator.accept(logits, model_input, proposals, self.batch)
        result, num_tokens = emit(outcome, plan, self.batch, self.scheduler)
        self._send_outputs(
            result,
            num_tokens,
            num_draft_tokens=sum(plan.num_proposals),
            num_accepted_tokens=sum(outcome.num_accepted),
        )

    def _sample(self, logits: torch.Tensor) -> SampleResult:
        result = sample(
            logits,
            [seq.params for seq in self.batch],
            [seq.generator for seq in self.batch],
        )
        self.scheduler.postprocess(self.batch, result.token_ids)
        return result

    def _send_outputs(
        self,
        result: SampleResult,
        num_tokens: list[int] | None = None,
        *,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
    ) -> None:
        """Send the step's tokens: `num_tokens[i]` rows of `result` per sequence (default 1);
        a sequence's finish reason rides on its last token."""
        num_queries, num_hits = self._prefix_cache_counts()
        outputs = []
        row = 0
        for seq, count in zip(self.batch, num_tokens or [1] * len(self.batch), strict=True):
            for index in range(count):
                outputs.append(_token_output(seq, result, row, last=index == count - 1))
                row += 1
        self._send(
            messages.StepOutputs(
                weight_version=self.control.version,
                outputs=outputs,
                num_draft_tokens=num_draft_tokens,
                num_accepted_tokens=num_accepted_tokens,
                num_prefix_queries=num_queries,
                num_prefix_hits=num_hits,
            )
        )

    def _prefix_cache_counts(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache and found there since the last step."""
        cache = self.scheduler.prefix_cache
        return (0, 0) if cache is None else cache.unreported()

    def _send(self, message: messages.FromEngine) -> None:
        self.outputs.send(messages.encode(message))


def _token_output(
    seq: Sequence, result: SampleResult, row: int, *, last: bool
) -> messages.TokenOutput:
    recomputed, seq.kv_recomputed = seq.kv_recomputed, False  # said once, with this token
    return messages.TokenOutput(
        request_id=seq.request_id,
        token_id=result.token_ids[row],
        logprob=result.logprobs[row],
        top_token_ids=result.top_token_ids[row],
        top_logprobs=result.top_logprobs[row],
        finish_reason=seq.finish_reason if last else None,
        prompt_logprobs=seq.prompt_logprobs if seq.num_completion_tokens == 1 else None,
        kv_recomputed=recomputed,
    )


def _unpack_batch(payload: torch.Tensor, num_seqs: int) -> ModelInput:
    layout = payload[: 3 * num_seqs].view(3, num_seqs).tolist()
    meta = AttentionMetadata(slots=layout[0], start_positions=layout[1], num_new_tokens=layout[2])
    return ModelInput(token_ids=payload[3 * num_seqs :], meta=meta)


def _die_with_parent() -> None:
    # Linux: the kernel kills this worker if the launcher dies, even by SIGKILL.
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """Worker process entry point:
    `python -m weightbus.engines.reference.engine.worker CONFIG_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    config = msgspec.json.decode(argv[0], type=WorkerConfig)
    setup_logging(rank=config.tp_rank)
    _die_with_parent()
    if os.getppid() != config.parent_pid:
        logger.error("launcher exited before this worker started")
        return 1
    # the launcher coordinates shutdown; a terminal's Ctrl-C must not break a collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
    try:
        run_worker(config)
    except Exception:
        logger.exception("worker failed")
        return 1
    return 0


def run_worker(config: WorkerConfig) -> None:
    """Build the rank, run its steps until rank 0 broadcasts STOP, then close it (also when
    it failed: the exception propagates after)."""
    worker = None
    try:
        worker = Worker(config)
        worker.run()
    finally:
        if worker is not None:
            worker.close()


if __name__ == "__main__":
    exit_now(main())
