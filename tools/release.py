#!/usr/bin/env python3
"""Versions, dependency ranges and release tags of cula's packages (the list is tools/packages.toml).

  tools/release.py NAME VERSION [--widen] [--dry-run]
        Set package NAME's version to VERSION in its pyproject.toml, after checking that every range in
        this repository that names NAME (the meta-package's extras, the arch packages' cula-core
        dependency) admits VERSION. If one does not, nothing is written and the ranges to widen are
        printed, each with a suggested range; --widen rewrites them to those suggestions (the packages
        whose dependencies changed then need a release of their own: it says which). Prints the tag to push.
  tools/release.py --check
        Validate every package: the table matches the pyproject files (and lists every package under
        packages/), versions are PEP 440, each range naming a workspace package admits its current
        version, the meta-package has one extra per arch package plus `all`, each arch package registers
        its backend under `cula.backends`. Exit 1 on any problem (CI runs this).
  tools/release.py --list [--json]
        The packages: name, version, role, arch, how they build (cibuildwheel or python -m build), tag.
  tools/release.py --tag-info TAG [--github-output]
        For release.yml: the package a tag such as cula-sm90-v0.3.1 releases, checked against that
        package's version (exit 1 on a mismatch or an unknown package); prints key=value lines, and
        also appends them to $GITHUB_OUTPUT with --github-output.
  tools/release.py --gpu-matrix
        For ci.yml: the GitHub Actions matrix (JSON) of GPU jobs, one per arch package.
  tools/release.py --root DIR ...
        Work on the repository at DIR instead of this file's (tests use a copy).

Release tags are "<name>-v<version>" (cula-core-v0.2.0, cula-sm90-v0.3.1, cula-v0.2.0). See docs/releasing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ModuleNotFoundError:  # pragma: no cover - tells the user what to install instead of a traceback
    sys.exit("tools/release.py needs the 'packaging' library: pip install packaging")

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLE = Path("tools/packages.toml")
ROLES = ("core", "meta", "arch")
BACKEND_GROUP = "cula.backends"
# GitHub-hosted Linux runners a native package's wheels are built on, per manylinux arch.
LINUX_RUNNERS = {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}


class ReleaseError(Exception):
    """A problem to report to the user (exit 1), not a bug."""


@dataclass
class Package:
    name: str
    path: Path  # absolute
    rel_path: str  # as written in the table
    import_name: str
    role: str
    arch: str | None
    build_tools: list[str]
    benchmarks: list[str]
    pyproject: dict = field(repr=False)

    @property
    def pyproject_path(self) -> Path:
        return self.path / "pyproject.toml"

    @property
    def version(self) -> str:
        return self.pyproject.get("project", {}).get("version", "")

    @property
    def native(self) -> bool:
        """Has native code: built by cibuildwheel from its [tool.cibuildwheel] table."""
        return "cibuildwheel" in self.pyproject.get("tool", {})

    @property
    def tag(self) -> str:
        return tag_for(self.name, self.version)

    def linux_archs(self) -> list[str]:
        """The manylinux archs its cibuildwheel settings build ("auto" means x86_64, the CI host's)."""
        cibw = self.pyproject.get("tool", {}).get("cibuildwheel", {})
        archs = cibw.get("linux", {}).get("archs", cibw.get("archs", ["auto"]))
        archs = archs.split() if isinstance(archs, str) else list(archs)
        out: list[str] = []
        for a in archs:
            for name in {"auto": ["x86_64"], "auto64": ["x86_64"], "native": ["x86_64"]}.get(a, [a]):
                if name not in out:
                    out.append(name)
        return out

    def requirements(self):
        """(where, Requirement) for every dependency: where is "dependencies" or "extra NAME".
        Each Requirement keeps the string it was parsed from as `.raw` (str() reorders specifiers)."""
        project = self.pyproject.get("project", {})
        for req in project.get("dependencies", []):
            yield "dependencies", _requirement(req)
        for extra, reqs in project.get("optional-dependencies", {}).items():
            for req in reqs:
                yield f"extra {extra}", _requirement(req)


def _requirement(text: str) -> Requirement:
    req = Requirement(text)
    req.raw = text  # type: ignore[attr-defined]
    return req


def tag_for(name: str, version: str) -> str:
    return f"{name}-v{version}"


def load_table(root: Path) -> dict:
    path = root / TABLE
    if not path.is_file():
        raise ReleaseError(f"{path} not found")
    with path.open("rb") as f:
        return tomllib.load(f)


def load_packages(root: Path = REPO_ROOT) -> list[Package]:
    packages = []
    for entry in load_table(root).get("package", []):
        missing = {"name", "path", "import", "role"} - entry.keys()
        if missing:
            raise ReleaseError(f"{TABLE}: entry {entry} lacks {sorted(missing)}")
        path = root / entry["path"]
        pyproject_path = path / "pyproject.toml"
        if not pyproject_path.is_file():
            raise ReleaseError(f"{TABLE}: {entry['name']}: {pyproject_path.relative_to(root)} not found")
        with pyproject_path.open("rb") as f:
            pyproject = tomllib.load(f)
        packages.append(Package(
            name=entry["name"], path=path, rel_path=entry["path"], import_name=entry["import"],
            role=entry["role"], arch=entry.get("arch"), build_tools=list(entry.get("build-tools", [])),
            benchmarks=list(entry.get("benchmarks", [])), pyproject=pyproject,
        ))
    return packages


def by_name(packages: list[Package], name: str) -> Package:
    for p in packages:
        if canonicalize_name(p.name) == canonicalize_name(name):
            return p
    raise ReleaseError(f"unknown package {name!r}: tools/packages.toml lists {', '.join(p.name for p in packages)}")


def parse_version(text: str, what: str) -> Version:
    try:
        v = Version(text)
    except InvalidVersion:
        raise ReleaseError(f"{what}: {text!r} is not a PEP 440 version") from None
    if str(v) != text:
        raise ReleaseError(f"{what}: {text!r} is not in canonical form (write {str(v)!r})")
    if v.local is not None:
        raise ReleaseError(f"{what}: {text!r} has a local version label, which PyPI rejects")
    return v


def next_breaking(v: Version) -> str:
    """The first version a `~=`-style range for v should exclude: 0.3.1 -> 0.4, 1.2.0 -> 2."""
    return f"0.{v.minor + 1}" if v.major == 0 else f"{v.major + 1}"


def suggest_range(spec: SpecifierSet, v: Version) -> str:
    """Keep the lower bound (lowered to v if v is below it) and move the upper bound past v:
    ">=0.1.0,<0.2" admitting 0.3.1 becomes ">=0.1.0,<0.4"."""
    lower = [s for s in spec if s.operator in (">=", ">")]
    low = f">={v}" if not lower or not lower[0].contains(v, prereleases=True) else str(lower[0])
    return f"{low},<{next_breaking(v)}"


@dataclass
class RangeProblem:
    dependent: Package
    where: str
    requirement: Requirement
    target: str
    version: Version

    @property
    def raw(self) -> str:
        return getattr(self.requirement, "raw", str(self.requirement))

    def suggestion(self) -> str:
        r = self.requirement
        extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
        marker = f"; {r.marker}" if r.marker else ""
        return f"{r.name}{extras}{suggest_range(r.specifier, self.version)}{marker}"

    def __str__(self) -> str:
        return (f"{self.dependent.rel_path}/pyproject.toml: {self.where} requires {self.raw!r}, "
                f"which excludes {self.target} {self.version}: widen it, e.g. to {self.suggestion()!r}")


def range_problems(packages: list[Package], versions: dict[str, str] | None = None) -> list[RangeProblem]:
    """Every range in a package's dependencies that names a workspace package and does not admit its
    version (the current one, or the one given in `versions`)."""
    current = {canonicalize_name(p.name): Version(p.version) for p in packages}
    for name, v in (versions or {}).items():
        current[canonicalize_name(name)] = Version(v)
    problems = []
    for p in packages:
        for where, req in p.requirements():
            target = canonicalize_name(req.name)
            if target in current and not req.specifier.contains(current[target], prereleases=True):
                problems.append(RangeProblem(p, where, req, req.name, current[target]))
    return problems


def check(root: Path = REPO_ROOT) -> list[str]:
    """Every problem with the packages' versions, ranges and table (empty when all is well)."""
    packages = load_packages(root)
    problems: list[str] = []
    names = [canonicalize_name(p.name) for p in packages]
    if len(set(names)) != len(names):
        problems.append(f"{TABLE}: a package is listed twice")
    listed = {p.path.resolve() for p in packages}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        if pyproject.parent.resolve() not in listed:
            problems.append(f"{pyproject.parent.relative_to(root)} has a pyproject.toml but no entry in {TABLE}")
    for p in packages:
        where = f"{p.rel_path}/pyproject.toml"
        declared = p.pyproject.get("project", {}).get("name")
        if declared != p.name:
            problems.append(f"{where}: [project].name is {declared!r}, {TABLE} says {p.name!r}")
        try:
            parse_version(p.version, f"{where}: version")
        except ReleaseError as exc:
            problems.append(str(exc))
        if "version" in p.pyproject.get("project", {}).get("dynamic", []):
            problems.append(f"{where}: version is dynamic; tools/release.py needs a static [project].version")
        if p.role not in ROLES:
            problems.append(f"{TABLE}: {p.name}: role {p.role!r} is not one of {ROLES}")
        if not (p.path / "src" / p.import_name).is_dir():
            problems.append(f"{TABLE}: {p.name}: import name {p.import_name!r} but no src/{p.import_name}/")
    if problems:  # the checks below need valid versions and roles
        return problems

    cores = [p for p in packages if p.role == "core"]
    metas = [p for p in packages if p.role == "meta"]
    arches = [p for p in packages if p.role == "arch"]
    if len(cores) != 1 or len(metas) != 1:
        return [*problems, f"{TABLE}: needs exactly one core and one meta package"]
    core, meta = cores[0], metas[0]
    problems += [str(r) for r in range_problems(packages)]

    meta_reqs = list(meta.requirements())
    if not any(where == "dependencies" and canonicalize_name(r.name) == canonicalize_name(core.name)
               for where, r in meta_reqs):
        problems.append(f"{meta.rel_path}/pyproject.toml: {meta.name} does not depend on {core.name}")
    extras = meta.pyproject.get("project", {}).get("optional-dependencies", {})
    for p in arches:
        if not p.arch:
            problems.append(f"{TABLE}: arch package {p.name} has no arch")
            continue
        if not any(canonicalize_name(r.name) == canonicalize_name(core.name) and where == "dependencies"
                   for where, r in p.requirements()):
            problems.append(f"{p.rel_path}/pyproject.toml: {p.name} does not depend on {core.name}")
        for extra in (p.arch, "all"):
            if not any(canonicalize_name(Requirement(r).name) == canonicalize_name(p.name)
                       for r in extras.get(extra, [])):
                problems.append(f"{meta.rel_path}/pyproject.toml: extra {extra!r} does not require {p.name}")
        eps = p.pyproject.get("project", {}).get("entry-points", {}).get(BACKEND_GROUP, {})
        if p.arch not in eps:
            problems.append(f"{p.rel_path}/pyproject.toml: no {BACKEND_GROUP!r} entry point named {p.arch!r}")
        elif not eps[p.arch].startswith(f"{p.import_name}."):
            problems.append(f"{p.rel_path}/pyproject.toml: entry point {p.arch} = {eps[p.arch]!r} is "
                            f"outside {p.import_name}")
    arch_names = [p.arch for p in arches]
    if len(set(arch_names)) != len(arch_names):
        problems.append(f"{TABLE}: two arch packages share an arch")
    unknown_extras = set(extras) - set(arch_names) - {"all"}
    if unknown_extras:
        problems.append(f"{meta.rel_path}/pyproject.toml: extras {sorted(unknown_extras)} name no arch package")
    for p in packages:
        if p.native:
            bad = [a for a in p.linux_archs() if a not in LINUX_RUNNERS]
            if bad:
                problems.append(f"{p.rel_path}/pyproject.toml: cibuildwheel archs {bad} have no CI runner "
                                f"(tools/release.py knows {sorted(LINUX_RUNNERS)})")
    return problems


_VERSION_LINE = re.compile(r'^(version\s*=\s*)(["\'])([^"\']*)\2(.*)$')


def set_version(pyproject_path: Path, old: str, new: str) -> None:
    """Rewrite the [project] table's version line only, leaving every other byte of the file alone."""
    lines = pyproject_path.read_text().splitlines(keepends=True)
    section, hits = None, []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.split("#")[0].strip()
        elif section == "[project]":
            m = _VERSION_LINE.match(line.rstrip("\r\n"))
            if m:
                hits.append((i, m))
    if len(hits) != 1 or hits[0][1].group(3) != old:
        raise ReleaseError(f"{pyproject_path}: expected one line 'version = \"{old}\"' in [project]")
    i, m = hits[0]
    ending = line_ending(lines[i])
    lines[i] = f"{m.group(1)}{m.group(2)}{new}{m.group(2)}{m.group(4)}{ending}"
    pyproject_path.write_text("".join(lines))


def line_ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")):]


def replace_requirement(pyproject_path: Path, old: str, new: str) -> None:
    text = pyproject_path.read_text()
    count = text.count(f'"{old}"')
    if count == 0:
        raise ReleaseError(f"{pyproject_path}: cannot find the requirement string \"{old}\" to widen")
    pyproject_path.write_text(text.replace(f'"{old}"', f'"{new}"'))


def bump(root: Path, name: str, version: str, widen: bool, dry_run: bool, out=None) -> int:
    out = out if out is not None else sys.stdout
    packages = load_packages(root)
    pkg = by_name(packages, name)
    new = parse_version(version, "VERSION")
    old = parse_version(pkg.version, f"{pkg.rel_path}/pyproject.toml: version")
    if new <= old:
        raise ReleaseError(f"{pkg.name} is at {old}: {new} is not newer")
    problems = [r for r in range_problems(packages, {pkg.name: version})
                if canonicalize_name(r.target) == canonicalize_name(pkg.name)]
    if problems and not widen:
        print(f"{pkg.name} {version} is outside ranges that name it; nothing was changed:", file=out)
        for r in problems:
            print(f"  {r}", file=out)
        print("Widen them (or rerun with --widen to apply the suggestions), then rerun.", file=out)
        return 1
    verb = "would set" if dry_run else "set"
    print(f"{pkg.name}: {verb} version {old} -> {new} in {pkg.rel_path}/pyproject.toml", file=out)
    changed: list[Package] = []
    rewritten: set[tuple[Path, str]] = set()
    for r in problems:
        new_req = r.suggestion()
        print(f"  {r.dependent.name}: {verb} {r.where} {r.raw!r} -> {new_req!r}", file=out)
        if not dry_run and (r.dependent.pyproject_path, r.raw) not in rewritten:
            # one replacement rewrites every copy of the string in that file (extra sm90 and extra all)
            replace_requirement(r.dependent.pyproject_path, r.raw, new_req)
            rewritten.add((r.dependent.pyproject_path, r.raw))
        if r.dependent not in changed:
            changed.append(r.dependent)
    if not dry_run:
        set_version(pkg.pyproject_path, str(old), version)
    for d in changed:
        print(f"  {d.name}'s dependencies changed: release it too (tools/release.py {d.name} VERSION)", file=out)
    remaining = [str(p) for p in range_problems(load_packages(root))] if not dry_run else []
    for p in remaining:
        print(f"  still to fix: {p}", file=out)
    tag = tag_for(pkg.name, version)
    print(f"commit, then push the tag:\n  git tag {tag} && git push origin {tag}", file=out)
    print(f"tag: {tag}", file=out)
    return 1 if remaining else 0


_TAG = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*?)-v(?P<version>[0-9][^-/\s]*)$")


