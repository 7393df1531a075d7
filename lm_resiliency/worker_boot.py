"""Worker start-up under the lm_resiliency torchrun backend (loaded through `_boot/sitecustomize.py`).

- Workers die with their agent: a SIGKILLed agent must not leave workers hung in a collective
  (Linux parent-death signal; a worker whose agent is already gone exits at once).
- Zero-import instrumentation: with a worker policy (`LM_RESILIENCY_WORKER_CONFIG`), an unmodified
  DDP script is instrumented without calling `enable_resiliency`. When torch is imported, the
  optimizers the script creates are noted; at the first forward of a data-parallel model (a
  DistributedDataParallel, or the outermost FullyShardedDataParallel or `fully_shard`ed module: the
  loop has begun; its optimizer and scheduler exist), the session is enabled with the policy's
  settings, which restores the recovered step before that forward runs. A restart whose loop has
  no step left runs no forward: its script's first read of its state (a `state_dict()`, its
  parameters, a `torch.save`, an evaluation) restores the step first, from this node's copy
  (`gemini.local`).
  A script that calls `enable_resiliency` itself is left alone. `LM_RESILIENCY_AUTO_INSTRUMENT=0`
  turns it off.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_resiliency._proc import pid_alive

__all__ = [
    "auto_instrument",
    "boot",
    "chain_next_sitecustomize",
    "die_with_agent",
    "instrument_on_torch_import",
]

_PR_SET_PDEATHSIG = 1


def die_with_agent(agent_pid: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The agent died before we asked. (Not "parent is pid 1": in a container torchrun may be pid 1.)
    if not pid_alive(agent_pid):
        os._exit(1)
    return True


def boot() -> None:
    raw = os.environ.get("LM_RESILIENCY_AGENT_PID", "")
    if raw.isdigit():
        die_with_agent(int(raw))
    policy = os.environ.get("LM_RESILIENCY_WORKER_CONFIG")
    if policy and os.environ.get("LM_RESILIENCY_AUTO_INSTRUMENT", "1") != "0":
        instrument_on_torch_import(policy)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after the module `name` has been executed (first import only)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            try:
                then()
            except Exception as exc:  # never break the script's import of torch
                sys.stderr.write(f"lm_resiliency: automatic instrumentation is off: {exc!r}\n")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def instrument_on_torch_import(policy_path: str) -> None:
    if "torch" in sys.modules:
        auto_instrument(policy_path)
    else:
        sys.meta_path.insert(0, _AfterImport("torch", lambda: auto_instrument(policy_path)))


def _data_parallel(module: Any, outermost: bool) -> bool:
    """Whether `module` is the model a loop trains data-parallel: a DistributedDataParallel, or when
    no other module's forward is running, a FullyShardedDataParallel or an FSDP2 (`fully_shard`)
    module (those wrap the inner units too; the outermost is the model)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return True
    if outermost and "DeepSpeedEngine" in {c.__name__ for c in type(module).__mro__}:
        return True  # (its optimizer, scheduler and group are the engine's: adapters/deepspeed.py)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    names = ("FullyShardedDataParallel", "FSDPModule")
    kinds = tuple(k for k in (getattr(fsdp, n, None) for n in names) if k is not None)
    return outermost and bool(kinds) and isinstance(module, kinds)


