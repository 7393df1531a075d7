"""The campaign injector: each fault it supports, injected into a real job, recorded as ground truth."""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.faults.campaign import CampaignError, parse_campaign
from lm_resiliency.faults.inject import CampaignInjector, corrupt, read_ground_truth
from lm_resiliency.faults.scoring import evaluate

pytestmark = pytest.mark.timeout(120)
WORKER = "tests/faults/campaign_worker.py"


def _campaign(*faults: dict[str, Any], at: int = 3, **incident: Any) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "name": "t",
        "seed": 3,
        "incidents": [
            {
                "incident_id": "i",
                "trigger": {"at": [at]},
                "faults": [{"fault_id": f"f{n}", **f} for n, f in enumerate(faults)],
                **incident,
            }
        ],
    }


class _Session:
    """What the injector reads of a session: the completed steps."""

    step_count = 0


def _train(
    campaign: dict[str, Any] | None,
    steps: int,
    folder: Path,
    seen: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """`steps` steps of a small model, the injector (if any) driven as the session drives it; the
    state after each step. `seen`: lists to fill with what the optimizer saw of the first layer's
    weight gradient and what the loss saw of the first layer's output, each iteration (hooks
    after the injector's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    inj = None
    if campaign is not None:
        inj = CampaignInjector(parse_campaign(campaign), 0, folder, model, opt, node="n0", generation=2)
    if seen is not None:
        grads, outs = seen
        opt.register_step_pre_hook(lambda o, a, k: grads.append(model[0].weight.grad.clone()))
        model[0].register_forward_hook(lambda m, a, out: outs.append(out.detach().clone()))
    s = _Session()
    states = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        s.step_count += 1
        if inj is not None:
            inj.on_step(s, None)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states, inj


def _drive(inj: CampaignInjector, model: nn.Module, opt: Any, steps: int) -> None:
    """`steps` steps of `model`, the injector driven as the session drives it."""
    s = _Session()
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        s.step_count += 1
        inj.on_step(s, None)


def _start_pair(
    processes: Any,
    tmp_path: Path,
    campaign: dict[str, Any],
    steps: int,
    per_rank: tuple[dict[str, str], ...] = ({}, {}),
    nodes: bool = False,
    world: int = 2,
    **env: str,
) -> tuple[list[Any], dist.TCPStore]:
    """`world` (two) campaign workers with the campaign armed (each on a synthetic node of its own
    with `nodes`); the processes and the store they meet through (keep it while they run)."""
    (tmp_path / "c.json").write_text(json.dumps(campaign))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {
        "WORLD_SIZE": str(world),
        "STORE_PORT": str(store.port),
        "STEPS": str(steps),
        "RESULT_DIR": str(tmp_path),
        "REPORT_DIR": str(tmp_path / "reports"),
        "LM_RESILIENCY_FAULT_CAMPAIGN": str(tmp_path / "c.json"),
        **env,
    }
    procs = []
    for r in range(world):
        node = {}
        if nodes:
            (tmp_path / f"machine-{r}").write_text(f"node-{r}\n")
            node = {"LM_RESILIENCY_MACHINE_ID_PATH": str(tmp_path / f"machine-{r}")}
        rank_env = {**base, **node, "RANK": str(r), **(per_rank[r] if r < len(per_rank) else {})}
        procs.append(processes.start([WORKER], rank_env, tmp_path / f"rank{r}.log"))
    return procs, store


def _all_reports(tmp_path: Path) -> list[dict[str, Any]]:
    return [
        json.loads(x)
        for f in sorted((tmp_path / "reports").glob("*.jsonl"))
        for x in f.read_text().splitlines()
    ]


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: int((a[k] != b[k]).sum()) for k in a if not torch.equal(a[k], b[k])}


def test_a_weight_bit_flip_hits_one_element_after_the_step_it_names(tmp_path: Path) -> None:
    ref, _ = _train(None, 5, tmp_path)
    c = _campaign(
        {
            "type": "tensor_corruption",
            "target": {"surface": "weight", "rank": 0, "module_path": "1.weight"},
            "parameters": {"operation": "single_bitflip", "magnitude": "catastrophic"},
        }
    )
    got, _ = _train(c, 5, tmp_path / "gt")
    assert all(torch.equal(got[i][k], ref[i][k]) for i in range(2) for k in ref[i])
    assert _differing(got[2], ref[2]) == {"1.weight": 1}
    assert float(got[2]["1.weight"].abs().max()) > 1e30
    (g,) = read_ground_truth(tmp_path / "gt")
    assert (g.occurrence_id, g.type, g.iteration, g.rank, g.node, g.generation) == (
        "i@3",
        "tensor_corruption",
        3,
        0,
        "n0",
        2,
    )
    assert g.expected_kind == "sdc" and g.expected_ranks == (0,)


def test_the_faults_of_one_incident_on_two_ranks_corrupt_each_its_own_element(tmp_path: Path) -> None:
    """Two devices never corrupt alike: each fault of an incident draws its own element. Before,
    both ranks flipped the same bit of the same element, and of three replicas the two corrupted
    ones agreed: the healthy one was the minority named. An incident of one fault draws as it did."""
    flip = {"operation": "single_bitflip", "magnitude": "catastrophic"}

    def weights(campaign: dict[str, Any], rank: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        truth = tmp_path / f"gt{len(list(tmp_path.iterdir()))}"  # (each a run of its own)
        inj = CampaignInjector(parse_campaign(campaign), rank, truth, model, None, world_size=2)
        s = _Session()
        for _ in range(3):
            s.step_count += 1
            inj.on_step(s, None)
        inj.close()
        return model[1].weight.detach().clone()

    torch.manual_seed(0)
    clean = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))[1].weight.detach()
    target = {"surface": "weight", "module_path": "1.weight"}
    two = _campaign(
        {"type": "tensor_corruption", "target": {**target, "rank": 0}, "parameters": flip},
        {"type": "tensor_corruption", "target": {**target, "rank": 1}, "parameters": flip},
    )
    hit = [set((weights(two, r) != clean).view(-1).nonzero().view(-1).tolist()) for r in (0, 1)]
    assert all(len(h) == 1 for h in hit) and hit[0] != hit[1]
    one = _campaign({"type": "tensor_corruption", "target": {**target, "rank": 0}, "parameters": flip})
    (only,) = set((weights(one, 0) != clean).view(-1).nonzero().view(-1).tolist())
    assert only == random.Random("3/i@3").randrange(clean.numel())


def test_a_gradient_corruption_lands_before_the_optimizer_of_its_iteration(tmp_path: Path) -> None:
    ref, _ = _train(None, 4, tmp_path)
    c = _campaign(
        {
            "type": "tensor_corruption",
            "target": {"surface": "gradient", "index": 2},
            "parameters": {"operation": "sign_flip", "scope": "row"},
        }
    )
    got, _ = _train(c, 4, tmp_path / "gt")
    assert not _differing(got[1], ref[1])
    assert set(_differing(got[2], ref[2])) == {"1.weight"}  # the third parameter, iteration 3's update


def test_a_tensor_fault_with_nothing_to_damage_is_neither_injected_nor_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gradient fault on a parameter that has no gradient (frozen here; a DeepSpeed ZeRO-2 job
    keeps them in its partitions): before, the ground truth named an SDC nobody could find, and
    scoring counted it missed. Now the log says why and nothing is recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    c = _campaign(
        {"type": "tensor_corruption", "target": {"surface": "gradient", "module_path": "0.weight"}}, at=2
    )
    inj = CampaignInjector(parse_campaign(c), 0, tmp_path, model, opt, node="n0", generation=0)
    _drive(inj, model, opt, 3)
    assert read_ground_truth(tmp_path) == []
    assert "i@2 (tensor_corruption of a gradient) not injected at iteration 2" in caplog.text


def test_stale_state_undoes_its_iteration_on_this_rank(tmp_path: Path) -> None:
    ref, _ = _train(None, 4, tmp_path)
    got, _ = _train(
        _campaign({"type": "stale_state", "target": {"surface": "weight", "index": 0}}), 4, tmp_path / "gt"
    )
    assert torch.equal(got[2]["0.weight"], ref[1]["0.weight"])
    assert torch.equal(got[2]["0.bias"], ref[2]["0.bias"])


def _seen(campaign: dict[str, Any] | None, steps: int, folder: Path) -> tuple[list[Any], list[Any]]:
    """What the optimizer saw of the first layer's weight gradient and the loss of its output."""
    grads: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    _train(campaign, steps, folder, (grads, outs))
    return grads, outs


def test_stale_state_of_a_gradient_or_an_output_reuses_the_previous_iterations(tmp_path: Path) -> None:
    """FAILURES.md's stale_state on a gradient (a rank steps with the previous step's reduced
    gradient) and on an output (a module hands on its previous call's output): refused at attach
    before. Only iteration 3 sees iteration 2's values; the ground truth names the iteration."""
    ref_grads, ref_outs = _seen(None, 4, tmp_path / "ref")
    grad = _campaign({"type": "stale_state", "target": {"surface": "gradient", "module_path": "0.weight"}})
    grads, _ = _seen(grad, 4, tmp_path / "g")
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    assert torch.equal(grads[2], ref_grads[1]) and not torch.equal(grads[2], ref_grads[2])
    assert not torch.equal(grads[3], ref_grads[3])  # the weights it led to differ from then on
    (g,) = read_ground_truth(tmp_path / "g")
    assert (g.type, g.iteration, g.surface) == ("stale_state", 3, "gradient")
    out = _campaign({"type": "stale_state", "target": {"surface": "output", "module_path": "0"}})
    _, outs = _seen(out, 4, tmp_path / "o")
    assert torch.equal(outs[1], ref_outs[1]) and torch.equal(outs[2], ref_outs[1])
    assert not torch.equal(outs[2], ref_outs[2])
    assert read_ground_truth(tmp_path / "o")[0].surface == "output"


def test_stale_state_with_no_iteration_before_it_in_the_process_waits_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first iteration a process runs has no previous values to reuse: nothing is injected then
    and the log says why; the fault waits for its first matching call (its lifetime counts those),
    the next iteration, which reuses the first one's gradient."""
    ref_grads, _ = _seen(None, 3, tmp_path / "ref")
    c = _campaign({"type": "stale_state", "target": {"surface": "gradient", "index": 0}}, at=1)
    grads, _ = _seen(c, 3, tmp_path / "g")
    assert "did not see the iteration before" in caplog.text
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[0])
    assert not torch.equal(grads[2], ref_grads[2])
    assert [g.iteration for g in read_ground_truth(tmp_path / "g")] == [1]


