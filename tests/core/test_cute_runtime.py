"""CPU tests of cula_core.cute_runtime: configuration identities, the chunk tables, the JIT path into the disk cache
(one notice, then a fresh process loads without compiling or importing the DSL), the shipped path (artifacts built
and linked as the wheel's build hook does, found through a package's `_aot/` manifest) and the listing."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from cula_core import cute_runtime as rt


def test_core_import_pulls_no_dsl_and_no_tvm_ffi():
    code = ("import sys, cula_core, cula_core.cute_runtime; "
            "bad = [m for m in sys.modules if m.startswith(('cutlass', 'tvm_ffi'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_artifact_ids_follow_the_configuration():
    bf, f32 = torch.bfloat16, torch.float32
    a = rt.artifact_id("k", ("final", 1, bf, None, True, (64, 4)))
    assert a == rt.artifact_id("k", ("final", 1, bf, None, True, (64, 4)))
    others = [("final", 1, f32, None, True, (64, 4)), ("final", 1, bf, None, False, (64, 4)),
              ("final", 1, bf, None, True, (32, 4)), ("final", 2, bf, None, True, (64, 4))]
    ids = {rt.artifact_id("k", c) for c in others}
    assert a not in ids and len(ids) == len(others)
    assert rt.artifact_id("j", ("final", 1, bf, None, True, (64, 4))) != a


def test_configuration_rejects_unstable_values():
    with pytest.raises(TypeError, match="kernel configuration holds .* got object"):
        rt.artifact_id("k", (object(),))


@pytest.mark.parametrize("lengths", [[5], [64, 0, 65, 1, 128], [0, 0], [200, 63]])
def test_chunk_tables(lengths):
    bounds = tuple(itertools.accumulate(lengths, initial=0))
    BT = 64
    counts = torch.tensor([-(-n // BT) for n in lengths])
    assert list(rt.chunk_offsets(bounds, BT)) == [0, *torch.cumsum(counts, 0).tolist()]
    table = rt.chunk_table(bounds, BT)
    assert len(table) == int(counts.sum())
    covered = [t for start, n in table for t in range(start, start + n)]
    assert covered == list(range(bounds[-1]))  # every token once, in order, chunks never crossing a sequence
    for (b0, b1), (s0, s1, c0) in zip(itertools.pairwise(bounds), rt.sequence_table(bounds, BT), strict=True):
        assert (s0, s1) == (b0, b1)
        assert all(b0 <= t < b1 for t, _ in table[c0:c0 + -(-(b1 - b0) // BT)])


def test_sequence_bounds():
    assert rt.sequence_bounds(3, 5, None, None) == (0, 5, 10, 15)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    assert rt.sequence_bounds(1, 9, cu, cu) == (0, 2, 9)
    assert rt.sequence_bounds(1, 9, cu, None) is None  # device-only bounds: never read (no synchronisation)


def test_device_int32_takes_lists_and_host_tensors():
    rows = [[0, 64, 0, 1, -1], [64, 100, 1, 0, 2]]
    t = rt.device_int32(rows, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == rows
    host = torch.tensor([0, 5, 9], dtype=torch.int64)
    assert rt.device_int32(host, torch.device("cpu")).tolist() == [0, 5, 9]
    assert rt.device_int32(host, "cpu").dtype == torch.int32


# ---------------------------------------------------------------- compiling, caching, shipping (CuTe DSL needed)

@pytest.fixture
def probe(monkeypatch, tmp_path):
    """The runtime with the probe kernel registered (tests/core/cute_runtime_probe.py) and a cache of its own."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    import cute_runtime_probe

    monkeypatch.setenv("CULA_CACHE_DIR", str(tmp_path / "cache"))
    rt.reset()
    yield cute_runtime_probe
    rt.reset()


