"""cula_core.cute_kernels, the device-side CuTe DSL helpers the arch packages' kernels share, keeps core cheap to
import and is the one home of the warp-level tensor-core and copy atoms.

Read from the source with `ast` (nothing imported), except the first test, which imports in a fresh interpreter:
  - importing cula_core, its CuTe runtime and the cute_kernels package itself pulls in no CuTe DSL;
  - in cula_core, only the cute_kernels modules import CuTe DSL (`cutlass`) at import time;
  - a module that imports a cute_kernels module is a kernel module: it imports CuTe DSL at import time itself
    (so no host-side module, e.g. a launcher or a backend, drags the DSL in through the helpers);
  - the instruction atoms the helpers wrap (mma.sync m16n8k16, ldmatrix, cp.async global -> shared) are built
    nowhere else, so no package grows a second copy of the helpers;
  - kernels built on the helpers list them among their runtime `sources` (whose text keys the disk cache and
    validates shipped artifacts), and every module a kernel lists exists.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

from test_import_graph import PACKAGES, import_time_statements, module_files, source_of

SHARED = "cula_core.cute_kernels"
ATOMS = ("MmaF16BF16Op", "LdMatrix8x8x16bOp", "CopyG2SOp", "make_smem_layout_atom")


def imports(path, at_import_time: bool) -> set[str]:
    """The absolute module names `path` imports (at import time only, or anywhere), `from a import b` as a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = import_time_statements(tree.body) if at_import_time else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imports_dsl(names: set[str]) -> bool:
    return any(n == "cutlass" or n.startswith("cutlass.") for n in names)


def all_modules():
    for root in PACKAGES:
        yield from module_files(source_of(root), root).items()


def test_core_and_the_helper_package_import_no_dsl():
    code = ("import sys, cula_core, cula_core.cute_runtime, cula_core.cute_kernels; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'cutlass'); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_only_the_helper_modules_import_the_dsl_in_core():
    modules = module_files(source_of("cula_core"), "cula_core")
    helpers = {name for name in modules if name.startswith(SHARED + ".")}
    assert {f"{SHARED}.warp_mma", f"{SHARED}.copies"} <= helpers
    dsl_at_import = {name for name, path in modules.items() if imports_dsl(imports(path, at_import_time=True))}
    assert dsl_at_import == helpers


def test_only_kernel_modules_import_the_helpers():
    users, wrong = [], []
    for name, path in all_modules():
        if name.startswith(SHARED):
            continue
        anywhere = imports(path, at_import_time=False)
        if not any(n == SHARED or n.startswith(SHARED + ".") for n in anywhere):
            continue
        users.append(name)
        if not imports_dsl(imports(path, at_import_time=True)):
            wrong.append(name)
    assert {"cula_sm90.prefill.chunk_state_wg", "cula_sm100.forward.fwd_o", "cula_sm100.backward.chunk_wy_dqkg"} \
        <= set(users)
    assert not wrong, f"modules importing {SHARED} without being CuTe DSL kernel modules: {wrong}"


def test_the_tensor_core_and_copy_atoms_are_built_only_in_the_helpers():
    outside = sorted(f"{name}: {atom}" for name, path in all_modules() if not name.startswith(SHARED)
                     for atom in ATOMS if atom in path.read_text())
    assert not outside, f"build these through {SHARED} instead of a copy: {outside}"


def test_kernels_built_on_the_helpers_list_them_as_sources():
    from cula_core import cute_runtime as rt
    from cula_sm90.prefill import forward as sm90_prefill
    from cula_sm100 import runtime as sm100
    from cula_sm100.backward import launch as sm100_backward
    from cula_sm100.forward import launch as sm100_forward

    mma_sync = {f"{SHARED}.warp_mma", f"{SHARED}.copies"}
    helpers = {sm90_prefill.INTRA: mma_sync, sm90_prefill.STATE: {f"{SHARED}.wgmma", f"{SHARED}.copies"},
               **{sm100.kernel_name(n, arch): mma_sync for n in (sm100_forward.FWD_O, sm100_backward.WY_DQKG)
                  for arch in sm100.ARCHS}}
    for name, needed in helpers.items():
        sources = rt.kernel_def(name).sources
        assert needed <= set(sources), (name, sources)
        missing = [m for m in sources if importlib.util.find_spec(m) is None]
        assert not missing, f"kernel {name} lists source modules that do not exist: {missing}"