def test_an_optimizer_state_corruption_and_its_lifetime_in_iterations(tmp_path: Path) -> None:
    c = _campaign(
        {
            "type": "tensor_corruption",
            "target": {"surface": "optimizer_state", "index": 0},
            "parameters": {"operation": "set_value", "value": 7.0},
        },
        lifetime={"iterations": 2},
    )
    _, inj = _train(c, 4, tmp_path / "a")
    assert len(read_ground_truth(tmp_path / "a")) == 1  # one injection on record, applied twice
    assert [a.calls for a in inj._active] == [2]
    _, inj = _train(c, 6, tmp_path / "b")
    assert inj._active == []  # its lifetime ended at iteration 5


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        (
            {"type": "collective_desync", "target": {"surface": "weight"}},
            "incidents[0].faults[0].target.surface",
        ),
        (
            {"type": "collective_desync", "target": {"surface": "process"}, "parameters": {"elements": 0}},
            "incidents[0].faults[0].parameters.elements",
        ),
        ({"type": "hang", "target": {"surface": "weight"}}, "incidents[0].faults[0].target.surface"),
        (
            {"type": "config_drift", "target": {"surface": "config"}, "parameters": {"setting": "tf33"}},
            "incidents[0].faults[0].parameters.setting",
        ),
        (
            {
                "type": "process_termination",
                "target": {"surface": "process"},
                "parameters": {"signal": "SIGHUP"},
            },
            "incidents[0].faults[0].parameters.signal",
        ),
        (
            {"type": "delay", "target": {"surface": "compute"}, "parameters": {"delay_ms": -1}},
            "incidents[0].faults[0].parameters.delay_ms",
        ),
        (
            {"type": "tensor_corruption", "target": {"surface": "weight", "module_path": "nope"}},
            "incidents[0].faults[0].target.module_path",
        ),
    ],
)
def test_a_fault_this_version_cannot_inject_is_refused_at_attach(
    tmp_path: Path, fault: dict[str, Any], problem: str
) -> None:
    with pytest.raises(CampaignError) as info:
        _train(_campaign(fault), 1, tmp_path)
    assert info.value.path == problem


