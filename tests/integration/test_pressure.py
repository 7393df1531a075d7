"""`python -m examples.torchrun.resiliency_cycle.pressure orchestrate` (INTERFACE.md §5) on CPU nodes:
a campaign against a real torchrun job, judged by the job's own detection and recovery."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examples.torchrun.resiliency_cycle.pressure import main as pressure
from tests.conftest import FRESH, Zygote

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _campaign(incidents: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    return {"schema_version": 1, "name": "cycle", "seed": 1, "metadata": meta, "incidents": incidents}


CRASH = {
    "incident_id": "01-exception",
    "trigger": {"at": [4]},
    "faults": [{"fault_id": "raise", "type": "exception", "target": {"surface": "process", "rank": 1}}],
}
SDC = {
    "incident_id": "02-sdc",
    "trigger": {"at": [10]},
    "faults": [
        {
            "fault_id": "flip",
            "type": "tensor_corruption",
            "target": {"surface": "gradient", "rank": 0, "module_path": "head.weight"},
            "parameters": {"operation": "single_bitflip", "magnitude": "large"},
        }
    ],
}


SLOW = {
    "incident_id": "03-slow",
    "trigger": {"at": [5]},
    "lifetime": {"iterations": 4},
    "faults": [
        {
            "fault_id": "slow",
            "type": "delay",
            "target": {"surface": "compute", "rank": 1},
            "parameters": {"delay_ms": 300},
        }
    ],
}


def _pace(ranks: int, delay_ms: int, iterations: int) -> dict[str, Any]:
    """An incident that makes every rank's step take `delay_ms` longer from iteration 1 for
    `iterations` iterations, as a real model's steps would take (no straggler: all alike)."""
    return {
        "incident_id": "00-pace",
        "trigger": {"at": [1]},
        "lifetime": {"iterations": iterations},
        "faults": [
            {
                "fault_id": f"pace{r}",
                "type": "delay",
                "target": {"surface": "compute", "rank": r},
                "parameters": {"delay_ms": delay_ms},
            }
            for r in range(ranks)
        ],
    }


def _cut_off(incident: str, kind: str, rank: int, at: int) -> dict[str, Any]:
    """An incident that cuts `rank` off (`kind`: network_partition or message_drop) at iteration
    `at` for 60 s, while its training goes on."""
    return {
        "incident_id": incident,
        "trigger": {"at": [at]},
        "faults": [
            {
                "fault_id": "cut",
                "type": kind,
                "target": {"surface": "process", "rank": rank},
                "parameters": {"duration_s": 60},
            }
        ],
    }


def _orchestrate(
    processes, tmp_path: Path, campaign: dict[str, Any], framework: str = "pytorch", nodes: int = 3
) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """`pressure orchestrate` on `nodes` CPU nodes with `campaign` (named "cycle"): its summary's
    one campaign, with the tool's exit code and output folder added."""
    camps = tmp_path / "campaigns"
    camps.mkdir()
    (camps / "c.json").write_text(json.dumps(campaign))
    out = tmp_path / "out"
    args = ["-m", "examples.torchrun.resiliency_cycle.pressure", "orchestrate", "--framework", framework]
    args += [
        "--fault-campaign-dir",
        str(camps),
        "--cpu-nodes",
        str(nodes),
        "--output-dir",
        str(out),
        "--timeout-s",
        "200",
    ]
    # Its nodes' agents are forks of the session's zygote too, through the stand-in its workers
    # run as (each would import torch afresh: five agents a campaign, a baseline's two among them).
    agents = {} if FRESH else {"LM_RESILIENCY_EXAMPLES_PYTHON": Zygote.get().extra["PYTHON_EXEC"]}
    proc = processes.start(args, agents, tmp_path / "pressure.log")
    code = proc.wait(timeout=280)
    log = (tmp_path / "pressure.log").read_text()
    assert (out / "summary.json").exists(), log[-4000:]
    (c,) = json.loads((out / "summary.json").read_text())["campaigns"]
    c["exit_code"], c["out"], c["log"] = code, out, log[-4000:]
    return c  # type: ignore[no-any-return]


