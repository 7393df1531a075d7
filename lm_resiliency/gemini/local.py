"""A restore with no session: this rank's copy of the step its restart planned, read from this node's
memory (else another node's, through its agent; else the durable tier) and loaded into the live
objects, with no session of any peer involved.

For a zero-import worker (`worker_boot`), whose session opens, and restores, at its model's first
forward: a restart that resumes at the loop's last step (the failure came after that step's
capture: an exception in the final save, a hang after the loop) runs no forward, and what the
script then saved or evaluated was the fresh model's state. The agents chose the step from every
rank's inventory, so each rank's copy is known to exist; reading it needs no agreement.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_resiliency.config import Environment, InMemoryCkptConfig
from lm_resiliency.gemini.durable import DurableError, DurableStore, path_name
from lm_resiliency.gemini.node_copies import fetch_replica
from lm_resiliency.gemini.state import apply_state, decode_payload, materialize
from lm_resiliency.runtime.shm import HEADER_SIZE, CorruptSlot, SlotFile, SlotHeader, verify_image

__all__ = ["Restored", "restore_planned"]


def restore_planned(
    model: Any,
    optimizer: Any,
    step: int,
    *,
    rank: int,
    world_size: int,
    env: Environment,
    checkpoint: InMemoryCkptConfig,
    durable_folder: str | None,
) -> Restored:
    """Restore `step` of `rank` into `model`, `optimizer` (as a session holds them: see
    `api.captured_with`), its schedulers and GradScaler, from this node's memory, else a replica
    another node's agent serves (`node_copies`: a node that replaced a lost one), else the durable
    tier. Returns the tier it came from ("local", "peer" or "disk"), and the step's scheduler state
    where the optimizer has no scheduler yet (the script makes it later: `apply_later`). Raises
    LookupError naming why each copy was skipped (missing, damaged, another run's or topology's:
    nothing loaded), and what `apply_state` raises for a copy that does not fit."""
    from lm_resiliency.api import captured_with

    optimizer, scheduler, scaler = captured_with(optimizer)
    run_id = checkpoint.run_id or env.run_id
    expect = _Expected(step, rank, world_size, run_id, _planned_topology(env))
    why: list[str] = []
    folder = Path(env.shm_dir) / path_name(run_id) / path_name(env.node_id())
    for k in (0, 1):
        path = folder / f"own-r{rank}-s{k}"
        if not path.exists():
            continue
        try:
            slot = SlotFile.open_existing(path)
        except CorruptSlot as exc:
            why.append(str(exc))
            continue
        try:
            h = slot.read_header()
            if h.step != step:
                continue
            expect.check(path.name, h)
            slot.verify(h)
            return Restored("local", *_load(slot.payload(h), h, model, optimizer, scheduler, scaler))
        except CorruptSlot as exc:
            why.append(str(exc))
        finally:
            slot.close()
    if env.control_store:  # (under the torchrun backend) a replica another node holds
        try:
            fetched, h, _ = fetch_replica(
                env.control_store,
                f"lmr/{env.control_run_id()}/",
                env.agent_node_id or env.node_id(),
                rank,
                step,
                expect.check,
            )
        except LookupError as exc:
            why.append(f"from another node: {exc}")
        else:
            payload = memoryview(fetched)[HEADER_SIZE : HEADER_SIZE + h.payload_len]
            return Restored("peer", *_load(payload, h, model, optimizer, scheduler, scaler))
    if durable_folder:
        store = DurableStore(durable_folder, run_id, rank)
        try:
            image = memoryview(bytearray(store.read(step)))  # (writable: tensors view it)
            h = verify_image(str(store.path(step)), image)
            expect.check(str(store.path(step)), h)
            payload = image[HEADER_SIZE : HEADER_SIZE + h.payload_len]
            return Restored("disk", *_load(payload, h, model, optimizer, scheduler, scaler))
        except (DurableError, CorruptSlot) as exc:
            why.append(str(exc))
    where = f"{folder}" + (f" or {durable_folder}" if durable_folder else "")
    raise LookupError("; ".join(why) or f"no copy of rank {rank} step {step} in {where}")


@dataclass(frozen=True)
class Restored:
    """What `restore_planned` restored: the tier, and what waits for a scheduler the script has not
    made yet (the step's scheduler state, and the optimizer's hyperparameters as restored, which a
    scheduler's constructor overwrites with its own first value)."""

    tier: str
    scheduler_state: Any = None
    param_groups: list[dict[str, Any]] | None = None

    def apply_later(self, optimizer: Any) -> bool:
        """Load the waiting scheduler state into the scheduler now stepping `optimizer`, and give
        the optimizer back its restored hyperparameters. False while it has none."""
        from lm_resiliency.api import captured_with

        held, scheduler, _ = captured_with(optimizer)
        if scheduler is None or self.param_groups is None:
            return False
        scheduler.load_state_dict(self.scheduler_state)
        for group, saved in zip(held.param_groups, self.param_groups, strict=True):
            group.update(saved)
        return True


def _load(
    payload: memoryview, h: SlotHeader, model: Any, optimizer: Any, scheduler: Any, scaler: Any
) -> tuple[Any, list[dict[str, Any]] | None]:
    state = decode_payload(payload, h.index_len)
    materialize(state, model, optimizer)
    apply_state(state, model, optimizer, scheduler, None, scaler)
    if scheduler is not None or "scheduler" not in state or optimizer is None:
        return None, None
    # (copies: a scheduler fills a tensor learning rate in place)
    groups = [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]
    return state["scheduler"], groups


@dataclass(frozen=True)
class _Expected:
    """What a copy's header must say to be this rank's copy of the planned step."""

    step: int
    rank: int
    world_size: int
    run_id: str
    topology: str  # "" when not known

    def check(self, name: str, h: SlotHeader) -> None:
        if h.step != self.step or h.owner != self.rank or h.run_id != self.run_id[:64]:
            raise CorruptSlot(f"{name}: holds rank {h.owner} step {h.step} of run {h.run_id!r}")
        if h.world_size != self.world_size or (self.topology and h.topology != self.topology):
            raise CorruptSlot(
                f"{name}: step {h.step} taken with another topology (world size {h.world_size}, "
                f"topology {h.topology}; this job: {self.world_size}, {self.topology or '?'})"
            )


def _planned_topology(env: Environment) -> str:
    """The topology digest the restart was planned for ("" when no restart context says)."""
    if not env.restart_context_path:
        return ""
    try:
        ctx = json.loads(Path(env.restart_context_path).read_text())
    except (OSError, ValueError):
        return ""
    digest = ctx.get("topology_digest") if isinstance(ctx, dict) else None
    return digest if isinstance(digest, str) else ""