def test_a_rank_that_attaches_after_a_peer_injected_the_same_incident_still_injects_its_own(
    tmp_path: Path,
) -> None:
    """An incident with a fault on every rank (a pace): rank 0 reached iteration 1 and recorded its
    fault while rank 1 was still starting. Rank 1 read that record as the incident having fired and
    never injected its own: its steps ran unpaced, and its peers were named stragglers. Records of
    earlier generations, and a rank's own, still count (a restarted generation does not fire a
    `once` incident again)."""
    c = parse_campaign(
        _campaign(
            *(
                {"type": "delay", "target": {"surface": "compute", "rank": r}, "parameters": {"delay_ms": 1}}
                for r in range(2)
            ),
            at=1,
        )
    )
    model = nn.Linear(2, 2)
    first = CampaignInjector(c, 0, tmp_path, model, None, generation=0, world_size=2)
    model(torch.randn(1, 2))  # rank 0's iteration 1: injected and recorded
    late = CampaignInjector(c, 1, tmp_path, nn.Linear(2, 2), None, generation=0, world_size=2)
    late._model(torch.randn(1, 2))
    first.close()
    late.close()
    fired = {(g.rank, g.fault_id, g.generation) for g in read_ground_truth(tmp_path)}
    assert fired == {(0, "f0", 0), (1, "f1", 0)}
    again = CampaignInjector(c, 1, tmp_path, nn.Linear(2, 2), None, generation=1, world_size=2)
    again._model(torch.randn(1, 2))  # the next generation replays iteration 1: `once`, not again
    again.close()
    assert len(read_ground_truth(tmp_path)) == 2


