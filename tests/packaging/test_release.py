"""tools/release.py: bump, range check, --widen, --check, --tag-info, --gpu-matrix, --help. Every case that
writes runs on a copy of the repository's packages and package table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from pkgtest import PACKAGES, REPO_ROOT, by_role, release

SCRIPT = REPO_ROOT / "tools" / "release.py"


def cli(*args, root=None, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), *(["--root", str(root)] if root else []), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def repo(tmp_path):
    """A copy of the package table and of every package's pyproject.toml and src/ tree."""
    (tmp_path / "tools").mkdir()
    shutil.copy2(REPO_ROOT / "tools" / "packages.toml", tmp_path / "tools" / "packages.toml")
    for p in PACKAGES:
        dest = tmp_path / p.rel_path
        dest.mkdir(parents=True)
        shutil.copy2(p.pyproject_path, dest / "pyproject.toml")
        shutil.copytree(p.path / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def snapshot(root) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.glob("packages/*/pyproject.toml"))}


def version_of(root, name) -> str:
    return release.by_name(release.load_packages(root), name).version


def test_check_passes_on_this_repository():
    proc = cli("--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: ")
    for p in PACKAGES:
        assert f"{p.name} {p.version}" in proc.stdout


def test_bump_within_range_changes_only_the_version_line(repo):
    meta = by_role("meta")[0]
    arch = next(p for p in by_role("arch") if p.name == "cula-sm90")
    new = release.Version(arch.version)
    new_version = f"{new.major}.{new.minor}.{new.micro + 1}"
    before = snapshot(repo)
    proc = cli(arch.name, new_version, root=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = snapshot(repo)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {f"{arch.rel_path}/pyproject.toml"}
    diff = [(a, b) for a, b in zip(before[f"{arch.rel_path}/pyproject.toml"].splitlines(),
                                   after[f"{arch.rel_path}/pyproject.toml"].splitlines(), strict=True) if a != b]
    assert diff == [(f'version = "{arch.version}"', f'version = "{new_version}"')]
    assert proc.stdout.rstrip().splitlines()[-1] == f"tag: cula-sm90-v{new_version}"
    assert f"git tag cula-sm90-v{new_version}" in proc.stdout
    assert cli("--check", root=repo).returncode == 0
    assert version_of(repo, meta.name) == meta.version


def test_bump_outside_the_meta_range_names_the_ranges_to_widen_and_writes_nothing(repo):
    before = snapshot(repo)
    proc = cli("cula-sm90", "0.3.1", root=repo)
    assert proc.returncode == 1
    assert snapshot(repo) == before
    out = proc.stdout
    assert "nothing was changed" in out
    assert "packages/cula/pyproject.toml: extra sm90 requires 'cula-sm90>=0.1.0,<0.2'" in out
    assert "packages/cula/pyproject.toml: extra all requires 'cula-sm90>=0.1.0,<0.2'" in out
    assert "widen it, e.g. to 'cula-sm90>=0.1.0,<0.4'" in out
    assert "tag:" not in out


def test_bump_with_widen_rewrites_the_ranges_and_says_what_else_to_release(repo):
    proc = cli("cula-sm90", "0.3.1", "--widen", root=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta_text = (repo / "packages/cula/pyproject.toml").read_text()
    assert 'sm90 = ["cula-sm90>=0.1.0,<0.4"]' in meta_text
    assert '"cula-sm89>=0.1.0,<0.2", "cula-sm90>=0.1.0,<0.4", "cula-sm100>=0.1.0,<0.2"' in meta_text
    assert version_of(repo, "cula-sm90") == "0.3.1"
    assert "cula's dependencies changed: release it too" in proc.stdout
    assert proc.stdout.rstrip().endswith("tag: cula-sm90-v0.3.1")
    assert cli("--check", root=repo).returncode == 0


def test_bumping_core_past_its_range_involves_every_dependent(repo):
    proc = cli("cula-core", "0.2.0", root=repo)
    assert proc.returncode == 1
    for p in (*by_role("arch"), *by_role("meta")):
        assert f"{p.rel_path}/pyproject.toml: dependencies requires 'cula-core>=0.1.0,<0.2'" in proc.stdout
    proc = cli("cula-core", "0.2.0", "--widen", root=repo)
    assert proc.returncode == 0, proc.stdout
    for p in (*by_role("arch"), *by_role("meta")):
        assert '"cula-core>=0.1.0,<0.3"' in (repo / p.rel_path / "pyproject.toml").read_text()
        assert f"{p.name}'s dependencies changed" in proc.stdout


def test_dry_run_writes_nothing(repo):
    before = snapshot(repo)
    proc = cli("cula-core", "0.2.0", "--widen", "--dry-run", root=repo)
    assert proc.returncode == 0
    assert "would set version 0.1.0 -> 0.2.0" in proc.stdout
    assert snapshot(repo) == before


@pytest.mark.parametrize("args, message", [
    (("cula-sm90", "0.1.0"), "is not newer"),
    (("cula-sm90", "0.0.9"), "is not newer"),
    (("cula-sm90", "soon"), "is not a PEP 440 version"),
    (("cula-sm90", "0.2.0+cu128"), "local version label"),
    (("cula-sm90", "00.2.0"), "canonical form"),
    (("cula-sm42", "0.2.0"), "unknown package 'cula-sm42'"),
])
def test_bump_rejects(repo, args, message):
    before = snapshot(repo)
    proc = cli(*args, root=repo)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert snapshot(repo) == before


@pytest.mark.parametrize("args", [("cula-sm90",), ("--check", "--list"), ("cula-sm90", "0.2.0", "--check"),
                                  ("--widen",), ("--list", "--github-output"), ()])
def test_usage_errors(args):
    proc = cli(*args)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda r: _sub(r / "packages/cula/pyproject.toml", 'sm90 = ["cula-sm90>=0.1.0,<0.2"]',
                    'sm90 = ["cula-sm90>=0.2"]'), "extra sm90 requires 'cula-sm90>=0.2', which excludes"),
    (lambda r: _sub(r / "packages/cula-sm90/pyproject.toml", 'name = "cula-sm90"', 'name = "cula-hopper"'),
     "[project].name is 'cula-hopper'"),
    (lambda r: _sub(r / "packages/cula-sm90/pyproject.toml", 'sm90 = "cula_sm90.backend:backend"',
                    'hopper = "cula_sm90.backend:backend"'), "no 'cula.backends' entry point named 'sm90'"),
    (lambda r: _sub(r / "packages/cula/pyproject.toml", 'sm100 = ["cula-sm100>=0.1.0,<0.2"]', ""),
     "extra 'sm100' does not require cula-sm100"),
    (lambda r: _sub(r / "packages/cula-sm100/pyproject.toml", 'version = "0.1.0"', 'version = "0.1.0.dev"'),
     "not in canonical form"),
    (lambda r: (r / "packages/cula-sm120").mkdir() or (r / "packages/cula-sm120/pyproject.toml").write_text(
        '[project]\nname = "cula-sm120"\nversion = "0.1.0"\n'),
     "packages/cula-sm120 has a pyproject.toml but no entry"),
], ids=["range", "name", "entry-point", "extra", "version", "untabled-package"])
def test_check_finds(repo, edit, message):
    edit(repo)
    proc = cli("--check", root=repo)
    assert proc.returncode == 1
    assert message in proc.stdout, proc.stdout