def tag_info(root: Path, tag: str) -> dict[str, str]:
    tag = tag.removeprefix("refs/tags/")
    m = _TAG.match(tag)
    if not m:
        raise ReleaseError(f"tag {tag!r} is not of the form <package>-v<version> (cula-sm90-v0.3.1)")
    packages = load_packages(root)
    pkg = by_name(packages, m["name"])
    if m["version"] != pkg.version:
        raise ReleaseError(f"tag {tag} says version {m['version']}, but {pkg.rel_path}/pyproject.toml has "
                           f"{pkg.version}: bump it first (tools/release.py {pkg.name} {m['version']})")
    archs = pkg.linux_archs() if pkg.native else []
    return {
        "name": pkg.name,
        "version": pkg.version,
        "path": pkg.rel_path,
        "import": pkg.import_name,
        "native": "true" if pkg.native else "false",
        "build-matrix": json.dumps({"include": [{"arch": a, "runner": LINUX_RUNNERS[a]} for a in archs]}),
    }


def gpu_matrix(root: Path) -> dict:
    include = []
    for p in load_packages(root):
        if p.role == "arch":
            include.append({"package": p.name, "path": p.rel_path, "arch": p.arch, "tests": f"tests/{p.arch}",
                            "benchmarks": " ".join(p.benchmarks)})
    return {"include": include}