def test_a_fault_on_a_rank_the_job_does_not_have_is_refused_at_attach(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank refuses it alike (none would ever inject it: the campaign would end "not
    injected" with no word why). A later generation (an elastic job that shrank) only logs it."""
    c = parse_campaign(_campaign({"type": "hang", "target": {"surface": "process", "rank": 4}}))
    model = nn.Linear(2, 2)
    for rank in range(4):
        with pytest.raises(CampaignError, match=r"rank 4 is not in this job of 4 ranks") as info:
            CampaignInjector(c, rank, tmp_path, model, None, generation=0, world_size=4)
        assert info.value.path == "incidents[0].faults[0].target.rank"
    CampaignInjector(c, 0, tmp_path, model, None, world_size=5).close()
    CampaignInjector(c, 0, tmp_path, model, None, generation=1, world_size=4).close()
    assert "incidents[0].faults[0].target.rank: rank 4 is not in this job of 4 ranks" in caplog.text


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("fault", "exit_code", "text", "own_reason"),
    [
        (
            {"type": "exception", "target": {"surface": "process", "rank": 1}},
            1,
            "injected exception: campaign 't' occurrence i@3 (f0)",
            "uncaught_exception",
        ),
        (
            {"type": "process_termination", "target": {"surface": "process", "rank": 1}},
            -signal.SIGKILL,
            "",
            None,  # (nothing runs after a SIGKILL: rank 0 names it)
        ),
        (
            {"type": "resource_exhaustion", "target": {"surface": "resource", "rank": 1}},
            1,
            "Too many open files",
            "resource_exhaustion",  # (its report file was opened at the start: it still says so)
        ),
        (
            {
                "type": "resource_exhaustion",
                "target": {"surface": "resource", "rank": 1},
                "parameters": {"resource": "memory"},
            },
            1,
            "MemoryError",
            "resource_exhaustion",
        ),
    ],
)
def test_process_faults_end_the_rank_they_name_after_its_step(
    processes, tmp_path: Path, fault: dict[str, Any], exit_code: int, text: str, own_reason: str | None
) -> None:  # type: ignore[no-untyped-def]
    """The rank names itself too, with why it dies: out of memory included, where no thread can be
    started any more (before, its report was lost: the thread that delivers reports was started
    only then)."""
    procs, _store = _start_pair(
        processes, tmp_path, _campaign(fault), 50, LM_RESILIENCY_FAULT_GROUND_TRUTH=str(tmp_path / "gt")
    )
    assert procs[1].wait(90) == exit_code, (tmp_path / "rank1.log").read_text()[-3000:]
    assert text in (tmp_path / "rank1.log").read_text()
    (g,) = read_ground_truth(tmp_path / "gt")
    assert (g.rank, g.iteration, g.type) == (1, 3, fault["type"])
    # Rank 0 (never named) names rank 1 as the failed process.
    deadline = time.monotonic() + 60
    reports: list[dict[str, Any]] = []
    while not any(r.get("failed_ranks") == [1] for r in reports):
        assert time.monotonic() < deadline, reports
        time.sleep(0.1)  # polling the report file rank 0 appends to
        path = tmp_path / "reports" / "reports-rank0.jsonl"
        reports = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    ev = evaluate([g], reports)
    assert ev["occurrences"][0]["localized"] and ev["occurrences"][0]["kind_match"], ev
    if own_reason is not None:
        own = [json.loads(x) for x in (tmp_path / "reports" / "reports-rank1.jsonl").read_text().splitlines()]
        assert [r["reason"] for r in own if r["kind"] == "process_failure"] == [own_reason], own


@pytest.mark.multiprocess
def test_a_gradient_bit_flip_from_a_campaign_is_localized_by_scout(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = _campaign(
        {
            "type": "tensor_corruption",
            "target": {"surface": "gradient", "rank": 1, "index": 0},
            "parameters": {"magnitude": "medium"},
        },
        at=4,
    )
    procs, _store = _start_pair(processes, tmp_path, c, 8, AWAIT_REPORT_S="30")
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")  # the default: next to the campaign
    assert [(g.rank, g.iteration) for g in truth] == [(1, 4)]
    ev = evaluate(truth, _all_reports(tmp_path))
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


@pytest.mark.multiprocess
def test_a_weight_flip_in_an_unevenly_sharded_fsdp2_parameter_hits_the_ranks_shard(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """FSDP2 over 3 ranks shards a 64-row weight unevenly (22, 22, 20 rows). A campaign's bit flip
    in it is made in rank 1's shard, which SCOUT finds changed at rest; before, the injector
    flattened the whole DTensor, which raised in the training step and killed the rank."""
    c = _campaign(
        {
            "type": "tensor_corruption",
            "target": {"surface": "weight", "rank": 1, "module_path": "0.weight"},
            "parameters": {"magnitude": "large"},
        },
        at=3,
    )
    procs, _store = _start_pair(processes, tmp_path, c, 6, world=3, FSDP="1", AWAIT_REPORT_S="30")
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(3)] == [6] * 3
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")
    assert [(g.rank, g.iteration) for g in truth] == [(1, 3)]
    reports = _all_reports(tmp_path)
    assert {(r["kind"], r["reason"], tuple(r["failed_ranks"])) for r in reports} == {
        ("sdc", "state_changed_at_rest", (1,))
    }, reports


@pytest.mark.multiprocess
def test_a_slow_input_from_a_campaign_is_named_an_input_straggler(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`delay` on the input surface: rank 1's steps 3 to 6 each wait 150 ms before their forward,
    as behind a slow data loader. SCOUT names rank 1 an input straggler. (Before, the delay was
    injected after the optimizer's step, inside the session's own step-end work, which counts as
    no phase: the straggler the campaign made was never named.)"""
    c = _campaign(
        {"type": "delay", "target": {"surface": "input", "rank": 1}, "parameters": {"delay_ms": 150}},
        at=3,
        lifetime={"iterations": 4},
    )
    procs, _store = _start_pair(processes, tmp_path, c, 9, AWAIT_REPORT_S="30")
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")
    assert [(g.rank, g.iteration) for g in truth] == [(1, 3)]
    reports = _all_reports(tmp_path)
    assert {(r["kind"], r.get("straggler_type"), tuple(r["failed_ranks"])) for r in reports} == {
        ("straggler", "input", (1,))
    }, reports
    ev = evaluate(truth, reports)
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


@pytest.mark.multiprocess
def test_a_gradient_reused_from_the_previous_step_by_a_campaign_is_stale_state(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A campaign's stale_state on rank 1's first gradient at iteration 4: SCOUT names rank 1 and
    the kind (a restart from a verified step, not a device to replace)."""
    c = _campaign({"type": "stale_state", "target": {"surface": "gradient", "rank": 1, "index": 0}}, at=4)
    procs, _store = _start_pair(processes, tmp_path, c, 8, AWAIT_REPORT_S="30")
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")
    assert [(g.rank, g.iteration, g.type) for g in truth] == [(1, 4, "stale_state")]
    reports = _all_reports(tmp_path)
    assert {(r["kind"], r["reason"]) for r in reports} == {("stale_state", "grads_reused")}, reports
    ev = evaluate(truth, reports)
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


def test_corrupt_covers_each_operation_and_scope() -> None:
    import random

    for op in ("single_bitflip", "multi_bitflip", "set_value", "scale", "noise", "sign_flip"):
        for scope, n in (("single", 1), ("row", 10), ("10%", 10), ("100%", 100)):
            for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
                t = torch.rand(10, 10, dtype=dtype) + 1.0
                before = t.clone()
                corrupt(t, {"operation": op, "scope": scope, "magnitude": "large"}, random.Random(1))
                changed = int((t != before).sum())
                assert 1 <= changed <= n, (op, scope, dtype, changed)


@pytest.mark.parametrize("kind", ["tensor_corruption", "drop", "duplicate", "reorder"])
def test_a_sparse_gradient_is_damaged_in_the_rows_it_holds(kind: str) -> None:
    import random

    from lm_resiliency.faults.inject import _tamper

    emb = torch.nn.Embedding(50, 4, sparse=True)
    emb(torch.tensor([3, 17, 3, 40])).sum().backward()  # an Embedding(sparse=True)'s gradient
    g = emb.weight.grad.coalesce()
    before = g.to_dense().clone()
    _tamper(kind, g, {"operation": "single_bitflip", "magnitude": "large"}, random.Random(3))
    after = g.to_dense()
    assert g.layout == torch.sparse_coo and not torch.equal(after, before)
    assert set((after != before).any(1).nonzero().flatten().tolist()) <= {3, 17, 40}  # rows it holds


def test_corrupt_damages_a_channels_last_weight_in_place_by_its_logical_rows() -> None:
    import random

    w = (torch.rand(6, 4, 3, 3) + 1.0).to(memory_format=torch.channels_last)  # a conv weight
    before = w.clone()
    corrupt(w, {"operation": "set_value", "scope": "row", "magnitude": "large"}, random.Random(2))
    assert w.is_contiguous(memory_format=torch.channels_last)  # the weight itself, still as it was laid out
    rows = (w != before).flatten(1).any(1)
    assert int(rows.sum()) == 1 and bool((w[rows] != before[rows]).all())  # one whole output channel


@pytest.mark.parametrize("kind", ["checkpoint_corruption", "checkpoint_truncation", "checkpoint_missing"])
def test_a_damaged_newest_copy_is_never_restored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    """The newest in-memory copy damaged after its commit: the restart restores the copy before it,
    bitwise, and reports the damage it found (a deleted copy is simply not there)."""
    from lm_resiliency import enable_resiliency

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 4))
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def train(s: Any, m: nn.Module, o: torch.optim.Optimizer, upto: int) -> list[list[torch.Tensor]]:
        seen = []
        for step in range(s.step_count + 1, upto + 1):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            (m(x) - x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            seen.append([p.detach().clone() for p in m.parameters()])
        return seen

    (tmp_path / "c.json").write_text(
        json.dumps(_campaign({"type": kind, "target": {"surface": "checkpoint"}}))
    )
    monkeypatch.setenv("LM_RESILIENCY_FAULT_CAMPAIGN", str(tmp_path / "c.json"))
    m, o = make()
    with enable_resiliency(m, o, interval=1) as s:
        states = train(s, m, o, 3)
        assert s.gemini.drain(10)
    assert [g.type for g in read_ground_truth(tmp_path / "ground-truth" / "t")] == [kind]
    monkeypatch.setenv("LM_RESILIENCY_GENERATION", "1")
    m, o = make()
    with enable_resiliency(m, o, interval=1) as s:
        got = s.recovered_step
        assert 1 <= got < 3
        assert all(torch.equal(a, b) for a, b in zip(states[got - 1], m.parameters(), strict=True))
        damaged = [r for r in s.fault_reports if r["kind"] == "checkpoint_corruption"]
        if kind != "checkpoint_missing":
            assert damaged and damaged[0]["failed_ranks"] == [0] and damaged[0]["steps"] == [got + 1], (
                s.fault_reports
            )


SCRIPT = """
import torch
from torch import nn
from lm_resiliency import enable_resiliency
torch.manual_seed(0)
m = nn.Linear(4, 4)
o = torch.optim.SGD(m.parameters(), lr=0.1)
s = enable_resiliency(m, o, interval=1)
for _ in range(6):
    m(torch.ones(2, 4)).sum().backward()
    o.step()
s.close()
"""


def test_campaign_run_arms_any_command_and_scores_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lm-resiliency campaign run C -- python script.py`: a script that knows nothing of faults
    raises at iteration 3; its own report names it; the evaluation says so."""
    import sys

    from lm_resiliency.cli.main import main as cli

    (tmp_path / "c.json").write_text(
        json.dumps(_campaign({"type": "exception", "target": {"surface": "process"}}))
    )
    (tmp_path / "script.py").write_text(SCRIPT)
    out = tmp_path / "out"
    run = ["campaign", "run", str(tmp_path / "c.json"), "--output-dir", str(out)]
    code = cli([*run, "--", sys.executable, str(tmp_path / "script.py")])
    assert code == 1  # the script's own exit status
    ev = json.loads((out / "evaluation.json").read_text())
    assert ev["command_exit_code"] == 1 and ev["injected"] == 1 and ev["localized"] == 1, ev
    assert ev["occurrences"][0]["reported_kind"] == "process_failure"
    assert json.loads(capsys.readouterr().out)["campaign"] == "t"
    assert cli(run) == 2
    assert cli([*run, "--", str(tmp_path / "nope")]) == 2


@pytest.mark.parametrize("kind", ["drop", "duplicate", "reorder", "tensor_corruption"])
def test_gradient_and_output_tampering(tmp_path: Path, kind: str) -> None:
    """drop/duplicate/reorder (and corruption) of a gradient before the optimizer, or of a module's
    output in the forward of the iteration named: only that iteration's update differs."""
    ref, _ = _train(None, 4, tmp_path)
    grad = _campaign({"type": kind, "target": {"surface": "gradient", "module_path": "0.weight"}})
    got, _ = _train(grad, 4, tmp_path / "g")
    assert not _differing(got[1], ref[1]) and "0.weight" in _differing(got[2], ref[2])
    out = _campaign({"type": kind, "target": {"surface": "output", "module_path": "0"}})
    got, _ = _train(out, 4, tmp_path / "o")
    assert not _differing(got[1], ref[1]) and _differing(got[2], ref[2])
    assert read_ground_truth(tmp_path / "o")[0].surface == "output"
    with pytest.raises(CampaignError, match="no module named 'nope'"):
        _train(
            _campaign({"type": kind, "target": {"surface": "output", "module_path": "nope"}}),
            1,
            tmp_path / "x",
        )


@pytest.mark.multiprocess
def test_a_rank_whose_messages_are_dropped_is_named_while_it_lives(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """message_drop: rank 1's runtime sends nothing for 20 s from iteration 3 on (its training and
    collectives go on); rank 0 names it for its missing heartbeats while its process still runs."""
    c = _campaign(
        {
            "type": "message_drop",
            "target": {"surface": "process", "rank": 1},
            "parameters": {"duration_s": 20},
        }
    )
    per_rank = ({"AWAIT_REPORT_S": "30"}, {"WAIT_FOR_RANK0": "1"})
    procs, _store = _start_pair(processes, tmp_path, c, 20, per_rank)
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    reports = json.loads((tmp_path / "rank0.json").read_text())["reports"]
    assert [(x["kind"], x["failed_ranks"], x["reason"]) for x in reports][:1] == [
        ("process_failure", [1], "heartbeat_timeout")
    ]
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")
    ev = evaluate(truth, _all_reports(tmp_path))
    assert ev["localized"] == 1 and ev["kind_matched"] == 1, ev


@pytest.mark.multiprocess
@pytest.mark.parametrize(("at", "wait_s"), [(3, "30"), (11, "1")])
def test_a_node_whose_torch_settings_drift_is_named_by_the_gossip(
    processes, tmp_path: Path, at: int, wait_s: str
) -> None:  # type: ignore[no-untyped-def]
    """config_drift: at iteration 3 every rank of rank 1's node (here, rank 1) turns cuDNN's
    autotuning on, as a node started with another environment runs. Its progress gossip and its
    evidence of each step carry its torch settings; both ranks name rank 1 `config_drift`
    (`settings_differ`), saying which setting differs. Also after the job's second-to-last step,
    the ranks waiting 1 s for a report before they close: compared at the same step, the settings
    of the last step tell it. Before, the gossip alone held a drift four heartbeats (2 s) before
    naming it (a flip in progress on every rank looks the same for a heartbeat): never named."""
    c = _campaign({"type": "config_drift", "target": {"surface": "config", "rank": 1}}, at=at)
    per_rank = ({"AWAIT_REPORT_S": wait_s}, {"AWAIT_REPORT_S": wait_s})
    procs, _store = _start_pair(processes, tmp_path, c, 12, per_rank, nodes=True)
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    for r in range(2):
        drifts = [
            x
            for x in json.loads((tmp_path / f"rank{r}.json").read_text())["reports"]
            if x["kind"] != "process_failure"
        ]
        assert [(x["kind"], x["failed_ranks"], x["reason"]) for x in drifts] == [
            ("config_drift", [1], "settings_differ")
        ], drifts
        assert drifts[0]["detail"] == "ranks [1] have cudnn_benchmark=1 (others 0)", drifts
    ev = evaluate(read_ground_truth(tmp_path / "ground-truth" / "t"), _all_reports(tmp_path))
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


@pytest.mark.multiprocess
def test_a_collective_one_rank_issues_alone_is_a_desync_named_by_its_replicas(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """collective_desync: after iteration 3 rank 1 of three broadcasts from itself, where its
    peers go on to the next step's all-reduce. The ranks wait in different collectives; every rank
    names rank 1 `collective_desync` from the collectives' hash chains, and the hang it leaves is not
    reported besides. Before, a campaign naming the type was refused."""
    c = _campaign({"type": "collective_desync", "target": {"surface": "collective", "rank": 1}})
    procs, _store = _start_pair(processes, tmp_path, c, 40, world=3)
    deadline = time.monotonic() + 90
    while True:
        reports = _all_reports(tmp_path)
        if {x["reported_by"] for x in reports if x["kind"] == "collective_desync"} == {0, 1, 2}:
            break
        assert time.monotonic() < deadline, reports
        assert all(p.poll() is None for p in procs), (tmp_path / "rank1.log").read_text()[-3000:]
        time.sleep(0.1)  # polling the report files the workers append to
    assert {(x["kind"], tuple(x["failed_ranks"]), x["reason"], x["confidence"]) for x in reports} == {
        ("collective_desync", (1,), "collective_sequence_minority", 1.0)
    }, reports
    truth = read_ground_truth(tmp_path / "ground-truth" / "t")
    assert [(g.rank, g.iteration, g.type) for g in truth] == [(1, 3, "collective_desync")]
    ev = evaluate(truth, reports)
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


@pytest.mark.multiprocess
def test_a_device_reported_lost_by_telemetry_is_a_hardware_fault_of_its_rank(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """resource_unavailable: at iteration 3 rank 1's telemetry reports its device lost (as NVML
    would); SCOUT names rank 1 and the device, a fatal hardware fault."""
    fault = {
        "type": "resource_unavailable",
        "target": {"surface": "resource", "rank": 1, "resource": "gpu-1234"},
    }
    # Rank 1 reports its own device: rank 0 waits for nothing.
    per_rank = ({"AWAIT_REPORT_S": "0"}, {"AWAIT_REPORT_S": "20"})
    procs, _store = _start_pair(processes, tmp_path, _campaign(fault), 8, per_rank)
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    (report,) = json.loads((tmp_path / "rank1.json").read_text())["reports"]
    assert (report["kind"], report["failed_ranks"], report["device"], report["fatal"]) == (
        "hardware",
        [1],
        "gpu-1234",
        True,
    )
    ev = evaluate(read_ground_truth(tmp_path / "ground-truth" / "t"), _all_reports(tmp_path))
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


@pytest.mark.multiprocess
def test_a_replica_chunk_damaged_in_flight_is_sent_again_and_its_sender_named(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """payload_corruption: 2 ranks on 2 synthetic nodes replicate every capture to each other; at
    iteration 3 a byte of rank 1's next outgoing chunk is flipped after it was sealed. Rank 0's
    checksum rejects it, the chunk is sent again, and rank 0 names rank 1 (the sending endpoint)."""
    fault = {"type": "payload_corruption", "target": {"surface": "checkpoint", "rank": 1}}
    per_rank = ({"AWAIT_REPORT_S": "20"}, {"AWAIT_REPORT_S": "0"})
    procs, _store = _start_pair(
        processes, tmp_path, _campaign(fault), 8, per_rank, nodes=True, CHECKPOINT="1"
    )
    for r, p in enumerate(procs):
        assert p.wait(90) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    (report,) = json.loads((tmp_path / "rank0.json").read_text())["reports"]
    assert (report["kind"], report["failed_ranks"], report["endpoint_rank"]) == ("payload_corruption", [1], 1)
    ev = evaluate(read_ground_truth(tmp_path / "ground-truth" / "t"), _all_reports(tmp_path))
    assert ev["localized"] == 1 and ev["kind_matched"] == 1 and ev["false_positives"] == 0, ev


def test_an_io_error_fails_the_next_durable_write_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """io_error at iteration 1: the next durable write (step 2) fails with ENOSPC, reported as an
    io_error; the memory tiers and the later writes (step 4) carry on. (No probe of the folder
    between copies here: one would be the next write, test_slots_and_state covers it.)"""
    import lm_resiliency.gemini.component as component
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    monkeypatch.setattr(component, "DISK_PROBE_S", 1e9)

    fault = {"type": "io_error", "target": {"surface": "checkpoint"}, "parameters": {"errno": "ENOSPC"}}
    (tmp_path / "c.json").write_text(json.dumps(_campaign(fault, at=1)))
    monkeypatch.setenv("LM_RESILIENCY_FAULT_CAMPAIGN", str(tmp_path / "c.json"))
    m = nn.Linear(4, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    cfg = InMemoryCkptConfig(disk_flush_interval=2, disk_folder=str(tmp_path / "disk"), run_id="io")
    with enable_resiliency(m, o, interval=1, checkpoint=cfg) as s:
        for _ in range(5):
            m(torch.ones(2, 4)).sum().backward()
            o.step()
        assert s.gemini.drain(10)
        errors = [r for r in s.fault_reports if r["kind"] == "io_error"]
        assert len(errors) == 1 and "step 2" in errors[0]["detail"] and "No space left" in errors[0]["detail"]
        assert s.step_count == 5 and s.gemini.newest_recoverable_step("latest") >= 4
    assert (tmp_path / "disk" / "io" / "step-0000000004" / "rank-00000.pt").exists()
    assert not (tmp_path / "disk" / "io" / "step-0000000002").exists()


@pytest.mark.parametrize(
    ("until", "again"), [("recovery", False), ("replacement", True), ("campaign_end", True)]
)
def test_a_fault_that_outlives_its_process_is_on_again_in_the_next_generation(
    tmp_path: Path, until: str, again: bool
) -> None:
    """A weight set to 7 from iteration 2 on: `recovery` ends with the process; `replacement`
    (same node) and `campaign_end` are on again from the next generation's first step, with no
    second record."""
    ref, _ = _train(None, 2, tmp_path)
    fault = {
        "type": "tensor_corruption",
        "target": {"surface": "weight"},
        "parameters": {"operation": "set_value", "value": 7.0},
    }
    c = _campaign(fault, at=2, lifetime={"until": until})
    _train(c, 3, tmp_path / "gt")
    got, _ = _train(c, 1, tmp_path / "gt")  # the next generation (here: from step 0 again)
    assert bool(_differing(got[0], ref[0])) == again
    assert len(read_ground_truth(tmp_path / "gt")) == 1


@pytest.mark.multiprocess
def test_replicas_that_get_no_answer_pause_instead_of_stalling_every_capture(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """2 ranks on 2 synthetic nodes replicate every capture to each other; rank 1's runtime sends
    nothing for 8 s from iteration 3 (message_drop), so rank 0 declares it dead and neither
    replica is acknowledged. The capture that needs a replica's slot gives the replica up after
    waiting CAPTURE_WAIT_S for it, and replicas pause while local captures go on: none skipped.
    Before, each transfer pinned its slot until its deadline (120 s once, then 10 s at least),
    and every capture meanwhile waited 2 s for a slot and was skipped (2-3 a rank here): the job
    crawled, and the ranks' copies fell apart until no step was held by every rank.

    Once rank 0 hears rank 1 again, its replicas go on with the next capture: rank 1 holds rank 0's
    copies of the last steps. Before, the pause ran its course (5 s, then 10 s after the retry
    whose acknowledgement the drop took), past the job's end: rank 1's copy of rank 0 stayed
    hundreds of steps behind, and a node lost then resumed from there."""
    fault = {
        "type": "message_drop",
        "target": {"surface": "process", "rank": 1},
        "parameters": {"duration_s": 8},
    }
    # Long enough that the drop ends well before the job does (at ~75 steps/s here, 600 steps ended
    # as it did, and rank 0 never heard rank 1's inventories again: the newest step every rank
    # holds, as rank 0 knew it, stayed 3).
    procs, _store = _start_pair(processes, tmp_path, _campaign(fault), 1200, nodes=True, CHECKPOINT="1")
    for r, p in enumerate(procs):
        assert p.wait(150) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    for r in range(2):
        gem = json.loads((tmp_path / f"rank{r}.json").read_text())["gemini"]
        assert gem["skipped_busy"] <= 1 and gem["newest"] >= 1190, (r, gem)
    for r in range(2):
        log = (tmp_path / f"rank{r}.log").read_text()
        assert "the next capture needed its slot" in log and "replicas pause for 5 s" in log, log[-3000:]
    held = json.loads((tmp_path / "rank1.json").read_text())["gemini"]["replicas"]
    assert max(held.get("0", [-1])) >= 1150, held


def _restarting(kind: str) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """A control store whose generation 0 the leader is restarting for `kind` (on node n1): its
    rendezvous state, a worker's channel to it, the restart's reason, and a weight flip to hold."""
    from datetime import timedelta

    from lm_resiliency.adapters import torchrun as tr
    from lm_resiliency.core.rendezvous import state as rs
    from lm_resiliency.runtime.control import ControlChannel

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    control = tr._Control(store, "unit-run")
    control.init(dataclasses.replace(rs.RdzvState.new("nonce", 1, 2), generation=0, phase=rs.RUNNING))
    why = {"failure_kind": kind, "culprits": ["n1"]}
    control.update(lambda s: dataclasses.replace(s, phase=rs.RESTARTING, pending=why))
    channel = ControlChannel(f"tcp://127.0.0.1:{store.port}", "unit-run")
    flip = {
        "type": "tensor_corruption",
        "target": {"surface": "weight", "rank": 0, "module_path": "1.weight"},
        "parameters": {"operation": "single_bitflip", "magnitude": "catastrophic"},
    }
    return control, channel, why, flip


def test_a_fault_due_while_the_leader_restarts_the_generation_waits_for_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Generation 0 is being restarted (another fault was found a moment before; its workers are
    about to be stopped) when a weight flip is due: neither injected nor recorded there (before:
    injected into the generation being stopped, never seen: a kill 75 ms after an SDC's verdict
    had no report and no restart of its own), and injected at its iteration in generation 1."""
    from lm_resiliency.core.rendezvous import state as rs

    control, channel, why, flip = _restarting("sdc")
    c = parse_campaign(_campaign(flip, at=2))
    try:
        for generation in (0, 1):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            inj = CampaignInjector(
                c, 0, tmp_path, model, opt, node="n0", generation=generation, control=channel
            )
            _drive(inj, model, opt, 3)
            inj.close()
            if generation == 0:
                assert (
                    read_ground_truth(tmp_path) == [] and float(model[1].weight.detach().abs().max()) < 1e30
                )
                assert "i@2 (tensor_corruption) not injected at iteration 2" in caplog.text
                control.update(
                    lambda s: dataclasses.replace(
                        s, generation=1, phase=rs.RUNNING, history=({**why, "generation": 1},)
                    )
                )
        (g,) = read_ground_truth(tmp_path)
        assert (g.iteration, g.generation) == (2, 1) and float(model[1].weight.detach().abs().max()) > 1e30
    finally:
        channel.close()


def test_a_fault_held_back_from_a_restarted_generation_comes_at_once_where_the_next_resumes_past_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, but the restart resumes past the held fault's iteration (the job trained on to a
    newer certified step before its workers stopped: a hardware fault found at 18, the job at 22,
    the held fault due at 21): its iteration never comes again. Before, it was never injected and
    the campaign failed; now it is injected at the next generation's first iteration, its
    occurrence id kept."""
    from lm_resiliency.core.rendezvous import state as rs

    control, channel, why, flip = _restarting("hardware")
    c = parse_campaign(_campaign(flip, at=2, lifetime={"iterations": 1}))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        inj = CampaignInjector(c, 0, tmp_path, model, opt, node="n0", generation=0, control=channel)
        _drive(inj, model, opt, 3)
        inj.close()
        assert read_ground_truth(tmp_path) == [] and float(model[1].weight.detach().abs().max()) < 1e30
        control.update(
            lambda s: dataclasses.replace(
                s, generation=1, phase=rs.RUNNING, history=({**why, "generation": 1},)
            )
        )
        inj = CampaignInjector(c, 0, tmp_path, model, opt, node="n0", generation=1, step=3, control=channel)
        s = _Session()
        s.step_count = 3
        sizes = []
        for _ in range(2):  # iterations 4 and 5
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            s.step_count += 1
            inj.on_step(s, None)
            sizes.append(float(model[1].weight.detach().abs().max()))
        inj.close()
        (g,) = read_ground_truth(tmp_path)
        assert (g.occurrence_id, g.iteration, g.generation) == ("i@2", 2, 1)
        assert sizes[0] > 1e30, sizes  # at iteration 4, the first of generation 1
        # A third generation resumed past it again has it on record: not again.
        inj = CampaignInjector(c, 0, tmp_path, model, opt, node="n0", generation=2, step=5, control=channel)
        assert inj._late == []
        inj.close()
    finally:
        channel.close()
