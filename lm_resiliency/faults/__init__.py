"""Fault campaigns (INTERFACE.md §3): parsing, the replayable schedule, injection into the live job
and scoring against the job's own fault reports."""

from lm_resiliency.faults.campaign import (
    Campaign,
    CampaignError,
    Occurrence,
    Schedule,
    load_campaign,
    load_campaigns,
    parse_campaign,
)
from lm_resiliency.faults.scoring import GroundTruth, evaluate, evaluate_clean

__all__ = [
    "Campaign",
    "CampaignError",
    "GroundTruth",
    "Occurrence",
    "Schedule",
    "evaluate",
    "evaluate_clean",
    "load_campaign",
    "load_campaigns",
    "parse_campaign",
]