def _trained_plain(module: Any, optimizers: Any) -> bool:
    """Whether `module`, called outermost with gradients on, is the model of a loop that trains it
    with no data-parallel wrapper (its script all-reduces the gradients itself): it has trainable
    parameters, and they are exactly those the optimizers stepping any of them step (not a part of
    the model called on its own: a backbone, then a head), no DistributedDataParallel or FSDP
    module exists (a script with one is instrumented at its forward), and no pipeline stage (see
    `_pipeline_stages`). Before, such a script was never instrumented, silently: its restarts
    resumed the data at the planned step with fresh weights."""
    import torch

    if not torch.is_grad_enabled() or not isinstance(module, torch.nn.Module):
        return False
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    if not trained:
        return False
    stepping = [{id(p) for g in o.param_groups for p in g["params"]} for o in list(optimizers)]
    if trained != set().union(*(ids for ids in stepping if ids & trained)):
        return False
    if _pipeline_stages():
        return False
    from torch.nn.parallel import DistributedDataParallel

    from lm_resiliency.adapters.base import live_instances

    fsdp = sys.modules.get("torch.distributed.fsdp")
    wrappers = [getattr(fsdp, n, None) for n in ("FullyShardedDataParallel", "FSDPModule")]
    return not live_instances(DistributedDataParallel, *(k for k in wrappers if k is not None))


