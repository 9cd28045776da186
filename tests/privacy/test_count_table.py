"""docs/privacy.md's table of the cohort count's noise is the mechanism's own output."""

from __future__ import annotations

from pathlib import Path

from site_agent import count_table

ROOT = Path(__file__).resolve().parents[2]


def test_docs_count_table_is_generated() -> None:
    text = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    assert count_table.docs_section() in text, (
        "docs/privacy.md's count-noise table is stale: paste "
        "`python -m site_agent.count_table` over it"
    )
