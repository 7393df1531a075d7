"""Several optimizers as one (adapters/chain.py): when a step begins and ends, the state of all of
them in one torch-format state dict and back, a loss scaler's skipped step, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lm_resiliency.adapters.amp import ScalerWatch
from lm_resiliency.adapters.chain import OptimizerChain, SchedulerChain, outermost
from lm_resiliency.gemini.state import load_optimizer_state

pytestmark = pytest.mark.timeout(60)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _pair(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    matrices = [p for p in net.parameters() if p.ndim == 2]
    rest = [p for p in net.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW([{"params": rest[:2]}, {"params": rest[2:], "weight_decay": 0.0}], lr=1e-2)
    return muon, adamw


def _train(net: nn.Module, opts: list[torch.optim.Optimizer], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = net(torch.randn(4, 6, generator=g)).pow(2).mean()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()


def test_a_step_begins_with_the_first_member_and_ends_when_every_member_stepped() -> None:
    net = _net()
    muon, adamw = _pair(net)
    chain = OptimizerChain([muon, adamw])
    seen: list[str] = []
    chain.register_step_pre_hook(lambda opt, args, kwargs: seen.append("begin"))
    handle = chain.register_step_post_hook(lambda opt, args, kwargs: seen.append("end"))
    _train(net, [muon, adamw], 2)
    assert seen == ["begin", "end", "begin", "end"]
    # A discriminator stepped three times a generator step, the generator last: one step.
    seen.clear()
    for _ in range(3):
        adamw.step()
    muon.step()
    assert seen == ["begin", "end"]
    handle.remove()
    seen.clear()
    _train(net, [muon, adamw], 1)
    assert seen == ["begin"]
    chain.remove_hooks()
    seen.clear()
    _train(net, [muon, adamw], 1)
    assert seen == []


def test_a_member_that_never_steps_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    net = _net()
    muon, adamw = _pair(net)
    chain = OptimizerChain([muon, adamw])
    ends: list[int] = []
    chain.register_step_post_hook(lambda opt, args, kwargs: ends.append(1))
    _train(net, [muon], 40)
    assert not ends
    said = [r for r in caplog.records if "optimizer[0] stepped 16 times" in r.getMessage()]
    assert len(said) == 1 and "optimizer [1] did not" in said[0].getMessage()


def test_the_state_of_every_member_round_trips_through_one_torch_format_state_dict() -> None:
    net = _net()
    muon, adamw = _pair(net)
    _train(net, [muon, adamw], 3)
    chain = OptimizerChain([muon, adamw])
    saved = copy.deepcopy(chain.state_dict())
    n_muon = len(muon.param_groups[0]["params"])
    assert saved["optimizers"] == [1, 2] and len(saved["param_groups"]) == 3
    # One index space, torch's: Muon's parameters first, then AdamW's.
    assert sorted(saved["state"]) == list(range(n_muon + 4))
    assert set(saved["state"][0]) == {"momentum_buffer"} and "exp_avg" in saved["state"][n_muon]
    assert [p for g in saved["param_groups"] for p in g["params"]] == list(range(n_muon + 4))
    # The chain's view of its members, as the session reads an optimizer.
    assert len(chain.param_groups) == 3 and len(chain.state) == n_muon + 4
    assert chain.member_of(net[2].bias) is adamw and chain.member_of(torch.zeros(1)) is None

    other = _net()
    fresh = _pair(other)
    twin = OptimizerChain(list(fresh))
    load_optimizer_state(twin, saved)
    for a, b in zip((muon, adamw), fresh, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for pid, entry in sa["state"].items():
            for k, v in entry.items():
                assert torch.equal(v, sb["state"][pid][k]), (type(a).__name__, pid, k)


def test_a_checkpoint_of_other_optimizers_is_refused_naming_what_differs() -> None:
    net = _net()
    muon, adamw = _pair(net)
    chain = OptimizerChain([muon, adamw])
    with pytest.raises(ValueError, match="holds the state of one optimizer, and this session steps 2"):
        chain.load_state_dict(adamw.state_dict())
    saved = chain.state_dict()
    with pytest.raises(ValueError, match=r"holds 2 optimizers with \[1, 2\] parameter groups, and this "):
        OptimizerChain([adamw, muon]).load_state_dict(saved)
    with pytest.raises(ValueError, match="the checkpoint holds one scheduler, and this session steps 2"):
        SchedulerChain([torch.optim.lr_scheduler.StepLR(o, 2) for o in (muon, adamw)]).load_state_dict({})


def test_bad_lists_of_optimizers_are_refused() -> None:
    net = _net()
    muon, _ = _pair(net)
    with pytest.raises(ValueError, match="empty"):
        OptimizerChain([])
    with pytest.raises(TypeError, match=r"optimizer\[1\] must be a torch.optim.Optimizer, got int"):
        OptimizerChain([muon, 3])
    with pytest.raises(ValueError, match="listed twice"):
        OptimizerChain([muon, muon])
    both = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer\[0\] and optimizer\[1\] both step a parameter"):
        OptimizerChain([muon, both])


def test_a_wrapped_optimizer_is_not_one_of_the_outermost() -> None:
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)

    class Wrapper(torch.optim.SGD):
        def __init__(self) -> None:
            super().__init__(net.parameters(), lr=0.1)
            self.inner = inner

    outer = Wrapper()
    assert outermost([inner, outer]) == [outer]


def test_a_step_the_loss_scaler_skips_for_one_member_still_ends_the_step() -> None:
    net = _net()
    muon, adamw = _pair(net)
    chain = OptimizerChain([muon, adamw])
    ends: list[int] = []
    from lm_resiliency.adapters.amp import mark_ours

    mark_ours(chain.register_step_post_hook(lambda opt, args, kwargs: ends.append(1)))
    scaler = torch.amp.GradScaler("cpu")
    watch = ScalerWatch(scaler, chain)
    try:
        g = torch.Generator().manual_seed(3)
        for i in range(3):
            loss = net(torch.randn(4, 6, generator=g)).pow(2).mean()
            muon.zero_grad()
            adamw.zero_grad()
            scaler.scale(loss).backward()
            if i == 1:  # an overflow in AdamW's gradients only: the scaler skips its step
                next(iter(adamw.param_groups[0]["params"])).grad[0] = float("inf")
            before = [p.detach().clone() for p in adamw.param_groups[0]["params"]]
            scaler.step(muon)
            scaler.step(adamw)
            scaler.update()
            if i == 1:
                assert all(
                    torch.equal(a, b) for a, b in zip(before, adamw.param_groups[0]["params"], strict=True)
                )
        assert ends == [1, 1, 1] and watch.skipped == 1
    finally:
        watch.remove()


def test_the_hook_tables_are_torchs_a_hook_moved_to_the_front_runs_first() -> None:
    """A fault injector moves its pre-hook to the front of the table (a gradient damaged after its
    reduction is what every later reader sees, SCOUT's fingerprints included)."""
    net = _net()
    muon, adamw = _pair(net)
    chain = OptimizerChain([muon, adamw])
    order: list[str] = []
    chain.register_step_pre_hook(lambda opt, args, kwargs: order.append("fingerprint"))
    first = chain.register_step_pre_hook(lambda opt, args, kwargs: order.append("inject"))
    chain._optimizer_step_pre_hooks.move_to_end(first.id, last=False)
    _train(net, [muon, adamw], 1)
    assert order == ["inject", "fingerprint"]
