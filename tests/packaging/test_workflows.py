"""The GitHub workflows: actionlint (with shellcheck over the run: scripts) passes, and they are wired to the
package table: CI's GPU matrix comes from tools/release.py, release tags select the package, publishing
uses trusted publishing."""

from __future__ import annotations

import fnmatch
import re
import subprocess

import yaml  # pyyaml, from tools/requirements-test.txt
from pkgtest import PACKAGES, REPO_ROOT, tool

WORKFLOWS = REPO_ROOT / ".github" / "workflows"


def load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def actionlint(*paths) -> subprocess.CompletedProcess:
    cmd = [tool("actionlint"), "-no-color", "-shellcheck", tool("shellcheck")]
    return subprocess.run([*cmd, *map(str, paths)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)


def test_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"ci.yml", "release.yml"}
    proc = actionlint(*files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


def test_actionlint_catches_mistakes(tmp_path):
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "on: push\n"
        "jobs:\n"
        "  a:\n"
        "    runs-on: ubuntu-24.04\n"
        "    steps:\n"
        "      - run: echo ${{ matrix.nope }}\n"  # no matrix here
        "      - run: echo $UNQUOTED_VAR\n"  # shellcheck SC2086
        "      - uses: actions/checkout@v5\n"
        "        with:\n"
        "          not-an-input: 1\n")
    proc = actionlint(bad)
    assert proc.returncode == 1
    assert "matrix" in proc.stdout and "not-an-input" in proc.stdout and "SC2086" in proc.stdout


def test_release_tags_select_exactly_the_package_tags():
    patterns = load("release.yml")["on"]["push"]["tags"]
    matches = lambda tag: any(fnmatch.fnmatchcase(tag, p) for p in patterns)
    for p in PACKAGES:
        assert matches(p.tag), f"release.yml does not trigger on {p.tag}"
        assert matches(f"{p.name}-v1.0.0rc1")
    for tag in ("v0.1.0", "cula-sm90-0.1.0", "release-1", "culasm90-v1"):
        assert not matches(tag), tag


def test_release_workflow_checks_the_tag_and_publishes_with_trusted_publishing():
    wf = load("release.yml")
    jobs = wf["jobs"]
    resolve = " ".join(s.get("run", "") for s in jobs["resolve"]["steps"])
    assert "tools/release.py --check" in resolve and 'tools/release.py --tag-info "$GITHUB_REF_NAME"' in resolve
    assert jobs["pure"]["if"] == "needs.resolve.outputs.native == 'false'"
    assert jobs["native"]["if"] == jobs["sdist"]["if"] == "needs.resolve.outputs.native == 'true'"
    assert "python -m build" in " ".join(s.get("run", "") for s in jobs["pure"]["steps"])
    assert "python -m cibuildwheel" in " ".join(s.get("run", "") for s in jobs["native"]["steps"])
    assert jobs["native"]["strategy"]["matrix"] == "${{ fromJSON(needs.resolve.outputs.build-matrix) }}"
    publish = jobs["publish"]
    assert publish["permissions"] == {"id-token": "write"}
    assert any(s.get("uses", "").startswith("pypa/gh-action-pypi-publish@") for s in publish["steps"])
    assert not any("password" in s.get("with", {}) for s in publish["steps"]), "trusted publishing needs no token"
    assert wf["permissions"] == {"contents": "read"}


def test_release_installs_the_cibuildwheel_the_tests_check():
    step = next(s["run"] for s in load("release.yml")["jobs"]["native"]["steps"] if "grep" in s.get("run", ""))
    pattern = re.search(r"grep -E '([^']+)' tools/requirements-test.txt", step).group(1)
    reqs = (REPO_ROOT / "tools" / "requirements-test.txt").read_text().splitlines()
    hits = [line for line in reqs if re.match(pattern, line)]
    assert len(hits) == 1 and hits[0].startswith("cibuildwheel=="), hits


def test_ci_runs_the_suite_and_one_gpu_job_per_arch_from_the_table():
    jobs = load("ci.yml")["jobs"]
    assert any(s.get("run") == "tools/test.sh" for s in jobs["cpu"]["steps"])
    plan = " ".join(s.get("run", "") for s in jobs["plan"]["steps"])
    assert "python tools/release.py --gpu-matrix" in plan
    gpu = jobs["gpu"]
    assert gpu["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.gpu-matrix) }}"
    assert gpu["runs-on"] == ["self-hosted", "linux", "${{ matrix.arch }}"]
    runs = " ".join(s.get("run", "") for s in gpu["steps"])
    assert "pytest -m gpu" in runs and "tools.bench.harness --smoke" in runs
    assert './packages/cula-core "./${PACKAGE_PATH}"' in runs
