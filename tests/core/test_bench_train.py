"""tools/bench/train.py on the CPU: its shards partition the grid with balanced costs; FLA's compile before the rows
(processes, configuration parts, compile classes); retune reaching FLA's autotuners."""

import pytest

from tools.bench import grid, train


def test_compile_in_parallel_runs_each_call_in_its_own_process(tmp_path):
    from tools.bench import fla_tuning

    marks = [str(tmp_path / f"mark{i}") for i in range(3)]
    seconds, failed = fla_tuning.compile_in_parallel("os", "mkdir", [(m,) for m in marks[:2]])
    assert failed == [] and seconds >= 0
    assert [(tmp_path / f"mark{i}").exists() for i in range(3)] == [True, True, False]
    _, failed = fla_tuning.compile_in_parallel("sys", "exit", [(0,), (3,)])
    assert failed == [(3,)]


def test_compile_in_parallel_bounds_the_processes_and_spreads_them_over_gpus(tmp_path):
    from tools.bench import fla_tuning

    calls = [(f"echo $CUDA_VISIBLE_DEVICES > {tmp_path / f'gpu{i}'}",) for i in range(5)]
    _, failed = fla_tuning.compile_in_parallel("os", "system", calls, jobs=2, devices=["3", "5"])
    assert failed == []
    assert [(tmp_path / f"gpu{i}").read_text().strip() for i in range(5)] == ["3", "5", "3", "5", "3"]


class _Tuner:
    def __init__(self, n, prune=None):
        self.configs = [f"c{i}" for i in range(n)]
        self.early_config_prune = prune


def test_restrict_configs_splits_every_tuner_over_the_parts():
    from tools.bench import fla_tuning

    sizes, parts = (1, 3, 7, 12), 4
    seen = {n: [] for n in sizes}
    for part in range(parts):
        tuners = [_Tuner(n) for n in sizes]
        assert fla_tuning.restrict_configs(part, parts, tuners) == len(sizes)
        for t, n in zip(tuners, sizes):
            assert t.configs, (n, part)  # every process runs its kernels
            seen[n] += t.configs
    # between them the parts compile every configuration, and a tuner with enough of them splits evenly
    assert all(set(seen[n]) == {f"c{i}" for i in range(n)} for n in sizes)
    assert sorted(seen[12]) == sorted(f"c{i}" for i in range(12))
    pruning = _Tuner(5, prune=lambda configs, nargs: configs)  # may prune a part empty: left whole
    assert fla_tuning.restrict_configs(1, parts, [pruning, _Tuner(5)]) == 1
    assert len(pruning.configs) == 5
    for bad in ((4, 4), (-1, 4)):
        with pytest.raises(ValueError, match="part"):
            fla_tuning.restrict_configs(*bad, [])


def test_warm_calls_one_shape_per_compile_class():
    from tools.bench import fla_tuning

    calls = fla_tuning.warm_calls(train.GRID, train.compile_class, jobs=64)
    classes = {train.compile_class(s) for s in train.GRID}
    assert len(classes) == 9  # B x (H, HV) pairs, and the varlen rows
    parts = 64 // len(classes)
    assert len(calls) == len(classes) * parts
    assert {train.compile_class(s) for s, _, _ in calls} == classes
    assert all(n == parts for _, _, n in calls)
    assert sorted((train.compile_class(s), j) for s, j, _ in calls) == sorted(
        (c, j) for c in classes for j in range(parts))
    # at least one part per class
    assert len(fla_tuning.warm_calls(train.GRID, train.compile_class, jobs=4)) == len(classes)


def test_shards_partition_the_grid():
    n = 4
    shards = [grid.shard(train.GRID, f"{i}/{n}", train.shape_cost) for i in range(n)]
    labels = [train.label(s) for part in shards for s in part]
    assert sorted(labels) == sorted(train.label(s) for s in train.GRID)
    assert len(set(labels)) == len(labels)
    order = {train.label(s): j for j, s in enumerate(train.GRID)}
    assert all([order[train.label(s)] for s in part] == sorted(order[train.label(s)] for s in part) for part in shards)
    # balanced: the costliest part within 10% of the mean
    costs = [sum(train.shape_cost(s) for s in part) for part in shards]
    assert max(costs) <= 1.1 * sum(costs) / n, costs


def test_kernel_chain_reaches_an_autotuner_under_heuristics():
    """FLA's kernels are heuristics(autotune(jit(fn))): retune and restrict_configs must reach the autotuner in the
    middle (each wrapper keeps the next in `.fn`), and stop at the Python function."""
    from tools.bench import fla_tuning

    def body():
        pass

    class Wrapper:
        def __init__(self, fn):
            self.fn = fn

    jit = Wrapper(body)
    tuner = Wrapper(jit)
    heuristics = Wrapper(tuner)
    assert fla_tuning.kernel_chain(heuristics) == [heuristics, tuner, jit]
    assert fla_tuning.kernel_chain(body) == [] and fla_tuning.kernel_chain(fla_tuning) == []
    loop = Wrapper(None)
    loop.fn = loop  # a cycle ends at the limit
    assert len(fla_tuning.kernel_chain(loop)) == 8


@pytest.mark.gpu
def test_retune_reaches_flas_chunk_kernels():
    """On a machine with FLA (the GPU kit): the autotuners retune resets include those of FLA's chunked KDA kernels,
    which sit under triton.heuristics (the state recurrence and the intra-chunk kernels among them)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FLA's import probes the device)")
    pytest.importorskip("fla")
    from fla.ops.common import chunk_delta_h
    from fla.ops.kda import chunk_intra, wy_fast
    from triton.runtime.autotuner import Autotuner

    from tools.bench import fla_tuning

    found = {id(t) for t in fla_tuning.autotuners()}
    kernels = (chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
               chunk_intra.chunk_kda_fwd_kernel_inter_solve_fused, wy_fast.recompute_w_u_fwd_kda_kernel)
    inner = [[t for t in fla_tuning.kernel_chain(k) if isinstance(t, Autotuner)] for k in kernels]
    assert all(len(tuners) == 1 and id(tuners[0]) in found for tuners in inner)
    assert fla_tuning.retune() == len(found) >= 10
