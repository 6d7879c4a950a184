"""docs/horovod.md's table of every Horovod name agrees with what `gradmesh.horovod` exports:
each exported name has a row, and no name marked missing is exported."""

from __future__ import annotations

import re
from pathlib import Path

import gradmesh.horovod as hvd

ROW = re.compile(r"^\| `([A-Za-z_]+)` \| (same|differs|missing|gradmesh's) \|")


def test_the_docs_table_lists_every_exported_name_and_only_those_as_present() -> None:
    text = (Path(__file__).parents[2] / "docs" / "horovod.md").read_text()
    rows = dict(m.groups() for line in text.splitlines() if (m := ROW.match(line)))
    present = {name for name, status in rows.items() if status != "missing"}
    missing = {name for name, status in rows.items() if status == "missing"}
    assert set(hvd.__all__) == present
    assert not missing & set(dir(hvd))
