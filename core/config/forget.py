"""Forgetting a user (``liverl forget``, ``POST /v1/erasures``): what is done about the versions that trained on
them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config.base import Section


class ForgetConfig(Section):
    policy: Literal["report", "rollback", "retrain"] = Field(
        default="report",
        description="What an erasure does about the versions that trained on the user, once their key, sums and "
        "lineage are dealt with. 'report': nothing to what is served; the erasure's report names those versions and "
        "the offer (the newest version that was stable and did not train on them) for an operator to roll back to. "
        "'rollback': if the stable version trained on them, roll back to the offer through the registry (audited; "
        "the gate signs and announces it), abort a canary that trained on them and reject such pending candidates. "
        "'retrain': mark the erasure as a retrain request from the offer, for an operator. The default is 'report' "
        "because the product key alone can file erasures: an automatic rollback per request would let any holder of "
        "that key keep the model from ever improving, and would discard every other user's gains (docs/forget.md).",
    )
    run_in_gate: bool = Field(
        default=True,
        description="The gate's loop runs the erasures the product filed (POST /v1/erasures) at each step. False: "
        "they wait for an operator's `liverl forget --resume`.",
    )
    scan_count: int = Field(
        default=1000,
        ge=10,
        le=100_000,
        description="The COUNT of each Redis SCAN over the per-user sums' keys (<prefix>:units:*) while an erasure "
        "deletes one user's fields from them: keys are visited in batches of about this many.",
    )
