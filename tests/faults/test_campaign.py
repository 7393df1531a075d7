"""Campaign parsing (strict, every error names its JSON path), the replayable schedule, and scoring."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lm_resiliency.faults.campaign import (
    CampaignError,
    Occurrence,
    Schedule,
    draw,
    load_campaign,
    load_campaigns,
    parse_campaign,
)
from lm_resiliency.faults.scoring import GroundTruth, evaluate, evaluate_clean, verdicts

pytestmark = pytest.mark.timeout(60)

EXAMPLE: dict[str, Any] = {
    "schema_version": 1,
    "name": "pressure-4",
    "seed": 29,
    "clock": {"type": "training_iteration", "origin": "training_run"},
    "metadata": {"profile": "torchrun_pressure", "active_nodes": 4, "standby_nodes": 4, "total_steps": 42},
    "incidents": [
        {
            "incident_id": "01-hang",
            "trigger": {"at": [1], "probability": 1.0},
            "lifetime": {"matching_calls": 1},
            "retrigger": "once",
            "faults": [
                {
                    "fault_id": "f1",
                    "type": "hang",
                    "target": {
                        "surface": "process",
                        "rank": 0,
                        "model_part": 0,
                        "component": "trainer",
                        "index": 0,
                        "module_path": "layer.weight",
                        "operation": "step",
                        "resource": "gpu0",
                        "path": "/tmp/x",
                        "metadata": {"recovery_action": "restart"},
                    },
                    "parameters": {},
                }
            ],
        },
        {
            "incident_id": "02-sdc",
            "trigger": {"range": {"start": 5, "end": 20, "every": 5}, "probability": 0.5},
            "lifetime": {"iterations": 2},
            "retrigger": "max_occurrences",
            "max_occurrences": 3,
            "faults": [
                {
                    "fault_id": "f2",
                    "type": "tensor_corruption",
                    "target": {"surface": "gradient", "rank": 1},
                    "parameters": {"operation": "single_bitflip", "scope": "single", "magnitude": "large"},
                }
            ],
        },
    ],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """EXAMPLE with one value set (or deleted when value is ...) at a dotted path."""
    data = copy.deepcopy(EXAMPLE)
    keys = path.split(".")
    node: Any = data
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is ...:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def test_the_documented_example_parses() -> None:
    c = parse_campaign(EXAMPLE)
    assert c.name == "pressure-4" and c.seed == 29 and len(c.incidents) == 2
    hang, sdc = c.incidents
    assert hang.trigger.at == (1,) and hang.faults[0].target.metadata == {"recovery_action": "restart"}
    assert sdc.trigger.matches(5) and sdc.trigger.matches(20) and not sdc.trigger.matches(25)
    assert not sdc.trigger.matches(6) and sdc.max_occurrences == 3
    assert sdc.faults_for(1) and not sdc.faults_for(0)
    assert c.digest() == parse_campaign(copy.deepcopy(EXAMPLE)).digest()


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("schema_version", 2, "schema_version"),
        ("schema_version", 1.0, "schema_version"),
        ("schema_version", ..., "schema_version"),
        ("name", "", "name"),
        ("seed", True, "seed"),
        ("seed", 29.0, "seed"),
        ("colour", "red", "colour"),
        ("clock.type", "wall_clock", "clock.type"),
        ("clock.tick", 1, "clock.tick"),
        ("incidents", [], "incidents"),
        ("incidents.0.incident_id", "a@b", "incidents[0].incident_id"),
        ("incidents.1.incident_id", "01-hang", "incidents[1].incident_id"),
        ("incidents.0.trigger.at", [1.0], "incidents[0].trigger.at[0]"),
        ("incidents.0.trigger.at", [-1], "incidents[0].trigger.at[0]"),
        ("incidents.0.trigger.probability", 1.5, "incidents[0].trigger.probability"),
        ("incidents.0.trigger.when", 3, "incidents[0].trigger.when"),
        ("incidents.1.trigger.range.every", 0, "incidents[1].trigger.range.every"),
        ("incidents.1.trigger.range.end", 1, "incidents[1].trigger.range.end"),
        ("incidents.1.trigger.range.stop", 1, "incidents[1].trigger.range.stop"),
        ("incidents.0.lifetime", {"matching_calls": 1, "iterations": 2}, "incidents[0].lifetime"),
        ("incidents.0.lifetime", {"until": "forever"}, "incidents[0].lifetime.until"),
        ("incidents.0.retrigger", "twice", "incidents[0].retrigger"),
        ("incidents.1.max_occurrences", ..., "incidents[1].max_occurrences"),
        ("incidents.0.faults", [], "incidents[0].faults"),
        ("incidents.0.faults.0.type", "meteor_strike", "incidents[0].faults[0].type"),
        ("incidents.0.faults.0.target.surface", "gpu", "incidents[0].faults[0].target.surface"),
        ("incidents.0.faults.0.target.rank", "0", "incidents[0].faults[0].target.rank"),
        ("incidents.0.faults.0.target.node", "n1", "incidents[0].faults[0].target.node"),
        ("incidents.0.faults.0.extra", 1, "incidents[0].faults[0].extra"),
        ("incidents.1.faults.0.fault_id", "f1", "incidents[1].faults[0].fault_id"),
        ("incidents.1.faults.0.parameters.scope", "half", "incidents[1].faults[0].parameters.scope"),
        ("incidents.1.faults.0.parameters.operation", "melt", "incidents[1].faults[0].parameters.operation"),
    ],
)
def test_a_malformed_campaign_names_what_is_wrong(path: str, value: Any, named: str) -> None:
    with pytest.raises(CampaignError) as info:
        parse_campaign(_with(path, value), "c.json")
    assert info.value.path == named, str(info.value)
    assert str(info.value).startswith(f"c.json: {named}:")


def test_metadata_and_parameters_take_any_keys() -> None:
    data = _with("metadata", {"anything": [1, {"x": None}]})
    data["incidents"][0]["faults"][0]["parameters"] = {"whatever": 1.5}
    parse_campaign(data)


def test_files_and_folders(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(EXAMPLE))
    assert load_campaign(tmp_path / "a.json").name == "pressure-4"
    with pytest.raises(CampaignError, match="both name campaign"):
        (tmp_path / "b.json").write_text(json.dumps(EXAMPLE))
        load_campaigns(tmp_path)
    (tmp_path / "b.json").write_text('{"schema_version": 1, "name": NaN}')
    with pytest.raises(CampaignError, match="not valid JSON"):
        load_campaign(tmp_path / "b.json")
    (tmp_path / "b.json").write_bytes(b"\xff\xfe")
    with pytest.raises(CampaignError, match="not UTF-8"):
        load_campaign(tmp_path / "b.json")
    with pytest.raises(CampaignError, match="cannot read"):
        load_campaign(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CampaignError, match=r"no \*\.json"):
        load_campaigns(tmp_path / "empty")


def _campaign(retrigger: str = "once", probability: float = 1.0, **extra: Any) -> Any:
    inc = {
        "incident_id": "x",
        "trigger": {"range": {"start": 2, "end": 8, "every": 3}, "probability": probability},
        "retrigger": retrigger,
        "faults": [{"fault_id": "f", "type": "exception", "target": {"surface": "process", "rank": 1}}],
        **extra,
    }
    return parse_campaign({"schema_version": 1, "name": "t", "seed": 7, "incidents": [inc]})


def test_once_fires_each_trigger_iteration_once_even_when_recovery_replays_it() -> None:
    s = Schedule(_campaign())
    fired = [o.occurrence_id for i in (1, 2, 3, 4, 5) for o in s.due(i)]
    assert fired == ["x@2", "x@5"]
    # a new generation resumes at 4 and replays 5: its record of x@5 keeps it from firing again
    s2 = Schedule(_campaign(), [Occurrence.parse(i) for i in fired])
    assert [o.occurrence_id for i in (4, 5, 6, 7, 8, 9) for o in s2.due(i)] == ["x@8"]


def test_every_attempt_fires_again_on_a_replay_with_an_attempt_number() -> None:
    s = Schedule(_campaign("every_attempt"))
    assert [o.occurrence_id for o in s.due(2)] == ["x@2"]
    assert [o.occurrence_id for o in s.due(2)] == ["x@2#1"]
    s2 = Schedule(_campaign("every_attempt"), s.fired("x"))
    assert [o.occurrence_id for o in s2.due(2)] == ["x@2#2"]
    assert Occurrence.parse("x@2#2") == Occurrence("x", 2, 2)
    with pytest.raises(ValueError):
        Occurrence.parse("x2")


def test_max_occurrences_bounds_all_firings() -> None:
    s = Schedule(_campaign("max_occurrences", max_occurrences=2))
    got = [o.occurrence_id for i in (2, 2, 2, 5, 8) for o in s.due(i)]
    assert got == ["x@2", "x@2#1"]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31), p=st.floats(0.0, 1.0))
def test_a_campaign_replays_identically(seed: int, p: float) -> None:
    def run() -> list[str]:
        c = _campaign(probability=p)
        c = type(c)(name=c.name, seed=seed, incidents=c.incidents)
        s = Schedule(c)
        return [o.occurrence_id for i in range(20) for o in s.due(i)]

    assert run() == run()
    assert all(0.0 <= draw(seed, "x", i) < 1.0 for i in range(5))


def test_probability_draws_fire_about_that_often() -> None:
    hits = sum(draw(29, "inc", i) < 0.3 for i in range(4000))
    assert 1000 < hits < 1400


# --- scoring ------------------------------------------------------------------------------------


def _gt(occ: str, t: float, rank: int = 1, ftype: str = "tensor_corruption") -> GroundTruth:
    o = Occurrence.parse(occ)
    return GroundTruth(
        occ, o.incident_id, "f", ftype, o.iteration, o.attempt, rank, t, expected_ranks=(rank,)
    )


def test_scoring_detection_localization_kind_and_false_positives() -> None:
    truth = [
        _gt("a@3", 100.0),
        _gt("b@9", 200.0, rank=2, ftype="hang"),
        _gt("c@12", 300.0, rank=0, ftype="delay"),
    ]
    reports = [
        # a@3: every rank writes the same verdict; one of them
        *({"time": 101.5 + r / 10, "kind": "sdc", "failed_ranks": [1], "scope": "rank"} for r in range(4)),
        # b@9: a verdict that names the wrong rank
        {"time": 205.0, "kind": "hang", "failed_ranks": [3]},
        # c@12: nothing; later an unrelated report much after the window
        {"time": 1000.0, "kind": "straggler", "failed_ranks": [2]},
        {"kind": "sdc"},  # no time: skipped
    ]
    ev = evaluate(truth, reports, window_s=60.0)
    by = {o["occurrence_id"]: o for o in ev["occurrences"]}
    assert by["a@3"]["detected"] and by["a@3"]["localized"] and by["a@3"]["kind_match"]
    assert by["a@3"]["detection_latency_s"] == 1.5
    assert by["b@9"]["detected"] and not by["b@9"]["localized"] and by["b@9"]["reported_ranks"] == [3]
    assert not by["c@12"]["detected"]
    assert ev["verdicts"] == 3 and ev["false_positives"] == 2
    assert ev["recall"] == round(1 / 3, 4) and ev["precision"] == round(1 / 3, 4)
    assert len(verdicts(reports)) == 3
    clean = evaluate_clean([[], [{"time": 1.0, "kind": "hang", "failed_ranks": [0]}]])
    assert clean == {
        "clean_runs": 2,
        "false_positives": 1,
        "runs_with_false_positives": 1,
        "false_positive_rate": 0.5,
    }


def test_the_same_rank_found_at_another_step_within_the_merge_time_is_another_verdict() -> None:
    """A campaign's weight flip at iteration 6 and its gradient reorder at 18, both on rank 0, found
    26.6 s apart (a 21-type campaign on CPU nodes): each occurrence has its own verdict. Reports of
    one finding (every rank's, and one without steps) stay one."""
    truth = [_gt("flip@6", 100.0, rank=0), _gt("reorder@18", 126.0, rank=0, ftype="reorder")]
    sdc = {"kind": "sdc", "failed_ranks": [0], "scope": "rank"}
    reports = [
        *({**sdc, "time": 100.1 + r / 100, "steps": [6]} for r in range(4)),
        {**sdc, "time": 100.2},
        *({**sdc, "time": 126.7 + r / 100, "steps": [18]} for r in range(4)),
    ]
    ev = evaluate(truth, reports)
    assert [o["localized"] for o in ev["occurrences"]] == [True, True]
    assert ev["recall"] == 1.0 and ev["verdicts"] == 2 and ev["false_positives"] == 0
    found = verdicts(reports)
    assert [(v.steps, v.reports) for v in found] == [(frozenset({6}), 5), (frozenset({18}), 4)]
    # Rank 0 killed in generation 4 and again in 6, 10 s apart: a process failure names no step,
    # the reporters' generations tell them apart (before, the second kill scored undetected).
    kills = [_gt(f"kill@{i}", t, 0, "process_termination") for i, t in ((15, 200.0), (22, 210.0))]
    died = {"kind": "process_failure", "failed_ranks": [0], "scope": "rank"}
    reports = [{**died, "time": 200.1 + r / 100, "generation": 4} for r in range(2)]
    reports += [{**died, "time": 210.1 + r / 100, "generation": 6} for r in range(2)]
    ev = evaluate(kills, reports)
    assert [o["localized"] for o in ev["occurrences"]] == [True, True] and ev["verdicts"] == 2


def test_a_killed_worker_is_localized_by_a_process_failure_verdict() -> None:
    truth = [_gt("k@4", 10.0, rank=3, ftype="process_termination")]
    ev = evaluate(truth, [{"time": 12.0, "kind": "process_failure", "failed_ranks": [3]}])
    assert ev["occurrences"][0]["kind_match"] and ev["precision"] == 1.0 and ev["recall"] == 1.0
    assert GroundTruth.from_dict(truth[0].to_dict()) == truth[0]


# --- the command line ---------------------------------------------------------------------------


def test_cli_validates_previews_and_scores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lm_resiliency.cli.main import main as cli

    good = tmp_path / "good.json"
    good.write_text(json.dumps(EXAMPLE))
    assert cli(["campaign", "validate", str(good)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["incidents"] == 2 and summary["types"] == ["hang", "tensor_corruption"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with("incidents.0.trigger.at", [1.5])))
    assert cli(["campaign", "validate", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: incidents[0].trigger.at[0]: expected a JSON int, got float 1.5" in err
    assert cli(["campaign", "schedule", str(good), "--iterations", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    s = Schedule(parse_campaign(EXAMPLE))
    assert [ln.split("\t")[0] for ln in lines] == [o.occurrence_id for i in range(1, 31) for o in s.due(i)]

    (tmp_path / "gt").mkdir()
    (tmp_path / "gt" / "ground-truth-rank1.jsonl").write_text(
        json.dumps(_gt("a@3", 100.0).to_dict()) + "\n{torn"
    )
    (tmp_path / "rep").mkdir()
    lines = [
        json.dumps({"time": 101.0 + r, "kind": "sdc", "failed_ranks": [1], "reason": "fingerprint"})
        for r in range(2)
    ]
    (tmp_path / "rep" / "reports-rank0.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "clean").mkdir()
    assert (
        cli(
            [
                "campaign",
                "score",
                "--ground-truth",
                str(tmp_path / "gt"),
                "--reports",
                str(tmp_path / "rep"),
                "--clean",
                str(tmp_path / "clean"),
            ]
        )
        == 0
    )
    ev = json.loads(capsys.readouterr().out)
    assert ev["localized"] == 1 and ev["precision"] == 1.0 and ev["clean"]["false_positives"] == 0
    assert cli(["report", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "sdc" in out and "ranks 1" in out and "1 verdicts from 2 reports" in out
    assert cli(["report", str(tmp_path / "nothing")]) == 2


def test_cli_says_which_lines_of_reports_or_ground_truth_it_could_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn last line (a kill while it was written) is skipped in silence; a damaged line within
    a file is named, so a damaged ground truth is not scored as if nothing had been injected. A
    ground-truth folder that does not exist (a typo) is an error, not 0 injections."""
    from lm_resiliency.cli.main import main as cli

    (tmp_path / "gt").mkdir()
    record = json.dumps(_gt("a@3", 100.0).to_dict())
    (tmp_path / "gt" / "ground-truth-rank0.jsonl").write_text(f"{record}\nnot json\n{{}}\n{record}\n{{torn")
    (tmp_path / "rep").mkdir()
    report = json.dumps({"time": 101.0, "kind": "sdc", "failed_ranks": [1]})
    (tmp_path / "rep" / "reports-rank0.jsonl").write_text(f"{report}\n[1, 2]\n{{torn\n{report}\n")
    args = ["campaign", "score", "--ground-truth", str(tmp_path / "gt"), "--reports", str(tmp_path / "rep")]
    assert cli(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["injected"] == 1
    err = captured.err
    assert "4 unreadable line(s) skipped" in err, err
    assert "ground-truth-rank0.jsonl line 2: not a ground-truth record" in err
    assert "ground-truth-rank0.jsonl line 3: not a ground-truth record" in err
    assert "reports-rank0.jsonl line 2: a JSON list, not an object" in err
    assert "reports-rank0.jsonl line 3: not JSON" in err and "line 5" not in err
    assert cli(["report", str(tmp_path / "rep")]) == 0
    assert "2 unreadable line(s) skipped" in capsys.readouterr().err
    assert (
        cli(
            [
                "campaign",
                "score",
                "--ground-truth",
                str(tmp_path / "typo"),
                "--reports",
                str(tmp_path / "rep"),
            ]
        )
        == 2
    )
    assert f"no ground-truth folder {tmp_path / 'typo'}" in capsys.readouterr().err


def test_a_verdict_goes_to_the_injection_it_explains_not_the_newest() -> None:
    """A delay on rank 1 begins while the SDC rank 0 got a moment before is being found: the SDC
    verdict is the SDC's, and the delay's own straggler verdict the delay's."""
    truth = [_gt("sdc@8", 100.0, rank=0), _gt("slow@9", 100.5, rank=1, ftype="delay")]
    reports = [
        {"time": 100.6, "kind": "sdc", "failed_ranks": [0]},
        {"time": 102.0, "kind": "straggler", "failed_ranks": [1]},
    ]
    ev = evaluate(truth, reports)
    by = {
        o["occurrence_id"]: (o["localized"], o["kind_match"], o["reported_kind"]) for o in ev["occurrences"]
    }
    assert by == {"sdc@8": (True, True, "sdc"), "slow@9": (True, True, "straggler")}
    assert ev["false_positives"] == 0 and ev["precision"] == 1.0
