"""Audit records, packages and replays in one process (torch side of `core.scout.audit`).

The multi-process behaviour (DDP contributions, pairing, verdicts by vote) is in
tests/integration/test_scout_processes.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lm_resiliency.scout.audit import AuditRecorder, dump_package, load_package, package, replay_package


class Net(nn.Module):
    """Dropout (RNG), batch norm (buffers that forward updates) and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.drop(torch.relu(self.bn(self.a(x))))
        return {"out": self.b(h) * scale, "hidden": h}


def _step(model: nn.Module, rec: AuditRecorder, batches: list[torch.Tensor]) -> dict:
    for x in batches:
        out = model(x, scale=0.5)
        (out["out"] - 1).pow(2).mean().backward()
    record = rec.finish(1)
    assert record is not None
    # Without DDP there is no comm hook: the local gradients are `.grad` (no scaling).
    record.contrib = {i: p.grad.clone() for i, p in enumerate(model.parameters())}
    payload, problem = package(record, 1.0, 1 << 30)
    assert payload is not None, problem
    step, modules = load_package(dump_package(1, {"": payload}))
    assert step == 1
    return modules[""]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_replay_reproduces_a_step_bitwise(micro_batches: int) -> None:
    torch.manual_seed(0)
    model = Net()
    rec = AuditRecorder(model, lambda: 1)
    bn_before = model.bn.running_mean.clone()
    payload = _step(model, rec, [torch.randn(8, 16) for _ in range(micro_batches)])
    assert len(payload["micro"]) == micro_batches
    torch.randn(100)  # the RNG moved on since; replay must use the recorded state
    bn_after = model.bn.running_mean.clone()
    result = replay_package(rec, payload)
    assert result.finding(payload) == "ok"
    assert torch.equal(model.bn.running_mean, bn_after) and not torch.equal(bn_after, bn_before)
    assert all(p.grad is not None for p in model.parameters())  # untouched, not doubled
    rec.close()


@pytest.mark.timeout(60)
def test_corrupted_output_and_gradients_are_found() -> None:
    torch.manual_seed(0)
    model = Net()
    rec = AuditRecorder(model, lambda: 1)

    def flip_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
        with torch.no_grad():
            out.view(-1).view(torch.int32)[3] ^= 1 << 20

    flip = model.b.register_forward_hook(flip_output)
    payload = _step(model, rec, [torch.randn(8, 16)])
    flip.remove()
    assert replay_package(rec, payload).finding(payload) == "output"

    model.zero_grad()
    w = model.a.weight

    def flip_grad(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1).view(torch.int32)[5] ^= 1 << 4
        return g

    hook = w.register_hook(flip_grad)
    payload = _step(model, rec, [torch.randn(8, 16)])
    hook.remove()
    assert replay_package(rec, payload).finding(payload) == "grads"
    rec.close()


@pytest.mark.timeout(60)
def test_malformed_packages_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="not a loadable audit package"):
        load_package(b"garbage")
    with pytest.raises(ValueError, match="version"):
        load_package(_saved({"version": 99}))
    with pytest.raises(ValueError, match="without modules"):
        load_package(dump_package(3, {}))
    with pytest.raises(ValueError, match="micro-batches"):
        load_package(dump_package(3, {"": {"micro": []}}))
    torch.manual_seed(0)
    model = Net()
    rec = AuditRecorder(model, lambda: 1)
    payload = _step(model, rec, [torch.randn(8, 16)])
    rec.close()
    payload["micro"][0]["autocast"] = "load"  # names a torch function, not a dtype
    with pytest.raises(ValueError, match="not a torch dtype"):
        load_package(dump_package(3, {"": payload}))