@pytest.mark.multiprocess
def test_a_campaign_restarts_in_place_then_swaps_a_standby_and_ends_bitwise(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A worker raises at iteration 4 (its node restarts in place); then it computes 300 ms slower
    for 4 steps (named a compute straggler, restarted in place: FAILURES.md's action for a `delay`;
    before, it was only reported); then a gradient bit flip at 10 (the culprit's node is quarantined
    and the standby takes its slot). Each is found by the job itself, each generation restores the
    step its context selected, and the final model equals the uninterrupted run's bit for bit."""
    c = _orchestrate(processes, tmp_path, _campaign([CRASH, SDC, SLOW], total_steps=14))
    assert c["exit_code"] == 0, c["log"]
    assert c["passed"] and c["final_state_bitwise_equal_to_baseline"]
    gens = c["generations"]
    assert [g["failure_kind"] for g in gens] == ["none", "process_failure", "straggler", "sdc"], gens
    assert [len(g["admitted"]) for g in gens[1:]] == [0, 0, 1]  # in place, in place, then a swap
    assert [i["action"] for i in c["incidents"]] == [i["expected_action"] for i in c["incidents"]]
    assert c["evaluation"]["actions_as_expected"] == 3
    assert all(g["restored_as_selected"] for g in gens)
    assert [(i["occurrence"], i["completed"], i["localized"]) for i in c["incidents"]] == [
        ("01-exception@4", True, True),
        ("03-slow@5", True, True),
        ("02-sdc@10", True, True),
    ]
    assert [i["reported_kind"] for i in c["incidents"]] == ["process_failure", "straggler", "sdc"]
    assert c["evaluation"]["false_positives"] == 0 and c["evaluation"]["recall"] == 1.0


@pytest.mark.multiprocess
def test_a_dropped_gradient_restarts_in_place_and_a_dropped_output_is_found_by_audits(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """FAILURES.md's `drop`: rank 0's gradient of a weight zeroed at 3 is named by its zeros
    (`grads_dropped`) and restarts in place, no standby taken (before: a plain `sdc`, its node
    replaced). Rank 1's `linear1` output zeroed at 12 is averaged into both replicas' gradients by
    the all-reduce, so the fingerprints agree: pressure audits every step when a campaign targets
    outputs, and the audit names rank 1 (before: never found, and the run ended off the baseline).
    No verdict besides: audits pause while the replicas' parameters are apart (before, every step
    audited until the first restart was named an inconclusive SDC of both ranks). The first
    generation's steps take 300 ms, as a real model's would, so that its restart comes before
    iteration 12 (else the output's fault fell in the generation it rolled back)."""
    pace = _pace(ranks=2, delay_ms=300, iterations=10)
    drops = [
        pace,
        {
            "incident_id": "01-drop-grad",
            "trigger": {"at": [3]},
            "faults": [
                {
                    "fault_id": "g",
                    "type": "drop",
                    "target": {
                        "surface": "gradient",
                        "rank": 0,
                        "module_path": "blocks.layers.0.linear1.weight",
                    },
                }
            ],
        },
        {
            "incident_id": "02-drop-output",
            "trigger": {"at": [12]},
            "faults": [
                {
                    "fault_id": "o",
                    "type": "drop",
                    "target": {"surface": "output", "rank": 1, "module_path": "blocks.layers.0.linear1"},
                }
            ],
        },
    ]
    c = _orchestrate(processes, tmp_path, _campaign(drops, total_steps=16))
    assert c["exit_code"] == 0, c["log"]
    assert c["passed"] and c["final_state_bitwise_equal_to_baseline"], c["log"]
    gens = c["generations"]
    assert [(g["failure_kind"], g["reason_code"]) for g in gens[:2]] == [
        ("none", "startup"),
        ("sdc", "grads_dropped"),
    ], gens
    assert gens[1]["admitted"] == [] and gens[1]["recovery_mode"] == "recovery_verified", gens
    assert len(gens) == 3 and gens[2]["failure_kind"] == "sdc", gens
    grad, output = (i for i in c["incidents"] if not i["occurrence"].startswith("00-pace"))
    assert grad["localized"] and grad["action"] == grad["expected_action"] == "restart", grad
    assert output["localized"] and output["kind_match"], output
    assert c["evaluation"]["false_positives"] == 0, c["evaluation"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("framework", ["pytorch", "megatron"])
def test_the_models_own_output_reordered_in_the_last_step_is_found_by_its_audit_and_recovered(
    processes, tmp_path: Path, framework: str
) -> None:  # type: ignore[no-untyped-def]
    """FAILURES.md's `reorder` on the output of the model itself (no `module_path`: the DDP's own
    output, changed after the model's layers ran; with Megatron-style chunks, the first chunk's),
    in the 14th and last step. The all-reduce averages it into both replicas' gradients, so only
    the audit sees it, and the audit took the output inside DDP, before the change: its replay
    matched, and so did the gradients, seeded with the changed output's. Chunks were audited as
    one module, which cannot be called: no audit held. Before, the run ended off the baseline,
    with no incident in the summary (the last step's were left out of it)."""
    reorder = {
        "incident_id": "01-reorder-output",
        "trigger": {"at": [14]},
        "faults": [{"fault_id": "o", "type": "reorder", "target": {"surface": "output", "rank": 1}}],
    }
    c = _orchestrate(processes, tmp_path, _campaign([reorder], total_steps=14), framework=framework)
    assert c["exit_code"] == 0, c["log"]
    assert c["passed"] and c["final_state_bitwise_equal_to_baseline"], c["log"]
    gens = c["generations"]
    assert [(g["failure_kind"], g["reason_code"]) for g in gens] == [
        ("none", "startup"),
        ("sdc", "forward_replay_mismatch"),
    ], gens
    (found,) = c["incidents"]
    assert found["occurrence"] == "01-reorder-output@14" and found["localized"], found


@pytest.mark.multiprocess
def test_the_megatron_loop_survives_a_campaign_bitwise(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--framework megatron`: the model as two DDP chunks passed as a list. An exception restarts
    in place; a bit flip in the second chunk's gradient (`1.module.head.weight`, the chunks'
    parameter names) replaces the node; the end is bitwise the uninterrupted run's."""
    sdc = {
        **SDC,
        "faults": [
            {
                **SDC["faults"][0],
                "target": {**SDC["faults"][0]["target"], "module_path": "1.module.head.weight"},
            }
        ],
    }  # type: ignore[dict-item]
    c = _orchestrate(processes, tmp_path, _campaign([CRASH, sdc], total_steps=14), framework="megatron")
    assert c["exit_code"] == 0 and c["passed"] and c["final_state_bitwise_equal_to_baseline"]
    assert [g["failure_kind"] for g in c["generations"]] == ["none", "process_failure", "sdc"]
    assert [(i["occurrence"], i["localized"], i["reported_kind"]) for i in c["incidents"]] == [
        ("01-exception@4", True, "process_failure"),
        ("02-sdc@10", True, "sdc"),
    ]
    # Rank 0, on the admitted standby, restored its chunks from a peer's replica.
    swapped = json.loads((c["out"] / "campaign-cycle" / "validation" / "generation-2.json").read_text())
    assert swapped["recovery_decision"]["reason"].startswith("peer:"), swapped


@pytest.mark.multiprocess
def test_the_deepspeed_loop_survives_a_campaign_bitwise(processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--framework deepspeed`: the model as a DeepSpeed engine (ZeRO stage 0, two micro-batches a
    step, DeepSpeed's scheduler). An exception restarts in place; a bit flip in rank 0's reduced
    gradient makes the two replicas disagree, and the replay of the reduction (each rank's gradients
    as the engine sent them to its own all-reduce) names rank 0, whose node is replaced; the end is
    bitwise the uninterrupted run's. (Before, the engine's contributions were not recorded: the
    replay was inconclusive, both ranks were named and the job restarted in place.)"""
    pytest.importorskip("deepspeed")
    c = _orchestrate(processes, tmp_path, _campaign([CRASH, SDC], total_steps=14), framework="deepspeed")
    assert c["exit_code"] == 0 and c["passed"] and c["final_state_bitwise_equal_to_baseline"], c["log"]
    gens = c["generations"]
    assert [(g["failure_kind"], g["reason_code"]) for g in gens] == [
        ("none", "startup"),
        ("process_failure", "uncaught_exception"),
        ("sdc", "grads_replay_mismatch"),
    ], gens
    assert [len(g["admitted"]) for g in gens[1:]] == [0, 1]
    assert [(i["occurrence"], i["localized"], i["action"]) for i in c["incidents"]] == [
        ("01-exception@4", True, "restart"),
        ("02-sdc@10", True, "replace"),
    ]
    assert all(g["restored_as_selected"] for g in gens)


@pytest.mark.multiprocess
@pytest.mark.parametrize("cut", ["network_partition", "message_drop"])
def test_a_node_cut_off_while_it_trains_is_replaced_then_a_lost_rank_resumes_from_a_common_step(
    processes, tmp_path: Path, cut: str
) -> None:  # type: ignore[no-untyped-def]
    """Rank 0's node (its only rank) is cut off at iteration 3 while its training goes on. Before,
    it was reported and never acted on, and its peers certified the later steps without it; with
    rank 0's newest copy damaged and its process killed at iteration 36, no step was held by every
    rank and the job started again from step 0. Now its peers, training on with it, name it
    `network_partition`: a node cut off (its line to the control store too) is replaced, the
    standby restoring rank 0 from a peer's replica (or from the shared durable folder, where rank
    0's flush at the SIGTERM is newer); a node whose messages our transport dropped (its beats
    still reach the control store: FAILURES.md's `message_drop`) restarts in place (before, it was
    replaced too). The later loss restarts in place from a step every rank kept.
    (The cut-off is named after 10 s of silence and 10 steps. Every rank's step takes 600 ms until
    then, as a real model's would: it is named around step 20, and the loss at 36 comes in the
    generation after. Before, the job crawled while its replicas to the silent rank hung, so the
    cut-off came first; once they no longer held it up, the loss came first, and one restart
    covered both.)"""
    pace = _pace(ranks=3, delay_ms=600, iterations=39)
    mute = _cut_off("01-silent", cut, rank=0, at=3)
    lost = {
        "incident_id": "02-damaged-then-killed",
        "trigger": {"at": [36]},
        "faults": [
            {
                "fault_id": "trunc",
                "type": "checkpoint_truncation",
                "target": {"surface": "checkpoint", "rank": 0},
            },
            {"fault_id": "kill", "type": "process_termination", "target": {"surface": "process", "rank": 0}},
        ],
    }
    campaign = _campaign([pace, mute, lost], total_steps=40, standby_nodes=1)
    c = _orchestrate(processes, tmp_path, campaign, nodes=4)
    assert c["finished"] and c["final_state_bitwise_equal_to_baseline"] and c["passed"], c["log"]
    gens = c["generations"]
    assert [g["failure_kind"] for g in gens] == ["none", "network_partition", "process_failure"], gens
    # Rank 0's copy on the standby: a peer's replica, or (every node of this host writes to one
    # durable folder: shared storage) the capture rank 0 flushed at the SIGTERM, newer than the
    # replicas it could not send while its messages were dropped.
    if cut == "network_partition":
        assert gens[1]["admitted"] and gens[1]["restored_from"].startswith(("peer:", "disk:")), gens[1]
    else:
        assert gens[1]["admitted"] == [] and gens[1]["reason_code"] == "rank_unreachable", gens[1]
    # (The silence is first reported as a process failure, at the heartbeat timeout.)
    faults = [i for i in c["incidents"] if not i["occurrence"].startswith("00-pace")]
    assert [(i["localized"], i["kind_match"], i["action"]) for i in faults] == [
        (True, True, "replace" if cut == "network_partition" else "restart"),
        (True, True, "restart"),
    ], faults


@pytest.mark.multiprocess
def test_a_gradient_flipped_on_a_rank_cut_off_near_the_end_is_found_in_the_final_states(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Rank 2's node is cut off at iteration 10 and its gradient flips at 11; the job ends at 26,
    before the silence is named (its hold). Its peers judged the steps after 10 without its
    evidence, so nothing compared the flip: before, the run ended with exit code 0 and rank 2's
    weights corrupted (campaign fuzz c21_32). Now the ranks, whose last step went unjudged, compare
    their final states through the control store: rank 2's is the minority, named SDC, its node
    replaced, and the run resumes from the step certified before the cut and ends bitwise."""
    cut = _cut_off("01-cut", "network_partition", rank=2, at=10)
    flip = {**SDC, "trigger": {"at": [11]}}
    flip["faults"] = [{**SDC["faults"][0], "target": {**SDC["faults"][0]["target"], "rank": 2}}]
    c = _orchestrate(processes, tmp_path, _campaign([cut, flip], total_steps=26, standby_nodes=1), nodes=4)
    assert c["finished"] and c["final_state_bitwise_equal_to_baseline"] and c["passed"], c["log"]
    gens = c["generations"]
    assert [(g["failure_kind"], g["reason_code"]) for g in gens[1:]] == [
        ("sdc", "final_state_fingerprint_minority")
    ], gens
    assert gens[1]["admitted"] and gens[1]["resumed_at_step"] <= 10, gens[1]
    flipped = [i for i in c["incidents"] if i["occurrence"].startswith("02-sdc")]
    assert [(i["localized"], i["kind_match"], i["action"]) for i in flipped] == [(True, True, "replace")], (
        flipped
    )


@pytest.mark.multiprocess
def test_a_rank_that_issues_a_collective_alone_is_replaced_and_the_job_ends_bitwise(
    processes, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """After iteration 4 rank 1 of three broadcasts where its peers go on to the next step's
    all-reduce: the ranks wait in different collectives. Its replicas name it `collective_desync`
    from their collectives' hash chains, the standby takes its node's slot, and the job resumes from
    a verified step and ends bitwise the uninterrupted run's. Before, the type was refused, and a
    desync named by SCOUT was not acted on: the job waited for the process group's timeout."""
    desync = {
        "incident_id": "01-desync",
        "trigger": {"at": [4]},
        "faults": [
            {"fault_id": "bcast", "type": "collective_desync", "target": {"surface": "collective", "rank": 1}}
        ],
    }
    c = _orchestrate(processes, tmp_path, _campaign([desync], total_steps=10, standby_nodes=1), nodes=4)
    assert c["finished"] and c["final_state_bitwise_equal_to_baseline"] and c["passed"], c["log"]
    gens = c["generations"]
    assert [g["failure_kind"] for g in gens] == ["none", "collective_desync"], gens
    assert gens[1]["admitted"] and gens[1]["restored_as_selected"] and gens[1]["resumed_at_step"] <= 4, gens[
        1
    ]
    assert [(i["localized"], i["kind_match"], i["action"]) for i in c["incidents"]] == [
        (True, True, "replace")
    ], c["incidents"]


@pytest.mark.parametrize(
    ("campaign", "extra", "message"),
    [
        ({"schema_version": 1, "name": "x"}, [], "incidents: missing"),
        (_campaign([CRASH], active_nodes=5), [], "5 active + 1 standby nodes, but only 3"),
        (
            _campaign(
                [{**CRASH, "faults": [{**CRASH["faults"][0], "target": {"surface": "process", "rank": 7}}]}]
            ),
            [],
            "targets rank 7",
        ),  # type: ignore[dict-item]
        (
            _campaign(
                [
                    {
                        **CRASH,
                        "faults": [
                            {"fault_id": "p", "type": "collective_desync", "target": {"surface": "weight"}}
                        ],
                    }
                ]
            ),
            [],
            "collective_desync is injected on ['collective', 'process'], not 'weight'",
        ),
        (_campaign([CRASH], zero_stage=1), [], "metadata.zero_stage and metadata.bf16 set the DeepSpeed"),
        (
            _campaign([CRASH], zero_stage=3),
            ["--framework", "deepspeed"],
            "zero_stage must be 0, 1 or 2, got 3",
        ),
        (
            _campaign([CRASH], bf16=True),
            ["--framework", "deepspeed"],
            "bf16 needs metadata.zero_stage 1 or 2",
        ),
        (_campaign([CRASH], bf16="yes"), ["--framework", "deepspeed"], "bf16 must be true or false"),
        (
            _campaign([CRASH]),
            ["--framework", "torchtitan"],
            "not shipped by this version (shipped: pytorch, megatron, deepspeed)",
        ),
    ],
)
def test_a_campaign_or_option_that_does_not_fit_is_refused_before_any_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    campaign: dict[str, Any],
    extra: list[str],
    message: str,
) -> None:
    (tmp_path / "c.json").write_text(json.dumps(campaign))
    argv = [
        "orchestrate",
        "--fault-campaign-dir",
        str(tmp_path),
        "--cpu-nodes",
        "3",
        "--output-dir",
        str(tmp_path / "o"),
    ]
    assert pressure(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_occurrence_a_recovery_undid_before_it_could_be_found_is_told_apart_from_a_miss() -> None:
    """A campaign's incident at iteration 26 injected in generation 2, which a recovery from an
    earlier incident (found at 20) then rolled back to step 19: with `retrigger: once` it is not
    injected again and nothing can find it. The summary names the generation that undid it; one
    a later generation never rolled back past stays a miss."""
    from examples.torchrun.resiliency_cycle.pressure import _rolled_back, _undone
    from lm_resiliency.faults.scoring import GroundTruth

    def truth(incident: str, iteration: int, generation: int) -> GroundTruth:
        return GroundTruth(
            occurrence_id=f"{incident}@{iteration}",
            incident_id=incident,
            fault_id="f",
            type="stale_state",
            iteration=iteration,
            attempt=0,
            rank=1,
            injected_at=0.0,
            surface="weight",
            node="n1",
            generation=generation,
        )

    gens = [
        {"generation": 0, "resumed_at_step": 0},
        {"generation": 1, "resumed_at_step": 5},
        {"generation": 2, "resumed_at_step": 13},
        {"generation": 3, "resumed_at_step": 19},
    ]
    got = [truth("late", 26, 2), truth("kept", 30, 3), truth("early", 6, 0)]
    assert _rolled_back(got, "late", 26, gens) == 3
    assert _rolled_back(got, "kept", 30, gens) is None
    assert _rolled_back(got, "early", 6, gens) == 1
    assert _rolled_back(got, "never", 8, gens) is None
    # One its own verdict found (with no culprit named: replicas split in halves) was not undone
    # by an earlier incident's recovery: the generation that rolled it back was its own.
    found = [{"detected": True, "localized": False}]
    assert _undone(found, got, "early", 6, gens) is None
    assert _undone([{"detected": False, "localized": False}], got, "early", 6, gens) == 1
    assert _undone([], got, "early", 6, gens) == 1


def test_the_policy_turns_on_what_a_campaigns_faults_need_to_be_seen(tmp_path: Path) -> None:
    """A fault on an output needs audits (the all-reduce averages it into every replica); a byte
    flipped in a held copy needs the scrub's checksums. Neither costs a campaign without them."""
    from examples.torchrun.resiliency_cycle.pressure import _policy
    from lm_resiliency.config import load_policy
    from lm_resiliency.faults.campaign import parse_campaign

    def policy(*faults: dict[str, Any]) -> Any:
        incidents = [
            {"incident_id": f"i{n}", "trigger": {"at": [3]}, "faults": [f]} for n, f in enumerate(faults)
        ]
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        return load_policy(_policy(out, tmp_path / "reports", parse_campaign(_campaign(incidents))))

    plain = policy(SDC["faults"][0])
    assert plain.replay.audit_interval == 0 and not plain.checkpoint.verify_integrity
    assert plain.replay.report_dir == str(tmp_path / "reports")
    both = policy(
        {"fault_id": "o", "type": "drop", "target": {"surface": "output", "rank": 1}},
        {"fault_id": "c", "type": "checkpoint_corruption", "target": {"surface": "checkpoint", "rank": 0}},
    )
    assert both.replay.audit_interval == 1 and both.checkpoint.verify_integrity
