"""The PyTorch adapter: DDP, FSDP2, HSDP, FSDP1 and DeviceMesh-based TP/PP/EP.

Topology: a DDP model's process group is one replica group. For DTensor parameters (FSDP2, HSDP, TP)
the mesh dimensions on which every parameter is `Replicate()` are replica dimensions; ranks that differ
only along them hold identical shards, and every rank of the mesh is a peer (same layers, same
collectives: step times, stalls and hangs are compared across it).
`parallelism_info={"replica_group": [...], "peer_group": [...], "dims": {...}}` overrides what we
read. A plain module with no DDP and no DTensor is its own replica group unless `group` names its
data-parallel peers; the module a DDP wraps, passed instead of the DDP, is treated as the DDP.

Hooks: a forward pre-hook marks the start of compute, an optimizer pre/post step hook marks the
optimizer phase and the step boundary, and for DDP a comm hook that averages gradients like DDP but
in a canonical layout (`adapters/canonical.py`), so the result does not depend on DDP's bucket layout
(which differs for one iteration after a restart) and a resumed run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from lm_resiliency.adapters import collectives
from lm_resiliency.adapters.amp import mark_ours
from lm_resiliency.adapters.base import (
    AdapterTopology,
    StepSink,
    StepTimes,
    live_instances,
    parameters_of,
    uncompiled,
)
from lm_resiliency.adapters.canonical import CanonicalReduction, ddp_parameters
from lm_resiliency.runtime.trail import CollectiveTrail

__all__ = ["PyTorchAdapter"]

log = logging.getLogger(__name__)
RECENT_CHAINS = 4  # collective states before the current one that progress gossip carries
DP_HINT_STEPS = 3  # steps of a plain module in which its script's all-reduces are looked at


class PyTorchAdapter:
    name = "pytorch"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        group: Any = None,
        parallelism_info: Mapping[str, Any] | None = None,
        time_comm: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self._ddp = _find_ddp(uncompiled(model))
        if self._ddp is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._ddp = _wrapping_ddp(model)
            if self._ddp is not None:
                log.info("the model passed is wrapped by DistributedDataParallel: its replicas are used")
        # DDPs inside the model passed (an nn.ModuleDict of a GAN's generator and discriminator,
        # each wrapped): each reduces through our comm hook, for a resumed run to be bitwise.
        self._inner_ddps = [] if self._ddp is not None else _inner_ddps(uncompiled(model))
        self.parallelism_info = dict(parallelism_info or {})
        self._time_comm = time_comm
        self._handles: list[Any] = []
        self._untrack: list[Callable[[], Any]] = []  # undoes what attach() wrapped
        self._on_step: StepSink | None = None
        self._attached = False
        self.thread: int | None = None
        # Per-step timing state (training thread; the comm hook's callbacks write comm_end from
        # the communication thread, a float store that needs no lock).
        self._step = 0
        self._t_step_start = time.perf_counter()
        self._t_fwd: float | None = None
        self._t_opt: float | None = None
        self._comm_start: float | None = None
        self._comm_last_call: float | None = None
        self._comm_end: float | None = None
        self._input_s = 0.0
        # Before the forward but not input: our own work (note_own_time), waiting in the script's
        # collectives (waited_between_steps), marked checkpoint I/O and evaluations (note_excused_time).
        self._not_input_s = 0.0
        self._eval_started: float | None = None  # an evaluation between steps began (perf_counter)
        self._stepping = False  # between a training forward and the optimizer step (see `in_step`)
        self._steps_seen = 0  # optimizer steps since attach (a resumed step count is not one)
        self._blocking = 0  # blocking tracked collectives this thread is in (nested: one interval)
        self._blocked_since = 0.0
        self._blocked: list[tuple[float, float]] = []  # this step's (start, end) in blocking collectives
        # Progress for out-of-band hang detection (read by the runtime thread; plain attribute writes).
        # (collectives entered, hash chain over them): one tuple, replaced whole, so the runtime thread
        # never reads a count from one collective with the chain of another.
        self.collective_state: tuple[int, bytes] = (0, b"")
        # The states before it, newest last (bounded): peers sampled a collective or two apart
        # still compare chains at a count both passed (see desync_verdict).
        self.collective_recent: tuple[tuple[int, bytes], ...] = ()
        # Where each new state is also written under the torchrun backend (runtime/trail.py).
        self.trail: CollectiveTrail | None = None
        self.outstanding = 0
        self.in_collective_since: float | None = None
        self.last_progress = time.monotonic()
        # (phase, since) while the training thread is in its data loader ("input") or in checkpoint I/O
        # ("checkpoint_io"), set by the session; None otherwise.
        self.phase: tuple[str, float] | None = None
        # Called from the comm hook with (parameters, gradients) of each bucket before its all-reduce.
        self.contribution_tap: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] | None = None
        # A plain module's gradients all-reduced by the script itself (`group=` given): told each
        # tensor and group just before the reduction (see all_reduced).
        self.reduction_tap: Callable[[torch.Tensor, Any], None] | None = None
        self._grad_owners: dict[int, torch.Tensor] = {}
        self.reduces_itself = False
        # Each DDP's canonical reduction (by id), once our comm hook is registered on it.
        self._reductions: dict[int, CanonicalReduction] = {}
        # The DDPs whose comm hook is ours to register at the first forward; those where ours is.
        self._comm_hook_pending: list[Any] = []
        self._comm_hook_ours: set[int] = set()
        # A plain module's script's all-reduces inside the step, by group (id -> (group, elements)),
        # in its first steps (None: not looked at; see _data_parallel_hint).
        self._reduced_in_step: dict[int, tuple[Any, int]] | None = None
        self._hint_steps = 0

    def uneven_inputs(self) -> bool:
        """Whether the step runs inside DDP's `Join` context (uneven inputs): ranks that run out of
        batches shadow the others' all-reduces, so ranks take different numbers of optimizer steps
        and their states stop being replicas (torch's optimizers step only where data was)."""
        for ddp in [self._ddp] if self._ddp is not None else self._inner_ddps:
            config = getattr(ddp, "_join_config", None)
            if config is not None and getattr(config, "enable", False):
                return True
        return False

    # -- topology ---------------------------------------------------------------------------------
    def topology(self) -> AdapterTopology:
        rank = dist.get_rank() if dist.is_initialized() else 0
        info = self.parallelism_info
        if "replica_group" in info:
            group = _ranks(info["replica_group"], "parallelism_info['replica_group']")
            if rank not in group:
                raise ValueError(f"parallelism_info['replica_group'] {group} does not contain rank {rank}")
            dims = {
                str(k): _ranks(v, f"parallelism_info['dims'][{k!r}]") for k, v in info.get("dims", {}).items()
            }
            peers = group
            if "peer_group" in info:
                peers = _ranks(info["peer_group"], "parallelism_info['peer_group']")
                if not set(group) <= set(peers):
                    raise ValueError(
                        f"parallelism_info['peer_group'] {peers} must contain the replica group {group}"
                    )
            replicated = tuple(info.get("replicated_dims", ()))
            return AdapterTopology(group, dims, replicated, "parallelism_info", peers)
        inner = self._inner_ddps[:1]
        if inner and (loose := _loose_parameters(uncompiled(self.model), self._inner_ddps)):
            log.info(
                "the model holds DDP modules and trainable parameters outside them (%s): its ranks "
                "are not compared as replicas",
                ", ".join(loose[:3]) + (", ..." if len(loose) > 3 else ""),
            )
            inner = []
        for ddp in [self._ddp] if self._ddp is not None else inner:
            if not dist.is_initialized():
                break
            # (Inner DDPs over other groups than the first's: each replica group is a subset of
            # the first's ranks only by chance; the first's is taken, and the others named.)
            ranks = _ddp_ranks(ddp)
            others = {_ddp_ranks(d) for d in self._inner_ddps[1:]} - {ranks}
            if others:
                log.warning(
                    "DDP modules over other ranks than %s: %s; SCOUT compares %s", ranks, others, ranks
                )
            return AdapterTopology(ranks, {"dp": ranks}, ("dp",), "ddp")
        module = uncompiled(self.model)
        mesh_topo = _mesh_topology(module, rank) or _fsdp1_topology(module, rank)
        if mesh_topo is not None:
            return mesh_topo
        if self.group is not None and dist.is_initialized():
            ranks = tuple(sorted(dist.get_process_group_ranks(self.group)))
            self.reduces_itself = True  # (no DDP, FSDP or mesh: the script reduces the gradients)
            return AdapterTopology(ranks, {"dp": ranks}, ("dp",), "group")
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A plain module in a multi-rank job: no replicas unless the script's own collectives
            # show data parallelism (see _data_parallel_hint): then the log says what to pass.
            self._reduced_in_step = {}
        return AdapterTopology((rank,), {}, (), "single")

    # -- hooks ------------------------------------------------------------------------------------
    def attach(self, on_step: StepSink) -> None:
        if self._attached:
            raise RuntimeError("PyTorchAdapter already attached")
        self._attached = True
        self._on_step = on_step
        # First of the forward pre-hooks: FSDP2's own (registered when the model was sharded) all-gathers
        # the parameters, and waiting in that for a slow peer is not this rank's input time.
        self._handles.append(self.model.register_forward_pre_hook(self._forward_pre, prepend=True))
        inner = getattr(self.model, "module", None)
        if isinstance(self.model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
            # An evaluation may call the module DDP wraps directly (`ddp.module(x)`).
            self._handles.append(
                inner.register_forward_pre_hook(
                    lambda m, a: None if torch.is_grad_enabled() else self._evaluating(m, a)
                )
            )
        # The training thread: a collective another thread of the script's issues is not the step's.
        self.thread = threading.get_ident()
        collectives.install(self)  # the step's own torch.distributed collectives, for hang/desync checks
        if self.optimizer is not None:
            # Ours: they also run on a step a loss scaler skipped (see amp.run_skipped_step).
            self._handles.append(mark_ours(self.optimizer.register_step_pre_hook(self._opt_pre)))
            self._handles.append(mark_ours(self.optimizer.register_step_post_hook(self._opt_post)))
        ddps = [self._ddp] if self._ddp is not None else []  # hooks above stay on the compiled wrapper: eager
        for inner_ddp in self._inner_ddps:
            # The container's own forward may never run (a ModuleDict has none): each DDP's opens the step.
            self._handles.append(inner_ddp.register_forward_pre_hook(self._forward_pre, prepend=True))
            ddps.append(inner_ddp)
        for ddp in ddps:
            self._track_buffer_broadcast(ddp)
            self._track_bucket_rebuild(ddp)
            if self._time_comm:
                self._defer_comm_hook(ddp)
        self._t_step_start = time.perf_counter()

    def _defer_comm_hook(self, ddp: Any) -> None:
        """Ours is registered at the model's first forward, not here: DDP takes one comm hook, and a
        script that registers its own after enable_resiliency (fp16 compression, PowerSGD) keeps
        it. One registered after that forward is refused with a message that says so."""
        original = ddp.register_comm_hook

        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            if id(ddp) in self._comm_hook_ours:
                raise RuntimeError(
                    "DDP takes one comm hook, and lm-resiliency registered its own at the model's "
                    "first forward: register yours before that forward (or before enable_resiliency); "
                    "communication time is then not measured"
                )
            if ddp in self._comm_hook_pending:
                self._comm_hook_pending.remove(ddp)
                log.info(
                    "the script registers a DDP comm hook of its own: communication time is not measured"
                )
            original(state, hook)

        ddp.register_comm_hook = register_comm_hook
        self._untrack.append(lambda: vars(ddp).pop("register_comm_hook", None))
        self._comm_hook_pending.append(ddp)

    def _register_comm_hook(self, ddp: Any) -> None:
        if getattr(ddp, "_comm_hooks", None):
            log.info("DDP model already has a comm hook; communication time will not be measured")
        else:
            pg = getattr(ddp, "process_group", None)

            def comm_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
                return self._comm_hook(state, bucket, self._reductions.get(id(ddp)))

            # DDP inspects the annotations at runtime; ours are strings under PEP 563.
            comm_hook.__annotations__ = {
                "bucket": dist.GradBucket,  # type: ignore[attr-defined]
                "return": torch.futures.Future[torch.Tensor],
            }
            try:  # past our instance's guard (see _defer_comm_hook)
                type(ddp).register_comm_hook(ddp, pg, comm_hook)
            except RuntimeError as exc:  # one registered through DDP's builtin-hook API
                if ddp._comm_hooks and ddp._comm_hooks[-1][0] is comm_hook:
                    ddp._comm_hooks.pop()
                log.info("DDP model already has a comm hook (%s): communication time is not measured", exc)
                return
            self._comm_hook_ours.add(id(ddp))
            # Complex gradients reach a comm hook as real views of the bucket whose lengths do
            # not match the parameters': their buckets are reduced whole, as DDP does.
            if not any(p.is_complex() for p in ddp_parameters(ddp)):
                self._reductions[id(ddp)] = CanonicalReduction.for_ddp(ddp)

    def _track_buffer_broadcast(self, ddp: Any) -> None:
        """DDP broadcasts its buffers from rank 0 at the start of a training forward
        (`broadcast_buffers=True` and buffers: BatchNorm's statistics, a rotary embedding's table):
        a collective of the step like its all-reduce, in which rank 0's peers wait for rank 0 (and
        rank 0 for them). Untracked, ranks stuck in it looked as if they had never entered the
        step's collective, and a hang named them with the rank that had stopped."""
        original = ddp._sync_buffers  # bound; the instance attribute shadows it
        group = getattr(ddp, "process_group", None)

        def tracked() -> Any:
            # (Its body runs under no_grad: whether this is a training forward is known out here.
            # An evaluation's first forward broadcasts too: between steps, not tracked.)
            if torch.compiler.is_compiling() or not torch.is_grad_enabled():
                return original()
            if not self._stepping:  # the model given was the module DDP wraps: the step begins here
                self._forward_pre(ddp, ())
            buffers = list(getattr(ddp, "modules_buffers", ()))
            size = sum(b.numel() for b in buffers if isinstance(b, torch.Tensor))
            self.enter_collective(f"broadcast_buffers:{len(buffers)}:{size}:{_world(group)}", True)
            try:
                return original()
            finally:
                self.exit_collective()

        ddp._sync_buffers = tracked
        self._untrack.append(lambda: vars(ddp).pop("_sync_buffers", None))

    def _track_bucket_rebuild(self, ddp: Any) -> None:
        """DDP rebuilds its gradient buckets once, in the first training forward after a backward
        reduced gradients (in the order they became ready), and rank 0 broadcasts the new layout
        to its peers there: a collective inside DDP's forward that no torch.distributed call
        shows. A new process (each generation of a restarted job) enters it in its second step.
        Untracked, peers blocked in it while a rank stopped after its first step looked idle (not
        in a collective), and no hang was named: they waited for the process group's timeout."""
        original = ddp._pre_forward  # bound; the instance attribute shadows it
        group = getattr(ddp, "process_group", None)

        def tracked(*inputs: Any, **kwargs: Any) -> Any:
            # DDP's own conditions for a rebuild that talks to its peers (Reducer::rebuild_buckets
            # is reached and should_rebuild_buckets holds), and a step since we attached: the
            # same on every replica, so their collective chains stay equal. Every training forward
            # passes here: once rebuilt, the first test ends it.
            if (
                getattr(ddp, "_has_rebuilt_buckets", True)
                or self._steps_seen == 0
                or not torch.is_grad_enabled()
                or torch.compiler.is_compiling()
                or getattr(ddp, "_use_python_reducer", False)
                or getattr(ddp, "_delay_all_reduce_all_params", False)
                or (getattr(ddp, "find_unused_parameters", False) and not getattr(ddp, "static_graph", False))
            ):
                return original(*inputs, **kwargs)
            if not self._stepping:  # the model given was the module DDP wraps: the step begins here
                self._forward_pre(ddp, ())
            self.enter_collective(f"rebuild_buckets:{_world(group)}", True)
            try:
                return original(*inputs, **kwargs)
            finally:
                self.exit_collective()

        ddp._pre_forward = tracked
        self._untrack.append(lambda: vars(ddp).pop("_pre_forward", None))

    def detach(self) -> None:
        for undo in self._untrack:
            undo()
        self._untrack.clear()
        collectives.uninstall(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._on_step = None  # a DDP comm hook cannot be removed: it keeps doing the plain all-reduce

    def note_input_time(self, seconds: float) -> None:
        self._input_s += seconds

    def note_own_time(self, seconds: float) -> None:
        self._not_input_s += seconds

    def waited_between_steps(self, seconds: float) -> None:
        self._not_input_s += seconds

    def note_excused_time(self, seconds: float) -> None:
        """Marked checkpoint I/O (`session.checkpoint_io`) between two steps: not input, so a rank
        that saves a checkpoint of its own is no input straggler. Inside a step, or inside an
        evaluation (whose whole time is excused already), nothing changes."""
        if self._before_forward() and self._eval_started is None:
            self._not_input_s += seconds

    def _before_forward(self) -> bool:
        """Between two steps: this step's training forward has not begun."""
        return not self._stepping and self._t_fwd is None

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        while self._comm_hook_pending:
            self._register_comm_hook(self._comm_hook_pending.pop(0))
        if torch.is_grad_enabled():  # a training forward opens the step (an evaluation's does not)
            if self._t_fwd is None:
                self._t_fwd = time.perf_counter()
                if self._eval_started is not None:
                    # An evaluation ran between the steps (rank 0's alone, maybe): not input, and
                    # not this step's compute either (its forward began the timing before).
                    self._not_input_s += self._t_fwd - self._eval_started
                    self._eval_started = None
            self._stepping = True
        else:
            self._evaluating(module, args)
        own = self._reductions.get(id(module))  # an inner DDP's forward: its reduction only
        for reduction in [own] if own is not None else self._reductions.values():
            reduction.reset()

    def _evaluating(self, module: nn.Module, args: Any) -> None:
        """The model runs with gradients off outside a step: an evaluation (rank 0 alone, maybe,
        while its peers wait in the next step's all-reduce). Marked until the end of the next step,
        so the hang check excuses it up to its threshold; the loop's own phases are left alone."""
        if self._before_forward() and self._eval_started is None:
            self._eval_started = time.perf_counter()
        if not self._stepping and self.phase is None:
            self.phase = ("evaluation", time.monotonic())

    # -- collectives the script issues inside a step (see `collectives`) ------------------------------
    def in_step(self) -> bool:
        return self._stepping

    def enter_collective(self, signature: str, waits: bool) -> None:
        self._chain(signature)
        if waits:
            self.wait_collective()

    def all_reduced(self, tensor: torch.Tensor, group: Any) -> None:
        """The script is about to all-reduce `tensor` over `group` inside the step. Counted while
        this plain module's replicas are unknown (see _data_parallel_hint); handed to
        `reduction_tap` where the script reduces its gradients itself (see `grad_owner`)."""
        if self._reduced_in_step is not None:
            key = id(group)
            held = self._reduced_in_step.get(key)
            self._reduced_in_step[key] = (group, tensor.numel() + (held[1] if held else 0))
        tap = self.reduction_tap
        if tap is not None:
            tap(tensor, group)

    def grad_owner(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The model parameter whose `.grad` `tensor` is (None: not one of them). The map from
        gradients to parameters is rebuilt when a gradient is not found in it: once a step where
        backward allocates fresh gradients (zero_grad(set_to_none=True)), never where it reuses them."""
        p = self._grad_owners.get(id(tensor))
        if p is None or p.grad is not tensor:
            self._grad_owners = {id(q.grad): q for q in parameters_of(self.model) if q.grad is not None}
            p = self._grad_owners.get(id(tensor))
        return p if p is not None and p.grad is tensor else None

    def _data_parallel_hint(self) -> None:
        """End of one of the first steps of a plain module (no DDP, no DTensor) given no `group`:
        SCOUT compares it with no other rank. When the script all-reduced, over one group of two or
        more ranks, at least as many elements as the model has trainable parameters, it reduces its
        gradients itself (data parallelism without DDP): say what to pass, once. Not inferred: ranks
        that only start alike (an ensemble, local SGD between its syncs) would be taken for corrupted
        replicas at their first step. Said by the group's first rank."""
        seen, self._reduced_in_step = self._reduced_in_step, {}
        self._hint_steps += 1
        if self._hint_steps >= DP_HINT_STEPS:
            self._reduced_in_step = None
        if not seen:
            return
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        for group, numel in seen.values():
            ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
            if len(ranks) > 1 and total and numel >= total:
                self._reduced_in_step = None
                if dist.get_rank() != ranks[0]:  # one line per group, not one per rank
                    return
                log.warning(
                    "rank %d: the model is a plain module (no DDP, FSDP or DTensor) and the script "
                    "all-reduces its gradients over ranks %s itself, but enable_resiliency was given no "
                    "group: SCOUT compares this rank's state with no other's, so a silent data corruption "
                    "goes unseen. Pass group=<that process group> (dist.group.WORLD for all ranks), or "
                    "parallelism_info={'replica_group': %s}, if these ranks hold the same weights",
                    dist.get_rank(),
                    list(ranks),
                    list(ranks),
                )
                return

    def _chain(self, signature: str) -> None:
        """One more collective entered: chain its signature (attributes replaced whole, read by the
        runtime thread)."""
        count, chain = state = self.collective_state
        self.collective_recent = (*self.collective_recent[-(RECENT_CHAINS - 1) :], state)
        self.collective_state = state = (count + 1, xxhash.xxh3_64_digest(chain + signature.encode()))
        if self.trail is not None:
            self.trail.record(*state)

    def wait_collective(self) -> None:
        self.outstanding += 1
        if self.in_collective_since is None:
            self.in_collective_since = time.monotonic()
        self._blocking += 1
        if self._blocking == 1:
            self._blocked_since = time.perf_counter()

    def exit_collective(self) -> None:
        self._blocking -= 1
        if self._blocking <= 0:
            self._blocking = 0
            # Time blocked in a collective inside forward/backward is waiting for peers (FSDP2's
            # all-gathers, a script's own all-reduce), not this rank's compute.
            self._blocked.append((self._blocked_since, time.perf_counter()))
        self.outstanding -= 1
        if self.outstanding <= 0:
            self.outstanding = 0
            self.in_collective_since = None
        self.last_progress = time.monotonic()

    def _comm_hook(
        self, pg: Any, bucket: Any, reduction: CanonicalReduction | None
    ) -> torch.futures.Future[torch.Tensor]:
        # Average the gradients as DDP does (multiply by 1/n, all-reduce SUM), but in canonical
        # groups rather than DDP's buckets: the sum's rounding then does not depend on which layout
        # DDP happens to use. A fresh DDP (a resumed run) uses its initial layout for one iteration
        # and a rebuilt one after; per-bucket reduction would make the resumed run differ from the
        # uninterrupted one in the last bits.
        now = time.perf_counter()
        if self._comm_start is None:
            self._comm_start = now
        self._comm_last_call = now
        self.outstanding += 1
        if self.in_collective_since is None:
            self.in_collective_since = time.monotonic()
        group = pg if pg is not None else dist.group.WORLD
        reduced: torch.futures.Future[torch.Tensor]
        buffer: torch.Tensor = bucket.buffer()
        world = dist.get_world_size(group)
        # What this collective is, chained onto all before it: peers that entered as many collectives
        # must hold the same chain, or one of them issued a different collective (desync).
        sparse = buffer.layout != torch.strided
        n_grads = len(bucket.gradients())
        shape = f"sparse{tuple(buffer.shape)}" if sparse else buffer.numel()
        self._chain(f"allreduce:{shape}:{buffer.dtype}:{n_grads}:{world}")
        buffer.mul_(1.0 / world)  # averaged as DDP does: scaled, then summed
        tap = self.contribution_tap
        if tap is not None and reduction is not None and not sparse:
            tap(bucket.parameters(), bucket.gradients())  # SCOUT's replay record: this rank's share

        def _done(f: Any) -> torch.Tensor:
            self.outstanding -= 1
            if self.outstanding <= 0:
                self.outstanding = 0
                self.in_collective_since = None
            self._comm_end = time.perf_counter()
            out: torch.Tensor = f.value()  # re-raises a failed all-reduce
            return out

        if sparse or reduction is None:
            # The bucket whole: complex gradients in place; an Embedding(sparse=True)'s gradient,
            # alone in its bucket, summed as DDP sums it (a sum of sparse tensors, which no bucket
            # layout changes) into a new tensor. SCOUT's replay compares the dense gradients only.
            work = collectives.original("all_reduce")(buffer, group=group, async_op=True)

            def _whole(f: Any) -> torch.Tensor:
                summed: torch.Tensor = f.value()[0]  # re-raises a failed all-reduce
                return summed if sparse else buffer

            reduced = work.get_future().then(_whole)
        else:
            reduced = reduction.reduce(bucket, group)
        done: torch.futures.Future[torch.Tensor] = reduced.then(_done)
        return done

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._t_opt = time.perf_counter()

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        self._step += 1
        self._steps_seen += 1
        t0 = self._t_step_start
        fwd = self._t_fwd if self._t_fwd is not None else t0
        opt_start = self._t_opt if self._t_opt is not None else now
        # Compute ends when this rank handed its last gradient to communication; what follows until
        # the optimizer is waiting for the collective (for the slowest peer, in synchronous training).
        comm = 0.0
        compute_end = opt_start
        if self._comm_last_call is not None and self._comm_end is not None:
            compute_end = self._comm_last_call
            comm = max(0.0, opt_start - self._comm_last_call)
        waited = sum(max(0.0, min(b, compute_end) - max(a, fwd)) for a, b in self._blocked)
        self._blocked.clear()
        # Input: everything before the forward (the loader's next(), and what the script does with
        # the batch before it: a transfer, a transform, a delay), less our own work and the waits in
        # collectives there; at least the loader's time when it was read elsewhere in the step.
        input_s = max(self._input_s, fwd - t0 - self._not_input_s)
        times = StepTimes(
            step=self._step,
            step_s=now - t0,
            input_s=input_s,
            compute_s=max(0.0, compute_end - fwd - waited),
            comm_s=comm + waited,
            optimizer_s=now - opt_start,
        )
        self.last_progress = time.monotonic()
        phase = self.phase
        if phase is not None and phase[0] == "evaluation":
            # Ends with the step after it: until this rank entered that step's collectives, its
            # peers' wait in them is still the evaluation's.
            self.phase = None
        self._stepping = False
        if self._reduced_in_step is not None:
            try:
                self._data_parallel_hint()
            except Exception:  # a hint must never fail the script's optimizer step
                self._reduced_in_step = None
                log.debug("looking for data parallelism in the script's all-reduces failed", exc_info=True)
        self._t_fwd = self._t_opt = self._comm_start = self._comm_end = self._comm_last_call = None
        self._input_s = self._not_input_s = 0.0
        self._eval_started = None
        try:
            if self._on_step is not None:
                self._on_step(times)
        finally:
            # The next step starts after our own work (telemetry, a capture's copy): that time is
            # ours, not the gap before the script's next forward (its input time).
            self._t_step_start = time.perf_counter()

    def set_step(self, step: int) -> None:
        """Start counting from `step` (after a recovery)."""
        self._step = step


def _world(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:  # not initialised (a test's lone module): the signature only names it
        return -1


def _ranks(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{where} must be a list of ranks, got {type(value).__name__}")
    out = []
    for v in value:
        if type(v) is not int:
            raise TypeError(f"{where} must hold ints, got {v!r}")
        out.append(v)
    return tuple(sorted(set(out)))


def _ddp_ranks(ddp: Any) -> tuple[int, ...]:
    pg = getattr(ddp, "process_group", None) or dist.group.WORLD
    return tuple(sorted(dist.get_process_group_ranks(pg)))


def _inner_ddps(model: nn.Module) -> list[Any]:
    """The DistributedDataParallel modules inside `model` (none nested: DDP cannot wrap one)."""
    from torch.nn.parallel import DistributedDataParallel

    return [m for m in model.modules() if isinstance(m, DistributedDataParallel) and m is not model]


def _loose_parameters(model: nn.Module, ddps: Sequence[Any]) -> list[str]:
    """Trainable parameters of `model` outside `ddps`: not averaged over the replicas (they may
    differ between ranks on purpose), so the ranks are no replicas of each other for SCOUT."""
    covered = {id(p) for m in ddps for p in m.parameters()}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]


def _find_ddp(model: nn.Module) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def _wrapping_ddp(model: nn.Module) -> Any:
    """The DistributedDataParallel wrapping `model`, when the caller passed the module DDP wraps
    (DDP holds it in its `_modules` dict): its replicas are the job's, and its gradients must be
    averaged by our comm hook for a resumed run to be bitwise the uninterrupted one. Looked up once,
    among the objects the garbage collector tracks (a module does not know its wrapper)."""
    from torch.nn.parallel import DistributedDataParallel

    targets = (model, uncompiled(model))
    # By type, not isinstance(): DDP is an ABC, whose instance check reads `obj.__class__`, and
    # some objects warn when touched (torch.distributed's deprecated `reduce_op`).
    for obj in live_instances(DistributedDataParallel):
        if any(obj.module is t for t in targets):
            return obj
    return None


def _fsdp1_topology(model: nn.Module, rank: int) -> AdapterTopology | None:
    """FullyShardedDataParallel (FSDP1): every rank of its process group runs the same layers on its
    own shard of the flat parameters (peers: step times, stalls and hangs compared); only hybrid
    sharding's replicas of one shard (its inter-node group) hold the same state."""
    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    root = next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)
    if root is None:
        return None
    shard = tuple(sorted(dist.get_process_group_ranks(root.process_group)))
    inter = getattr(root, "_inter_node_pg", None)
    if inter is None:
        return AdapterTopology((rank,), {"shard": shard}, (), "fsdp", shard)
    replicas = tuple(sorted(dist.get_process_group_ranks(inter)))
    peers = tuple(range(dist.get_world_size()))  # every replica of every shard runs the same layers
    return AdapterTopology(replicas, {"shard": shard, "replicate": replicas}, ("replicate",), "fsdp", peers)


def find_scheduler(optimizer: Any, live: list[Any] | None = None) -> tuple[Any, list[Any]]:
    """The learning-rate scheduler stepping `optimizer`: (the one, or None, and all found). A
    scheduler's state (its step count) is training state: a restart without it sets the learning
    rate back to the schedule's start. Looked up once among the objects the garbage collector
    tracks (`live`: those of a scan the caller made already); schedulers inside a SequentialLR or
    ChainedScheduler count as that one."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if live is None:
        live = live_instances(LRScheduler, ReduceLROnPlateau)
    kinds = (LRScheduler, ReduceLROnPlateau)
    found = [obj for obj in live if isinstance(obj, kinds) and getattr(obj, "optimizer", None) is optimizer]
    inner = {id(child) for obj in found for child in getattr(obj, "_schedulers", ())}
    outer = [obj for obj in found if id(obj) not in inner]
    return (outer[0] if len(outer) == 1 else None), outer


def _mesh_topology(model: nn.Module, rank: int) -> AdapterTopology | None:
    """Replica group from DTensor parameters: ranks equal to ours on every non-replicated mesh dim."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    mesh = None
    replicated: list[bool] | None = None
    meshes: list[Any] = []
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        if not any(p.device_mesh is m for m in meshes):
            meshes.append(p.device_mesh)
        if mesh is None:
            mesh = p.device_mesh
            replicated = [True] * mesh.ndim
        elif p.device_mesh != mesh:
            # Parameters on different meshes (e.g. TP on a sub-mesh): judge only those on the first.
            continue
        assert replicated is not None
        for i, placement in enumerate(p.placements):
            if not isinstance(placement, Replicate):
                replicated[i] = False
    if mesh is None or replicated is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    coords = mesh.get_coordinate()
    if coords is None:
        return None
    grid = mesh.mesh
    dims: dict[str, tuple[int, ...]] = {}
    for i, name in enumerate(names):
        index = list(coords)
        members = []
        for j in range(grid.shape[i]):
            index[i] = j
            members.append(int(grid[tuple(index)]))
        dims[name] = tuple(sorted(members))
    group = []
    for pos in torch.nonzero(torch.ones_like(grid), as_tuple=False).tolist():
        if all(replicated[i] or pos[i] == coords[i] for i in range(grid.ndim)):
            group.append(int(grid[tuple(pos)]))
    rep_names = tuple(n for n, r in zip(names, replicated, strict=True) if r)
    # Every rank of the mesh runs the same layers on its own shard and batch: peers for timing.
    peers = _mesh_peers(meshes, rank) or tuple(sorted(int(r) for r in grid.flatten().tolist()))
    return AdapterTopology(tuple(sorted(group)), dims, rep_names, "device_mesh", peers)


def _mesh_peers(meshes: list[Any], rank: int) -> tuple[int, ...]:
    """The ranks that run the same layers as `rank` on other shards and batches, from the meshes its
    parameters live on: the ranks of their root mesh at `rank`'s coordinates on every root dimension
    none of them spans (a pipeline stage's, say). Parameters on several meshes (FSDP2 over the
    data-parallel dimension for some, over it and a tensor-parallel one for others) make one group of
    the dimensions they span together; before, the first parameter's mesh alone was taken, and the
    ranks of a 2-D FSDP2 + TP job compared their progress only with their data-parallel peers (to
    them, a hang of a tensor-parallel peer was every rank stuck). Empty when the root is unknown
    (torch's private `_get_root_mesh`) or the meshes have different roots."""
    try:
        roots = {id(r): r for r in (m._get_root_mesh() for m in meshes)}
    except Exception:  # a torch without it: the first mesh, as before
        return ()
    if len(roots) != 1:
        return ()
    grid = next(iter(roots.values())).mesh
    cells = torch.nonzero(torch.ones_like(grid), as_tuple=False).tolist()
    where = {int(grid[tuple(i)]): tuple(i) for i in cells}
    if rank not in where:
        return ()
    spanned: set[int] = set()
    for m in meshes:
        coords = [where[int(r)] for r in m.mesh.flatten().tolist() if int(r) in where]
        spanned |= {d for d in range(grid.ndim) if len({c[d] for c in coords}) > 1}
    mine = where[rank]
    kept = [d for d in range(grid.ndim) if d not in spanned]
    return tuple(sorted(r for r, c in where.items() if all(c[d] == mine[d] for d in kept)))