def _sharded_root() -> list[Any]:
    """The model an FSDP script trains, as its first forward would find it: the one outermost
    FullyShardedDataParallel or `fully_shard`ed module ([] where none, or several, exist)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = [k for k in (getattr(fsdp, n, None) for n in ("FullyShardedDataParallel", "FSDPModule")) if k]
    if not kinds:
        return []
    from lm_resiliency.adapters.base import live_instances

    found = live_instances(*kinds)
    inner = {id(m) for f in found for m in f.modules() if m is not f}
    roots = [f for f in found if id(f) not in inner]
    return roots if len(roots) == 1 else []


def _pipeline_stages() -> bool:
    """Whether this process holds a `torch.distributed.pipelining` stage: not instrumented at a
    forward, as enabling is collective and a stage's first forward comes only after the stage
    before it sent its activations, which it would not while enabling (outsider 44: every rank
    waited for the others' endpoints, 120 s, and died)."""
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    kind = getattr(stage, "_PipelineStageBase", None)
    if kind is None:
        return False
    from lm_resiliency.adapters.base import live_instances

    return bool(live_instances(kind))


def auto_instrument(policy_path: str) -> None:
    """Note optimizers; enable the session at a data-parallel model's first forward."""
    import itertools
    import weakref

    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    # In the order they were made: the same on every rank and every restart (a chain of several
    # is captured in its members' order).
    optimizers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    made = itertools.count()
    opt_init = torch.optim.Optimizer.__init__

    def noting_opt_init(self: Any, *args: Any, **kwargs: Any) -> None:
        opt_init(self, *args, **kwargs)
        optimizers[self] = next(made)

    torch.optim.Optimizer.__init__ = noting_opt_init  # type: ignore[method-assign]
    # DDP models in the order they were made, likewise: a script that trains several (a GAN's
    # generator and discriminator) has them all held, as one nn.ModuleDict in that order.
    from torch.nn.parallel import DistributedDataParallel

    ddps: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    ddp_init = DistributedDataParallel.__init__

    def noting_ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        ddp_init(self, *args, **kwargs)
        ddps[self] = next(made)

    DistributedDataParallel.__init__ = noting_ddp_init  # type: ignore[method-assign]
    state: dict[str, Any] = {"done": False, "handles": [], "depth": 0}

    def first_forward(module: Any, args: Any) -> Any:
        if torch.compiler.is_compiling():
            # Inside a compiled region (`torch.compile(DDP(model))`): its compiled wrapper's own
            # hooks ran eagerly first and decided there. Before, dynamo traced enable_resiliency
            # itself (graph breaks at every call it cannot trace) and the session's hooks landed
            # on the compiled module, traced at every step.
            return None
        state["depth"] += 1
        from lm_resiliency.adapters.base import uncompiled

        target = uncompiled(module)  # (the session holds the compiled wrapper: its hooks run eagerly)
        if state["done"]:
            return
        outer = state["depth"] == 1
        plain = False
        if not _data_parallel(target, outermost=outer):
            plain = outer and _trained_plain(target, optimizers)
            if not plain:
                restore_before_read(target)  # (an evaluation of the model before any step)
                return
        state["done"] = True
        disarm()
        # The hook lists were copied for this call: removing ours now is safe.
        for handle in state["handles"]:
            handle.remove()
        from lm_resiliency.api import open_session

        if (
            getattr(module, "_lm_resiliency_session", None) is not None
            or getattr(target, "_lm_resiliency_session", None) is not None
            or open_session() is not None
        ):
            # The script enabled it itself: on this model, or on an object holding it (a
            # ModuleDict of a GAN's pair, Megatron-style chunks), whose own modules are unmarked.
            return
        before = set(module._forward_pre_hooks)
        what = "a module no data-parallel wrapper holds: no replicas known, " if plain else ""
        if enable(module, target, what) is None:
            return None
        return _run_added_pre_hooks(module, args, before)

    def held_parts(module: Any, target: Any, engine: bool) -> tuple[Any, Any, str]:
        """What a session on `module` (`target`: as uncompiled) holds: the model, the optimizer
        (None: none; a list: a chain) and a word on them. A DeepSpeed engine owns its optimizer
        and scheduler (adapters/deepspeed.py); for another model, every optimizer stepping its
        parameters (Muon and AdamW: held as one, see adapters/chain.py), found in the order they
        were made."""
        from lm_resiliency.adapters.chain import outermost

        held, what = module, ""
        models = [d for d, _ in sorted(ddps.items(), key=lambda kv: kv[1])]
        if module is target and target in ddps and len(models) > 1:
            # Every DDP model the script made so far (a GAN's pair): before, the one called first
            # alone, and a restart started the other afresh (it only said so).
            held = torch.nn.ModuleDict({str(i): d for i, d in enumerate(models)})
            what = f"{len(models)} DDP models, "
        ids = {id(p) for p in held.parameters()}
        order = sorted(optimizers.items(), key=lambda kv: kv[1])
        mine = (
            []
            if engine
            else outermost(
                [o for o, _ in order if ids & {id(p) for g in o.param_groups for p in g["params"]}]
            )
        )
        stepped = [id(p) for o in mine for g in o.param_groups for p in g["params"]]
        if len(set(stepped)) != len(stepped):  # two step the same parameters: not a chain; the first
            mine = mine[:1]
        return held, (mine if len(mine) > 1 else next(iter(mine), None)), what

    def enable(module: Any, target: Any, what: str) -> Any:
        """The session on `module` with the policy's settings (None: refused, said why)."""
        from lm_resiliency.api import enable_resiliency
        from lm_resiliency.config import load_policy, policy_kwargs
        from lm_resiliency.errors import UnsupportedFrameworkError

        engine = "DeepSpeedEngine" in {c.__name__ for c in type(target).__mro__}
        held, opt, more = held_parts(module, target, engine)
        what += more
        # The scheduler stepping `opt` is found by enable_resiliency (a SequentialLR as one).
        try:
            session = enable_resiliency(
                held, *([] if engine else [opt]), **policy_kwargs(load_policy(policy_path))
            )
        except UnsupportedFrameworkError as exc:  # (a ZeRO stage not captured yet): the job runs on
            sys.stderr.write(f"lm_resiliency: not instrumented: {exc}\n")
            return None
        sys.stderr.write(
            f"lm_resiliency: instrumented automatically (rank {session.rank}, "
            f"{'DeepSpeed engine, ' if engine else ''}{what}resumed at step {session.step_count})\n"
        )
        if not engine:
            _warn_uncovered([target, *held.children()], opt, optimizers)
        return session

    def first_schedule_step(schedule: Any) -> None:
        """A pipeline schedule's first `step()`, before any of its stage's forwards: every rank
        reaches it on its own (a stage's first forward waits for the stage before it), so the
        session is enabled there, on the stage's module (no replicas known)."""
        if state["done"]:
            return
        stage = getattr(schedule, "_stage", None)
        module = getattr(stage, "submod", None)
        if not isinstance(module, torch.nn.Module):
            return  # (several stages per rank: the first optimizer step says it is not instrumented)
        state["done"] = True
        disarm()
        for handle in state["handles"]:
            handle.remove()
        from lm_resiliency.api import open_session

        if open_session() is None:
            enable(module, module, "a pipeline stage: no replicas known, ")

    def after_forward(module: Any, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():  # (as first_forward counts)
            state["depth"] -= 1

    def first_step(opt: Any, args: Any, kwargs: Any) -> None:
        """An optimizer stepped before any session opened: say that this job runs unprotected
        (its restarts would resume the data at the planned step with fresh weights)."""
        from lm_resiliency.api import open_session

        state["warned"].remove()
        if not state["done"] and open_session() is None:
            why = (
                "a pipeline-parallel job whose stages no single-stage schedule (GPipe, 1F1B) "
                "stepped first (torch.distributed.pipelining: a stage's first forward waits for the "
                "stage before it, and enabling is collective)"
                if _pipeline_stages()
                else "an optimizer stepped before a data-parallel model (DDP, FSDP, a DeepSpeed "
                "engine) or a module whose trainable parameters the optimizers step was called"
            )
            sys.stderr.write(
                f"lm_resiliency: not instrumented: {why}; this job's restarts would not restore its "
                "state. Call enable_resiliency yourself, before the loop\n"
            )

    planned = os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "")
    reads: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, ours): see read_restores

    def restore_before_read(module: Any = None) -> None:
        """The script reads its state (a `state_dict()`, a `torch.save`, a forward of a module
        its DDP model holds) before any session opened in a restart: restore the planned step
        here, from this node's memory (else another node's, else the durable tier), once, with no
        session. A loop with no step left runs no forward to restore it at: before, the script
        saved or evaluated the state it made (NOT RESTORED, below). Done before a loop's first
        forward, that forward's session restores the step again, as always."""
        if not reads or state.get("busy"):
            return  # (busy: its own reads while it looks, a parameters() among them)
        state["busy"] = True
        try:
            if state.get("later") is not None:
                scheduler_made_later()
            else:
                restore_now(module)
        except Exception as exc:  # (a policy unreadable now, a copy that does not fit): said at exit
            disarm()
            state["unrestored"] = f"{type(exc).__name__}: {exc}"
        finally:
            state["busy"] = False

    def scheduler_made_later() -> None:
        """The step was restored before the script made its scheduler, whose constructor then set
        the optimizer's learning rate to the schedule's first value: at the next read, once it
        exists, it takes the step's scheduler state and the optimizer its restored learning rates.
        Before, a restart with no step left saved the schedule's start. A session opened since
        restored everything itself."""
        from lm_resiliency.api import open_session

        restored, opt = state["later"]
        if state["done"] or open_session() is not None:
            state["later"] = None
            disarm()
        elif state.get("scheduler_made"):
            try:
                if not restored.apply_later(opt):
                    return
            except Exception as exc:  # (another kind of scheduler than the step's)
                said = f"could not restore step {planned}'s learning-rate schedule into it: {exc!r}"
            else:
                said = f"restored step {planned}'s learning-rate schedule into it"
            state["later"] = None
            disarm()
            sys.stderr.write(
                f"lm_resiliency: the script made its scheduler after step {planned} was restored; {said}\n"
            )

    def restore_now(module: Any) -> None:
        from lm_resiliency.api import open_session

        if state["done"] or open_session() is not None:
            disarm()
            return
        models = [d for d, _ in sorted(ddps.items(), key=lambda kv: kv[1])] or _sharded_root()
        if not models or (module is not None and id(module) not in held_modules(models)):
            return
        held, opt, _ = held_parts(models[0], models[0], False)
        if opt is None:
            return  # (no optimizer yet: a later read)
        from lm_resiliency.config import load_policy, read_environment
        from lm_resiliency.gemini.local import restore_planned

        policy = load_policy(policy_path)
        if not (policy.enable_checkpoint and policy.checkpoint.enable):
            disarm()
            return
        rank, world = (
            (torch.distributed.get_rank(), torch.distributed.get_world_size())
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        )
        restored = restore_planned(
            held,
            opt,
            int(planned),
            rank=rank,
            world_size=world,
            env=read_environment(),
            checkpoint=policy.checkpoint,
            durable_folder=policy.durable.folder if policy.durable else None,
        )
        state["restored"] = True
        if restored.scheduler_state is not None:  # (its reads stay armed for that: see there)
            state["later"] = (restored, opt)
            from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

            for kind in (LRScheduler, ReduceLROnPlateau):  # (the latter's __init__ is its own)
                note_made(kind)
        else:
            disarm()
        sys.stderr.write(
            f"lm_resiliency: restored step {planned} (rank {rank}, from {_TIERS[restored.tier]}) when "
            "the script read its state before any forward of its model\n"
        )

    def held_modules(models: list[Any]) -> set[int]:
        key = tuple(id(m) for m in models)
        if state.get("held_key") != key:
            state["held_key"] = key
            state["held_ids"] = {id(m) for d in models for m in d.modules()}
        held_ids: set[int] = state["held_ids"]
        return held_ids

    def read_restores(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def ours(*args: Any, **kwargs: Any) -> Any:
            restore_before_read()
            return original(*args, **kwargs)

        setattr(owner, name, ours)
        reads.append((owner, name, original, ours))

    def note_made(kind: Any) -> None:
        """Note that a scheduler was made (`scheduler_made_later` looks for it only then: finding
        it scans the collector's objects)."""
        original = kind.__init__

        @functools.wraps(original)
        def ours(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            state["scheduler_made"] = True

        kind.__init__ = ours
        reads.append((kind, "__init__", original, ours))

    def disarm() -> None:
        for owner, name, original, ours in reads:
            if getattr(owner, name) is ours:  # (else wrapped again since: left alone)
                setattr(owner, name, original)
        reads.clear()

    if planned.isdigit() and int(planned) > 0:
        for owner, name in (
            (torch.nn.Module, "state_dict"),
            # Its parameters read as they are (a save of each `to_local()` shard, or an evaluation
            # of its own); `parameters()` reads through it. Once an optimizer exists: before, the
            # read one made (the optimizer's own) restores nothing (restore_now).
            (torch.nn.Module, "named_parameters"),
            (torch.optim.Optimizer, "state_dict"),
            (torch, "save"),
        ):
            read_restores(owner, name)

        def at_exit_without_session() -> None:
            """At exit, where no session opened in this restart (the loop had no step left: the
            failure came after the last step's capture, so no forward came to open one): rank 0
            makes the reports a session's start makes of the generation before's ranks that ended
            unseen (`api.report_unwatched_exits`; before, a rank SIGTERMed in the last step was
            named by no report). And where the script read nothing a restore here could precede
            (above), or that restore failed, what it did after its loop holds the state it made,
            not the step's: say so, loudly."""
            from lm_resiliency.api import report_unwatched_exits, sessions_started

            if sessions_started() > 0:
                return
            rank = os.environ.get("RANK", "")  # (torchrun's; the process group may be gone)
            report_unwatched_exits(int(rank) if rank.isdigit() else -1, _report_dir(policy_path))
            if state.get("restored") or state["done"]:
                return  # (done: enabling was tried, said why)
            why = state.get("unrestored")
            sys.stderr.write(
                f"lm_resiliency: NOT RESTORED: this restart was to resume at step {planned}, "
                "which zero-import instrumentation restores at the model's first forward, and "
                "the script made none (its loop had no step left to run)"
                + (f"; restoring it when the script read its state failed: {why}" if why else "")
                + ". Its model and optimizer stayed as the script made them: anything it saved or "
                "evaluated after its loop is not step " + planned + "'s state. Call "
                "enable_resiliency yourself, before the loop: it restores at once.\n"
            )

        atexit.register(at_exit_without_session)
    state["handles"] = [
        register_module_forward_pre_hook(first_forward),
        register_module_forward_hook(after_forward, always_call=True),
    ]
    state["warned"] = register_optimizer_step_pre_hook(first_step)
    _after_import(_PIPELINE, lambda schedules: _wrap_schedule_step(schedules, first_schedule_step))


_TIERS = {"local": "this node's memory", "peer": "another node's memory", "disk": "the durable copy"}


def _report_dir(policy_path: str) -> str | None:
    """The worker policy's report folder (its replay settings'), None where it names none or cannot
    be read now."""
    from lm_resiliency.config import load_policy

    try:
        return load_policy(policy_path).replay.report_dir
    except Exception:  # (read at start; changed since: the environment's folder, if any)
        return None


_PIPELINE = "torch.distributed.pipelining.schedules"


def _after_import(name: str, then: Callable[[Any], None]) -> None:
    """`then(module)` once the module `name` is imported (now, if it is)."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, lambda: then(sys.modules[name])))


def _wrap_schedule_step(schedules: Any, first: Callable[[Any], None]) -> None:
    """Call `first(schedule)` before each single-stage pipeline schedule's `step()` (GPipe, 1F1B:
    their `PipelineScheduleSingle.step`)."""
    cls = getattr(schedules, "PipelineScheduleSingle", None)
    step = getattr(cls, "step", None)
    if step is None or getattr(step, "_lm_resiliency_wraps", None) is not None:
        return

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        first(self)
        return step(self, *args, **kwargs)

    wrapped._lm_resiliency_wraps = step  # type: ignore[attr-defined]
    cls.step = wrapped  # type: ignore[union-attr]


def _warn_uncovered(modules: list[Any], opt: Any, optimizers: Any) -> None:
    """Say so when the script trains more than the session holds: other DDP models (one made after
    the first forward), other optimizers. A restart would restore those held and start the others
    afresh."""
    from torch.nn.parallel import DistributedDataParallel

    from lm_resiliency.adapters.base import live_instances

    models = [m for m in live_instances(DistributedDataParallel) if not any(m is h for h in modules)]
    from lm_resiliency.adapters.chain import outermost

    held = opt if isinstance(opt, list) else [opt]
    # (a held ZeroRedundancyOptimizer's inner one is no other)
    others = [o for o in outermost(list(optimizers)) if not any(o is h for h in held)]
    if models or others:
        sys.stderr.write(
            "lm_resiliency: automatic instrumentation holds the DDP models made before the first "
            f"forward and the optimizers stepping them; this script also has {len(models)} other "
            f"DDP model(s) and {len(others)} other optimizer(s), which a restart would start afresh. Call "
            "enable_resiliency yourself with one nn.ModuleDict of every model and the list of "
            "every optimizer\n"
        )


def _run_added_pre_hooks(module: Any, args: Any, before: set[int]) -> Any:
    """Run, for the forward under way, the forward pre-hooks `module` gained since `before` (the
    session's, added while this forward's hooks were already chosen), in their order; returns the
    arguments as they leave them (None: unchanged). Skipped, this step began without them: DDP's
    first backward then reduced in its own bucket layout, not the canonical one, and a resumed run
    of 3 or more replicas differed from the uninterrupted one in the last bits."""
    changed = None
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in before or key in module._forward_pre_hooks_with_kwargs:
            continue
        result = hook(module, args)
        if result is not None:
            args = changed = result if isinstance(result, tuple) else (result,)
    return changed


def chain_next_sitecustomize(ours: str) -> None:
    """Run the `sitecustomize` that ours shadows (the first other one on sys.path)."""
    here = Path(ours).resolve().parent
    for entry in sys.path:
        try:
            folder = Path(entry or ".").resolve()
        except OSError:
            continue
        if folder == here:
            continue
        candidate = folder / "sitecustomize.py"
        if candidate.is_file():
            spec = importlib.util.spec_from_file_location("_lm_resiliency_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return
