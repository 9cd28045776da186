"""README.md's "An imaging study, with the hospital's own model", run as written (issue
12): the hospital's model module, the images study, `data check` on an image folder, the
coordinator and three sites (8-bit PNG, DICOM, 16-bit PNG folders) allowing the custom
factory, the final model at every site, and `predict` on new images reporting an AUC.

Blocks are extracted and run by `tests/e2e/harness.Readme`, as for the tables; only
paths, ports and site names are substituted. The PKI blocks are the README's own
(hospital key, operator)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess
from site_agent.synthetic_imaging import write_site_folder
from tests.e2e.harness import README_SITES as SITES
from tests.e2e.harness import Readme, readme_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCKS = ("imaging-model", "imaging-study", "imaging-coordinator", "imaging-approve",
          "imaging-site", "imaging-predict")
PATIENTS = 85
"""Per hospital. Each patient is held out with probability 0.2 (a keyed hash,
`site_agent.unit_split`): fewer than the 50 patients DP-SGD needs are left to train with
probability 2e-6 per site (at 70 it was 3 %: a site stopped at its first training round,
"too few patients: 49 < 50", the round aborted and the other sites waited)."""
# README site name -> the synthetic hospital whose scanner it gets (PNG, DICOM, PNG16).
HOSPITAL = {SITES[0]: "north_general", SITES[1]: "riverside_childrens",
            SITES[2]: "st_marys"}


class ImagingReadme(Readme):
    """The README runner, with the image folders substituted too."""

    def command(self, name: str, site: str = SITES[0]) -> str:
        text = super().command(name, site)
        return (text.replace("/data/xray-new", str(self.root / "new" / "valley_community"))
                .replace("/data/xray", str(self.root / "cohort" / HOSPITAL[site])))


def test_imaging_blocks_are_tagged() -> None:
    assert set(BLOCKS) <= set(readme_blocks())


def test_the_readme_imaging_study_runs_as_written(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    for index, hospital in enumerate(HOSPITAL.values()):
        write_site_folder(tmp_path / "cohort", hospital, seed=index + 1, patients=PATIENTS)
    write_site_folder(tmp_path / "new", "valley_community", seed=9, patients=60)
    readme = ImagingReadme(tmp_path)
    # The model block's `export PYTHONPATH=$PWD`, for the processes started below.
    readme.env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{readme.env['PYTHONPATH']}"
    readme.set_up_pki()
    readme.run(readme.command("imaging-model"))
    assert (tmp_path / "lesion_models.py").is_file()
    first = readme.run(readme.command("imaging-study"))
    assert "ok" in first.splitlines()[0], first
    for site in SITES[1:]:
        check = readme.command("imaging-study", site).splitlines()[-1]
        assert check.startswith("medfed data check")
        assert "ok" in readme.run(check).splitlines()[0]

    coordinator = readme.start("coordinator", readme.command("imaging-coordinator"))
    processes.append(coordinator)
    coordinator.wait_event("listening", timeout=120)
    for site in SITES:
        approved = json.loads(readme.run(readme.command("imaging-approve", site)).splitlines()[-1])
        assert approved["approved"] == "study"
    sites = {site: readme.start(site, readme.command("imaging-site", site)) for site in SITES}
    processes.extend(sites.values())
    for site, proc in sites.items():
        assert proc.wait_exit(timeout=800) == 0, f"{site}:\n{proc.tail(30)}"
    coordinator.wait_log("still serving status and the final model", timeout=120)

    final = (tmp_path / "state" / "coordinator-imaging" / "model" / "final.safetensors")
    for site in SITES:
        stored = tmp_path / "state" / f"{site}-imaging" / "model" / "final.safetensors"
        assert stored.read_bytes() == final.read_bytes()
    output = readme.run(readme.command("imaging-predict", SITES[1]))
    metrics = json.loads(output.strip().splitlines()[-1])
    assert isinstance(metrics["auc"], float) and 0.0 <= metrics["auc"] <= 1.0
    assert metrics["n"] == len((tmp_path / "scores.csv").read_text().splitlines()) - 1