def list_packages(root: Path) -> list[dict]:
    return [{"name": p.name, "version": p.version, "path": p.rel_path, "import": p.import_name, "role": p.role,
             "arch": p.arch, "native": p.native, "build": "cibuildwheel" if p.native else "python -m build",
             "build-tools": p.build_tools, "tag": p.tag} for p in load_packages(root)]


def build_parser() -> argparse.ArgumentParser:
    """The command line; its --help is this module's docstring, which documents every option."""
    parser = argparse.ArgumentParser(
        prog="tools/release.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", metavar="NAME", help="package to bump (cula-core, cula-sm90, cula ...)")
    parser.add_argument("version", nargs="?", metavar="VERSION", help="its new version (PEP 440, e.g. 0.3.1)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="validate all versions, ranges and the package table")
    mode.add_argument("--list", action="store_true", help="list the packages")
    mode.add_argument("--tag-info", metavar="TAG",
                      help="the package a release tag releases, checked against its version")
    mode.add_argument("--gpu-matrix", action="store_true", help="GitHub Actions matrix (JSON) of the GPU CI jobs")
    parser.add_argument("--widen", action="store_true", help="with NAME VERSION: rewrite ranges that exclude VERSION")
    parser.add_argument("--dry-run", action="store_true",
                        help="with NAME VERSION: print what would change, write nothing")
    parser.add_argument("--json", action="store_true", help="with --list: print JSON")
    parser.add_argument("--github-output", action="store_true",
                        help="with --tag-info: also append the key=value lines to $GITHUB_OUTPUT")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    root = args.root.resolve()
    bumping = args.name is not None
    modes = [args.check, args.list, args.tag_info is not None, args.gpu_matrix]
    if bumping and any(modes):
        parser.error("NAME VERSION cannot be combined with --check, --list, --tag-info or --gpu-matrix")
    if not bumping and not any(modes):
        parser.error("give NAME VERSION, or one of --check, --list, --tag-info TAG, --gpu-matrix")
    if bumping and args.version is None:
        parser.error("NAME needs a VERSION: tools/release.py cula-sm90 0.3.1")
    if (args.widen or args.dry_run) and not bumping:
        parser.error("--widen and --dry-run go with NAME VERSION")
    if args.json and not args.list:
        parser.error("--json goes with --list")
    if args.github_output and args.tag_info is None:
        parser.error("--github-output goes with --tag-info")
    try:
        if bumping:
            return bump(root, args.name, args.version, args.widen, args.dry_run)
        if args.check:
            problems = check(root)
            for p in problems:
                print(f"error: {p}")
            if problems:
                return 1
            packages = load_packages(root)
            print(f"ok: {len(packages)} packages, versions and ranges consistent "
                  f"({', '.join(f'{p.name} {p.version}' for p in packages)})")
            return 0
        if args.list:
            rows = list_packages(root)
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                for r in rows:
                    print(f"{r['name']:<12} {r['version']:<10} {r['role']:<5} {r['arch'] or '-':<6} "
                          f"{r['build']:<16} {r['tag']}")
            return 0
        if args.tag_info is not None:
            info = tag_info(root, args.tag_info)
            lines = [f"{k}={v}" for k, v in info.items()]
            print("\n".join(lines))
            if args.github_output:
                target = os.environ.get("GITHUB_OUTPUT")
                if not target:
                    raise ReleaseError("--github-output: $GITHUB_OUTPUT is not set")
                with open(target, "a") as f:
                    f.write("\n".join(lines) + "\n")
            return 0
        print(json.dumps(gpu_matrix(root)))
        return 0
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