def _sub(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def test_tag_info_for_release_workflow(tmp_path):
    out = tmp_path / "github_output"
    out.write_text("earlier=1\n")
    env = {"GITHUB_OUTPUT": str(out), "PATH": "/usr/bin:/bin"}
    sm90 = next(p for p in PACKAGES if p.name == "cula-sm90")
    proc = cli("--tag-info", f"refs/tags/{sm90.tag}", "--github-output", env=env)
    assert proc.returncode == 0, proc.stderr
    fields = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert fields["name"] == "cula-sm90" and fields["version"] == sm90.version
    assert fields["path"] == "packages/cula-sm90" and fields["import"] == "cula_sm90"
    assert fields["native"] == ("true" if sm90.native else "false")
    assert out.read_text() == "earlier=1\n" + proc.stdout
    # cula-core-v... is cula-core's tag, not cula's; cula-v... is cula's
    for p in PACKAGES:
        assert cli("--tag-info", p.tag).stdout.startswith(f"name={p.name}\n")


@pytest.mark.parametrize("tag, message", [
    ("cula-sm90-v9.9.9", "says version 9.9.9, but packages/cula-sm90/pyproject.toml has"),
    ("cula-sm42-v0.1.0", "unknown package 'cula-sm42'"),
    ("v0.1.0", "is not of the form"),
    ("cula-sm90-0.1.0", "is not of the form"),
])
def test_tag_info_rejects(tag, message):
    proc = cli("--tag-info", tag)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_tag_info_build_matrix_follows_the_cibuildwheel_archs(repo):
    path = repo / "packages/cula-sm90/pyproject.toml"
    path.write_text(path.read_text() + '\n[tool.cibuildwheel.linux]\narchs = ["x86_64", "aarch64"]\n')
    fields = dict(line.split("=", 1) for line in cli("--tag-info", "cula-sm90-v0.1.0", root=repo).stdout.splitlines())
    assert fields["native"] == "true"
    assert json.loads(fields["build-matrix"]) == {"include": [{"arch": "x86_64", "runner": "ubuntu-24.04"},
                                                              {"arch": "aarch64", "runner": "ubuntu-24.04-arm"}]}
    path.write_text(path.read_text().replace('"aarch64"', '"ppc64le"'))
    assert "cibuildwheel archs ['ppc64le'] have no CI runner" in cli("--check", root=repo).stdout


def test_gpu_matrix_has_one_job_per_arch_package():
    proc = cli("--gpu-matrix")
    matrix = json.loads(proc.stdout)
    assert [j["arch"] for j in matrix["include"]] == [p.arch for p in by_role("arch")]
    for job, p in zip(matrix["include"], by_role("arch"), strict=True):
        assert job == {"package": p.name, "path": p.rel_path, "arch": p.arch, "tests": f"tests/{p.arch}",
                       "benchmarks": " ".join(p.benchmarks)}


def test_list_json():
    rows = json.loads(cli("--list", "--json").stdout)
    assert [(r["name"], r["version"], r["tag"]) for r in rows] == [(p.name, p.version, p.tag) for p in PACKAGES]
    assert all(r["build"] == ("cibuildwheel" if r["native"] else "python -m build") for r in rows)


def test_help_documents_every_option():
    proc = cli("--help")
    assert proc.returncode == 0
    options = [s for a in release.build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")]
    assert len(options) >= 9
    doc = release.__doc__
    for option in options:
        assert f"{option}" in doc, f"{option} is not described in tools/release.py's docstring (its --help)"
        assert option in proc.stdout
    assert "tools/release.py NAME VERSION" in proc.stdout


def test_benchmarks_named_in_the_table_exist():
    """The GPU CI job runs `python -m tools.bench.<name> --smoke` for each: a typo would only show on a GPU."""
    for p in PACKAGES:
        for name in p.benchmarks:
            assert (REPO_ROOT / "tools" / "bench" / f"{name}.py").is_file(), f"{p.name}: tools/bench/{name}.py"


def test_benchmarks_take_the_options_the_gpu_job_passes():
    """The GPU CI job calls each listed benchmark with `--smoke --json FILE`: both must be in its --help."""
    for p in PACKAGES:
        for name in p.benchmarks:
            proc = subprocess.run([sys.executable, "-m", f"tools.bench.{name}", "--help"], cwd=REPO_ROOT,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"tools/bench/{name}.py --help failed:\n{proc.stderr}"
            for option in ("--smoke", "--json"):
                assert option in proc.stdout, f"tools/bench/{name}.py has no {option} option"