def _saved(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.timeout(60)
def test_no_grad_forwards_are_not_recorded_and_size_limit_drops_gradients() -> None:
    torch.manual_seed(0)
    model = Net()
    rec = AuditRecorder(model, lambda: 1)
    with torch.no_grad():
        model(torch.randn(8, 16))
    assert rec.finish(1) is None
    out = model(torch.randn(8, 16))
    out["out"].sum().backward()
    record = rec.finish(1)
    assert record is not None
    record.contrib = {i: p.grad.clone() for i, p in enumerate(model.parameters())}
    # Inputs 512 B, buffers 264 B, RNG state 5056 B; output gradients 256 B: room for all but those.
    payload, _ = package(record, 1.0, 512 + 264 + 5056 + 100)
    assert payload is not None and payload["grads_fp"] == "" and not payload["micro"][0]["grad_out"]
    _, modules = load_package(dump_package(1, {"": payload}))  # empty fingerprints travel too
    payload = modules[""]
    assert replay_package(rec, payload).finding(payload) == "ok"
    payload, problem = package(record, 1.0, 16)
    assert payload is None and "audit_max_mib" in problem
    rec.close()


@pytest.mark.timeout(60)
def test_a_forward_hook_registered_after_the_recorder_is_seen() -> None:
    """Our output hook moves behind hooks registered later: it fingerprints what the call returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    rec = AuditRecorder(model, lambda: 1)

    def flip_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
        with torch.no_grad():
            out.view(-1).view(torch.int32)[2] ^= 1 << 12

    handle = model.register_forward_hook(flip_output)
    model(torch.randn(4, 16)).sum().backward()
    record = rec.finish(1)
    assert record is not None
    payload, _ = package(record, None, 1 << 20)
    assert payload is not None
    handle.remove()
    assert replay_package(rec, payload).finding(payload) == "output"
    rec.close()


@pytest.mark.timeout(60)
def test_expert_module_names_are_checked_with_a_clear_error() -> None:
    from lm_resiliency.scout.component import _expert_modules

    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    found = _expert_modules(model, {"expert_modules": ["1.0", "module.1.1"]})
    assert found == {"1.0": model[1][0], "module.1.1": model[1][1]}
    assert _expert_modules(model, {}) == {}
    with pytest.raises(ValueError, match=r"no module 'experts\.3'"):
        _expert_modules(model, {"expert_modules": ["experts.3"]})
    with pytest.raises(ValueError, match="must be a list of module names"):
        _expert_modules(model, {"expert_modules": "1.0"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_local_gradients_are_what_backward_left_before_any_reduction(micro_batches: int) -> None:
    """`local_grads`: `.grad` as backward accumulated it is compared, whatever reduces it afterwards;
    a gradient corrupted in backward is found; `.grad` not zeroed before the step is not compared."""
    torch.manual_seed(0)
    model = Net()
    rec = AuditRecorder(model, lambda: 1, local_grads=True)
    batches = [torch.randn(8, 16) for _ in range(micro_batches)]

    def run(zero: bool = True) -> dict:
        if zero:
            model.zero_grad()
        for x in batches:
            (model(x, scale=0.5)["out"] - 1).pow(2).mean().backward()
        for p in model.parameters():
            p.grad.mul_(0.25)  # what an all-reduce would do after backward: too late to matter
        record = rec.finish(1)
        assert record is not None
        payload, problem = package(record, 1.0, 1 << 30)
        assert payload is not None, problem
        return load_package(dump_package(1, {"": payload}))[1][""]

    payload = run()
    assert payload["grads_fp"] and len(payload["grad_index"]) == len(list(model.parameters()))
    assert replay_package(rec, payload).finding(payload) == "ok"

    model.zero_grad(set_to_none=False)  # zeros, not None: the same gradients (up to the sign of zero)
    payload = run(zero=False)
    assert replay_package(rec, payload).finding(payload) == "ok"

    def flip_grad(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1).view(torch.int32)[5] ^= 1 << 4
        return g

    hook = model.b.weight.register_hook(flip_grad)
    payload = run()
    hook.remove()
    assert replay_package(rec, payload).finding(payload) == "grads"

    payload = run(zero=False)  # accumulates onto the last step's gradients
    assert payload["grads_fp"] == ""
    assert replay_package(rec, payload).finding(payload) == "ok"  # the forward is still audited
    rec.close()

    # Steps that are not audited pay no hook per parameter in backward.
    due: list[int | None] = [None]
    rec = AuditRecorder(model, lambda: due[0], local_grads=True)
    model(batches[0])["out"].sum().backward()
    assert rec.finish(1) is None and not rec._grad_handles
    due[0] = 1
    model.zero_grad()
    model(batches[0])["out"].sum().backward()
    assert rec._grad_handles  # held while the step is recorded
    record = rec.finish(1)
    assert record is not None and len(record.contrib) == len(list(model.parameters()))
    assert not rec._grad_handles
    rec.close()


class _Dispatch(nn.Module):
    """Stands for a custom module holding an expert all-to-all: never a dense unit."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.scale = nn.Parameter(torch.ones(8))


@pytest.mark.timeout(60)
def test_dense_units_are_torch_layers_outside_the_experts() -> None:
    from lm_resiliency.scout.component import _dense_units

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
            self.moe = _Dispatch()
            self.sync = nn.SyncBatchNorm(8)  # a collective inside: excluded
            self.act = nn.GELU()  # no parameters: nothing to audit

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 10)

    model = Model()
    experts = [b.moe.experts for b in model.blocks]
    units = _dense_units(model, experts)
    assert list(units) == [
        "blocks.0.attn",
        "blocks.0.moe.router",
        "blocks.1.attn",
        "blocks.1.moe.router",
        "embed",
        "head",
    ]
    assert units["blocks.1.attn"] is model.blocks[1].attn
    # An expert that is a torch layer itself is not a dense unit, nor is a container holding it.
    seq = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert list(_dense_units(seq, [seq[1][0]])) == ["0", "1.1"]
    # Containers that are never called themselves: their layers are the units.
    holder = nn.Module()
    holder.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
    holder.by_name = nn.ModuleDict({"q": nn.Linear(4, 4)})
    holder.expert = nn.Linear(4, 4)
    assert list(_dense_units(holder, [holder.expert])) == ["by_name.q", "layers.0", "layers.1"]
    assert _dense_units(nn.Linear(4, 4), []) == {}  # the whole model never is one
    shared = nn.Linear(4, 4)
    twice = nn.Module()
    twice.a, twice.b = shared, shared
    assert list(_dense_units(twice, [])) == ["a"]


