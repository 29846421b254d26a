"""The code reaches CuTe DSL (nvidia-cutlass-dsl: `cutlass`, `cutlass.cute`) and cuda-python (`cuda`) through
their public API only: a private module or attribute can change or vanish in any release of the DSL.

The scan reads every Python file of the packages' sources (packages/*/src), tools/ and tests/ with `ast` (nothing
is imported) and reports each
  * import of a DSL module whose dotted path has a component starting with "_" (`cutlass._mlir.dialects`), or of
    an `_name` from a DSL module;
  * attribute `_name` (not a dunder) in a chain rooted at a name the file binds to a DSL module or to an object
    imported from one (`cute._x`, `cutlass.cute.arch._y`), and getattr / setattr / hasattr / delattr of a string
    `_name` on such a chain;
  * attribute named like the DSL's compiled-function internals (`_default_executor`, `_get_invoke_packed_args`)
    on anything: those objects come from calls (`cute.compile(...)`), so no import binds them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pkgtest import REPO_ROOT, names_bound_by_imports, private_attribute_uses, private_imports

DSL_ROOTS = ("cutlass", "cuda")
# Private members of the DSL's compiled functions, reached through call results that no import binds.
COMPILED_FUNCTION_INTERNALS = {"_default_executor", "_get_invoke_packed_args"}


def is_dsl_module(dotted: str) -> bool:
    return dotted.split(".")[0] in DSL_ROOTS


def private_dsl_uses(source: str, label: str) -> list[str]:
    """Every private DSL use in `source` (a module's text), as "label:line: what"."""
    tree = ast.parse(source, filename=label)
    found = private_imports(tree, is_dsl_module)
    found += private_attribute_uses(tree, names_bound_by_imports(tree, is_dsl_module))
    found += [(node, ast.unparse(node)) for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr in COMPILED_FUNCTION_INTERNALS]
    return list(dict.fromkeys(f"{label}:{node.lineno}: {what}" for node, what in found))


def scanned_files(root: Path) -> list[Path]:
    """The packages' sources, tools/ and tests/ under `root` (build folders left out)."""
    tops = [*sorted((root / "packages").glob("*/src")), root / "tools", root / "tests"]
    return sorted(p for top in tops for p in top.rglob("*.py") if "build" not in p.relative_to(root).parts)


def private_dsl_uses_under(root: Path) -> list[str]:
    return [use for path in scanned_files(root)
            for use in private_dsl_uses(path.read_text(), str(path.relative_to(root)))]


def test_no_private_dsl_name_is_used():
    files = scanned_files(REPO_ROOT)
    assert any(p.name == "kvbuffer_verify.py" for p in files), "the scan no longer reaches the decode kernels"
    found = private_dsl_uses_under(REPO_ROOT)
    assert not found, "private CuTe DSL / cuda-python names used:\n" + "\n".join(found)


@pytest.mark.parametrize(("line", "what"), [
    ("from cutlass._mlir.dialects import llvm", "from cutlass._mlir.dialects import ..."),
    ("import cutlass._mlir.ir as ir", "import cutlass._mlir.ir"),
    ("import cuda.bindings._lib.utils", "import cuda.bindings._lib.utils"),
    ("from cutlass.cute import _pack_shape", "from cutlass.cute import _pack_shape"),
    ("import cutlass.cute as cute\ncute.nvgpu._helper()", "cute.nvgpu._helper"),
    ("from cutlass import Float32\nFloat32._mlir_type", "Float32._mlir_type"),
    ("import cutlass\ngetattr(cutlass.cute, '_hidden')", "getattr(cutlass.cute, '_hidden')"),
    ("import cutlass.cute as cute\nmonkeypatch.setattr(cute.arch, '_x', None)", "setattr(cute.arch, '_x')"),
    ("fn = compile_it()\nfn._default_executor._get_invoke_packed_args(1)", "fn._default_executor"),
])
def test_the_scan_catches_each_form(line, what):
    assert what in [use.split(": ", 1)[1] for use in private_dsl_uses(line, "sample.py")]


def test_public_forms_are_not_reported():
    sample = (
        "import cutlass\n"
        "import cutlass.cute as cute\n"
        "from cutlass import Float32, TFloat32\n"
        "from cutlass.cute.runtime import from_dlpack\n"
        "import torch\n"
        "cutlass.__version__\n"
        "cute.arch.cvt_f32_tf32(Float32(1.0))\n"
        "cute.nvgpu.warp.MmaTF32Op((16, 8, 8))\n"
        "torch._C\n"
        "self._kernel\n"
        "getattr(cute.arch, 'lane_idx')\n"
        "from ._local import helper\n"
    )
    assert private_dsl_uses(sample, "sample.py") == []


def test_the_scan_walks_the_package_sources_tools_and_tests(tmp_path):
    """A private use in any scanned place is reported with its path; build folders are left out."""
    for rel in ("packages/cula-x/src/cula_x/k.py", "tools/t.py", "tests/sm90/u.py", "packages/cula-x/build/b.py",
                "packages/cula-x/src/cula_x/build/b.py"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("import cutlass\ncutlass._x\n")
    assert sorted(use.split(":")[0] for use in private_dsl_uses_under(tmp_path)) == [
        "packages/cula-x/src/cula_x/k.py", "tests/sm90/u.py", "tools/t.py"]
