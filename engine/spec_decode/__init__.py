"""Speculative decoding: proposals (n-gram lookup, draft models) verified by the target in one
varlen step, with rejection sampling that keeps the target's distribution.

`make_proposer(engine, spec_config)` builds the proposer a `SpeculativeConfig` names.
"""

from __future__ import annotations

from typing import Any

from engine.speculative_config import SpeculativeConfig
from engine.spec_decode.proposer import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "SpeculativeConfig", "make_proposer"]


def make_proposer(engine: Any, spec_config: SpeculativeConfig) -> Proposer:
    """The proposer for `spec_config.method`: "ngram" (prompt lookup) or "draft_model" (a
    separate model, or the target's first `draft_layers` layers; built by
    `engine.spec_decode.draft_model.make_draft_proposer`)."""
    if spec_config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer
        return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)
    from engine.spec_decode.draft_model import make_draft_proposer
    return make_draft_proposer(engine, spec_config)
