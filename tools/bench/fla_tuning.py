"""FLA at its best in the timing process: Triton's autotuning redone on the exact shape that is timed.

FLA 0.6.0 autotunes its kernels on keys that leave out the sequence length and the batch (e.g. `H, K, BT`), and
by default stores the chosen configurations on disk (`FLA_CACHE_RESULTS=1`), so a configuration picked on one
shape, in one process, is silently reused for another shape or a later run. The benchmarks compare against FLA
tuned on the shape being timed, in the process that times it:

    from tools.bench import fla_tuning
    fla_tuning.prepare()           # before FLA is imported
    ...
    fla_tuning.retune()            # before the first FLA call on each new shape: forget every choice
    fla_fn(**inputs)               # this call tunes on the shape (compiled kernels are reused; only tuning reruns)

`prepare` also sets `FLA_FLASH_KDA=0`, so FLA runs its own Triton kernels rather than dispatching inference calls
to FlashKDA (which the prefill benchmark times in a column of its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fla_modules():
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))]


def prepare() -> None:
    """Turn off FLA's on-disk autotune cache and its FlashKDA dispatch. Must run before `fla` is imported
    (FLA reads both variables at import)."""
    if _fla_modules():
        raise RuntimeError("fla_tuning.prepare() must run before fla is imported (FLA reads its settings at import)")
    os.environ["FLA_CACHE_RESULTS"] = "0"
    os.environ["FLA_FLASH_KDA"] = "0"


def kernel_chain(value, limit: int = 8) -> list:
    """`value` and the kernels it wraps, outermost first: Triton's kernel wrappers keep the wrapped one in `.fn`
    (FLA stacks `triton.heuristics` over its autotuner over `triton.jit`); the chain stops at a plain function, a
    module or a class."""
    chain = []
    while value is not None and len(chain) < limit and not isinstance(value, (types.FunctionType, types.ModuleType,
                                                                                   type)):
        chain.append(value)
        value = getattr(value, "fn", None)
    return chain


def autotuners() -> list:
    """Every Triton autotuner defined by an imported FLA module (FLA's own cached autotuner subclasses it), also
    under the `triton.heuristics` wrapper FLA puts over nearly every autotuned kernel."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for module in _fla_modules():
        for value in vars(module).values():
            for kernel in kernel_chain(value):
                if isinstance(kernel, Autotuner):
                    found[id(kernel)] = kernel
    return list(found.values())


def retune() -> int:
    """Forget the configurations FLA's autotuners chose in this process; returns how many autotuners were reset.
    The next call of each kernel benchmarks its configurations again, on that call's shape."""
    tuners = autotuners()
    for tuner in tuners:
        tuner.cache.clear()
    return len(tuners)


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def restrict_configs(part: int, parts: int, tuners: list | None = None) -> int:
    """Keep, in each autotuner (FLA's by default), every `parts`-th configuration from the `part`-th; a tuner with
    no configuration at that offset keeps its configuration `part % len`. For compile-only processes: `parts` of
    them, given parts 0 .. parts - 1, compile every configuration between them, each a `parts`-th of the serial
    work (the timing process, unrestricted, then finds them all in Triton's cache). A tuner that prunes its
    configurations by the call's arguments (`early_config_prune`) keeps them all: a part could be pruned empty.
    Returns how many tuners were restricted."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}: expected 0 <= part < parts")
    tuners = autotuners() if tuners is None else tuners
    restricted = 0
    for tuner in tuners:
        configs = list(tuner.configs)
        if configs and getattr(tuner, "early_config_prune", None) is None:
            tuner.configs = configs[part::parts] or [configs[part % len(configs)]]
            restricted += 1
    return restricted


def prepare_compile_part(part: int, parts: int) -> None:
    """Set up a compile-only process (a warm function's first step): `prepare`, FLA's KDA ops imported (which
    defines their autotuners), and every FLA autotuner narrowed to part `part` of `parts` (`restrict_configs`)."""
    prepare()
    import fla.ops.kda  # noqa: F401

    restrict_configs(part, parts)


def visible_gpus() -> list[str]:
    """This process's CUDA_VISIBLE_DEVICES entries (or the indices of its GPUs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def warm_calls(shapes: list[dict], compile_class, jobs: int) -> list[tuple]:
    """Arguments (shape, part, parts) of a warm function for `shapes`: one shape per compile class
    (`compile_class(shape)`: what FLA's compiled kernels of the shape depend on), each class's configurations cut
    into as many parts as `jobs` processes allow (at least one part per class)."""
    first_of_class = {}
    for s in shapes:
        first_of_class.setdefault(compile_class(s), s)
    parts = max(1, jobs // max(1, len(first_of_class)))
    return [(s, j, parts) for s in first_of_class.values() for j in range(parts)]


def warm(module: str, function: str, shapes: list[dict], compile_class, jobs: int) -> str:
    """Compile FLA's kernels for `shapes` before they are timed: `module.function(shape, part, parts)` (which runs
    FLA on a small cut of the shape after `prepare_compile_part(part, parts)`) for warm_calls' arguments, at most
    `jobs` processes at once, spread over the visible GPUs. Returns a line saying what it did."""
    calls = warm_calls(shapes, compile_class, jobs)
    seconds, failed = compile_in_parallel(module, function, calls, jobs=jobs, devices=visible_gpus())
    return f"FLA compiled for {len(shapes)} shapes ({len(calls)} processes): {seconds:.0f} s (failed: {failed})"


def compile_in_parallel(module: str, function: str, calls: list[tuple], jobs: int | None = None,
                        devices: list[str] | None = None) -> tuple[float, list]:
    """Run `module.function(*args)` for each `args` of `calls`, each in its own process, at most `jobs` at once
    (all at once by default), and wait for them. FLA's first call per autotuning key compiles every configuration
    of each kernel, serially (minutes in one process); processes in parallel fill Triton's on-disk compile cache,
    so the timing process then only tunes (its autotuners benchmark the already compiled configurations on the
    timed shape). `devices`: CUDA_VISIBLE_DEVICES values handed to the processes in turn (default: this process's
    GPUs). Autotune results those processes wrote to disk (made with the GPU shared) are deleted. The processes
    inherit this one's environment (run `prepare` first). Returns (seconds, the `args` whose process failed)."""
    t0 = time.perf_counter()
    before = set(triton_cache_dir().rglob("*.autotune.json"))
    pending = list(enumerate(calls))
    running, failed = [], []
    limit = max(1, jobs or len(calls))
    while pending or running:
        while pending and len(running) < limit:
            k, args = pending.pop(0)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[k % len(devices)]) if devices else None
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from {module} import {function}; "
                    f"{function}(*{args!r})")
            running.append((args, subprocess.Popen([sys.executable, "-c", code], env=env)))
        time.sleep(0.1)
        for args, proc in [r for r in running if r[1].poll() is not None]:
            running.remove((args, proc))
            if proc.returncode != 0:
                failed.append(args)
    for f in set(triton_cache_dir().rglob("*.autotune.json")) - before:
        f.unlink()
    return time.perf_counter() - t0, failed