def _fresh_process_loads(config: tuple, cache: str) -> dict:
    here = str(Path(__file__).parent)
    code = ("import json, sys, warnings, torch; warnings.simplefilter('error'); "
            "from cula_core import cute_runtime as rt; import cute_runtime_probe as p; "
            f"art = rt.resolve(p.NAME, {config!r}); fn = rt.get(p.NAME, {config!r}); "
            "print(json.dumps({'origin': art.origin, 'dsl': 'cutlass' in sys.modules, 'fn': type(fn).__name__}))")
    env = dict(os.environ, CULA_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([here, *sys.path]))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jit_compiles_once_into_the_cache(probe, tmp_path):
    a, b = (torch.float32,), (torch.bfloat16,)
    assert rt.resolve(probe.NAME, a) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fa = rt.get(probe.NAME, a)
        fb = rt.get(probe.NAME, b)
    notices = [w for w in caught if issubclass(w.category, rt.JitCompileWarning)]
    assert len(notices) == 1 and probe.NAME in str(notices[0].message)
    assert rt.get(probe.NAME, a) is fa and fb is not fa
    art = rt.resolve(probe.NAME, a)
    assert art.origin == "cached" and art.path.startswith(str(tmp_path / "cache"))
    assert {(x.name, x.config) for x in rt.listing() if x.origin == "cached"} == {
        (probe.NAME, rt.registry.config_text(a)), (probe.NAME, rt.registry.config_text(b))}
    # the launch's arguments are checked against the compiled signature before anything runs
    with pytest.raises(TypeError, match="Expects 4 parameters"):
        fa(16, 1)
    # another process: loaded from the cache, no notice (warnings are errors there), no DSL import
    assert _fresh_process_loads(a, str(tmp_path / "cache")) == {"origin": "cached", "dsl": False, "fn": "Function"}


def test_shipped_artifacts_are_found_without_compiling(probe, tmp_path, monkeypatch):
    """Artifacts built, linked and described as the wheel's build hook does, in a package's _aot/ folder: resolved
    as shipped, loaded with no compile (the cache stays empty); a changed kernel source invalidates them."""
    pkg = tmp_path / "site" / "culaaotprobe"
    out = pkg / rt.registry.AOT_FOLDER
    out.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    name = probe.register(package="culaaotprobe", name="probe.shipped_fill")
    items = [(name, (torch.float32,)), (name, (torch.bfloat16,))]
    objects = rt.build_objects(items, tmp_path / "obj", jobs=1)  # probe.shipped_fill is registered here only
    rt.link_library(objects, out / rt.registry.LIBRARY)
    kdef = rt.kernel_def(name)
    rt.write_manifest(out, kdef.distribution, version(kdef.distribution), kdef.arch, items)
    rt.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", rt.JitCompileWarning)
        for item in items:
            art = rt.resolve(*item)
            assert art.origin == "shipped" and art.path == str(out / rt.registry.LIBRARY)
            assert type(rt.get(*item)).__name__ == "Function"
    assert not (tmp_path / "cache").exists()
    assert {x.config for x in rt.listing() if x.origin == "shipped" and x.name == name} == \
        {rt.registry.config_text(c) for _, c in items}
    assert rt.resolve(name, (torch.float16,)) is None  # neither shipped nor cached
    # a manifest built from another kernel source is not used
    manifest = json.loads((out / rt.registry.MANIFEST).read_text())
    for entry in manifest["kernels"].values():
        entry["source_hash"] = "0" * 64
    (out / rt.registry.MANIFEST).write_text(json.dumps(manifest))
    rt.reset()
    assert rt.resolve(*items[0]) is None


@pytest.mark.gpu
def test_probe_launches_on_the_current_stream(probe):
    """On a GPU: the loaded function runs, on torch's current stream, with the values passed."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = torch.full((1000,), -1.0, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        probe.fill(out[:777], 0.5)
    side.synchronize()
    expect = torch.full((1000,), -1.0)
    expect[:777] = torch.arange(777, dtype=torch.float32) + 0.5
    torch.testing.assert_close(out.cpu(), expect, rtol=0, atol=0)
