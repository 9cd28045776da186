"""The prepared GPU run (bench/gpu/): the scripts parse, and every wheel fetch-wheels.sh
carries to the GPU machine is one dev.lock pins (the script refuses otherwise, on the
day a GPU is lent, when there is no time to mend it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "bench" / "gpu"


@pytest.mark.parametrize("script", ["check.sh", "fetch-wheels.sh"])
def test_the_gpu_scripts_parse(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def _carried_names() -> list[str]:
    text = (SCRIPTS / "fetch-wheels.sh").read_text()
    block = re.search(r"^names=\((.*?)^\)", text, flags=re.S | re.M)
    assert block is not None, "fetch-wheels.sh lists its wheels in names=( ... )"
    return [w for line in block.group(1).splitlines()
            for w in line.split("#")[0].split()]


def test_every_carried_wheel_is_pinned_by_the_dev_lock() -> None:
    pinned = {line.split("==")[0].lower() for line in
              (ROOT / "requirements" / "dev.lock").read_text().splitlines()
              if re.match(r"^[A-Za-z0-9_.-]+==", line)}
    names = _carried_names()
    assert {"opacus", "cryptography", "cffi", "pydantic", "monai"} <= set(names)
    assert [n for n in names if n.lower() not in pinned] == []


@pytest.mark.parametrize("outcome", ["fails", "measures"])
def test_check_records_a_failure_as_an_error_never_as_a_figure(
        tmp_path: Path, outcome: str) -> None:
    """check.sh's `round` part, run with a stand-in for `python -m common.commands.cli` that
    fails (exit 3) or prints a figure: a failure is recorded with `result: null` and the
    command's last words, a success with the bench's JSON, each labelled with the card."""
    import json
    import os
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / ".medfed-installed").touch()  # the wheels' install is not what is tested
    stub = tmp_path / "python"
    said = ('echo "medfed: error: port 7443 refused"; exit 3' if outcome == "fails"
            else 'echo "timing..."; echo \'{"sites": 3, "ratio": 1.25}\'; exit 0')
    stub.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ]; then {said}; fi
exec {sys.executable} "$@"
""")
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "MEDFED_GPU_CHECK_PYTHON": str(stub),
           "MEDFED_GPU_CHECK_SITE": str(site), "MEDFED_GPU_CHECK_QUICK": "1",
           "MEDFED_GPU_CHECK_DEVICE": "cpu"}
    done = subprocess.run(["bash", str(SCRIPTS / "check.sh"), "round"], env=env,
                          capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 1
    record = records[0]
    assert record["label"] == "round-3" and record["card"]
    assert record["command"].startswith("medfed bench round --sites 3")
    if outcome == "fails":
        assert record["exit_status"] == 3 and record["result"] is None
        assert "port 7443 refused" in record["error"]
    else:
        assert record["exit_status"] == 0 and "error" not in record
        assert record["result"] == {"sites": 3, "ratio": 1.25}
    assert "round-3: exit status" in (out / "check.log").read_text()