@pytest.mark.timeout(60)
def test_a_forward_recomputed_by_activation_checkpointing_is_recorded_once() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    unit = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    rec = AuditRecorder(unit, lambda: 1, local_grads=True)
    x = torch.randn(8, 16, requires_grad=True)
    checkpoint(unit, x, use_reentrant=False).pow(2).sum().backward()  # forward runs again in backward
    record = rec.finish(1)
    assert record is not None and len(record.micro) == 1
    payload, problem = package(record, 1.0, 1 << 30)
    assert payload is not None and payload["grads_fp"], problem
    assert replay_package(rec, payload).finding(payload) == "ok"
    rec.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        ),
    ],
)
def test_an_autocast_step_with_dropout_replays_bitwise_and_a_flip_is_found(device: str) -> None:
    """RNG (CPU or CUDA dropout), buffers, autocast (bfloat16) and output gradients on the device."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Dropout(0.2), nn.Linear(128, 16)).to(
        dev
    )
    rec = AuditRecorder(model, lambda: 1)

    def flip_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
        with torch.no_grad():
            out.view(-1).view(torch.int16)[7] ^= 1 << 9

    def step(flip: bool) -> dict:
        handle = model[3].register_forward_hook(flip_output) if flip else None
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(torch.randn(32, 64, device=dev))
        out.float().pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        record = rec.finish(1)
        assert record is not None and record.micro[0].autocast == "bfloat16"
        payload, problem = package(record, None, 1 << 30)
        assert payload is not None, problem
        return load_package(dump_package(1, {"": payload}))[1][""]

    clean = step(flip=False)
    assert replay_package(rec, clean).finding(clean) == "ok"
    flipped = step(flip=True)
    assert replay_package(rec, flipped).finding(flipped) == "output"
    rec.close()


@pytest.fixture
def one_rank_group():  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_fsdp2_unit_gradients_are_its_whole_ones_before_the_reduce_scatter(
    one_rank_group, micro_batches: int
) -> None:  # type: ignore[no-untyped-def]
    """A gathered FSDP2 unit: the gradients compared are the whole ones backward accumulated into
    the gathered parameters (each micro-batch's, freed by its reduce-scatter, summed as `.grad`
    would); a replay with the same gathered weights reproduces them; a flipped bit is found."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    for unit in (model[0], model[2], model):
        fully_shard(unit)
    rec = AuditRecorder(model[0], lambda: 1, gathered=True)
    batches = [torch.randn(8, 16) for _ in range(micro_batches)]

    def run(flip: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
        hooks = []
        if flip:  # corrupt the whole gradient of this unit before FSDP2 reduce-scatters it

            def install(module: nn.Module, args: object) -> None:
                def flip_grad(g: torch.Tensor) -> torch.Tensor:
                    g = g.clone()
                    g.view(-1).view(torch.int32)[5] ^= 1 << 4
                    return g

                if not hooks[1:]:
                    hooks.append(module.weight.register_hook(flip_grad))

            hooks.append(model[0].register_forward_pre_hook(install))
        for x in batches:
            (model(x) - 1).pow(2).mean().backward()
        for h in hooks:
            h.remove()
        record = rec.finish(1)
        assert record is not None and record.params is not None
        payload, problem = package(record, 1.0, 1 << 30)
        assert payload is not None, problem
        return load_package(dump_package(1, {"0": payload}))[1]["0"], record.params

    payload, gathered = run()
    assert payload["grads_fp"] and len(payload["grad_index"]) == 2
    assert replay_package(rec, payload, gathered).finding(payload) == "ok"
    assert not rec._grad_handles  # held only while the step is recorded
    payload, gathered = run(flip=True)
    assert replay_package(rec, payload, gathered).finding(payload) == "grads"
    rec.close()
