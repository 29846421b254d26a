"""A tiny CuTe DSL kernel registered with cula_core.cute_runtime as "probe.fill" (tests of the runtime: JIT, cache,
shipped artifacts, and on a GPU the launch itself): out[i] = value + i for i < n, one thread per element."""


import torch

from cula_core import cute_runtime as rt

NAME = "probe.fill"
THREADS = 128


class Fill:
    @staticmethod
    def _kernel_cls():
        import cutlass.cute as cute
        from cutlass import Float32, Int32

        class _Fill:
            @cute.jit
            def __call__(self, out: cute.Pointer, n: Int32, value: Float32, stream):
                self.kernel(out, n, value).launch(grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1],
                                                  stream=stream)

            @cute.kernel
            def kernel(self, out: cute.Pointer, n: Int32, value: Float32):
                i = cute.arch.block_idx()[0] * THREADS + cute.arch.thread_idx()[0]
                if i < n:
                    dst = cute.make_tensor(out + i, cute.make_layout(1))
                    dst[0] = (value + Float32(i)).to(out.dtype)

        return _Fill


def build(config):
    (dtype,) = config
    import cutlass

    return Fill._kernel_cls()(), (rt.fake_ptr(dtype, 4), cutlass.Int32(1), cutlass.Float32(0.0), rt.fake_stream())


def register(package: str = "cula_core", name: str = NAME) -> str:
    rt.register(rt.KernelDef(name, "cula-core", package, "sm_90a", build, ("cute_runtime_probe",)))
    return name


register()


def fill(out: torch.Tensor, value: float) -> None:
    rt.get(NAME, (out.dtype,))(out.data_ptr(), out.numel(), value, rt.current_stream(out.device))
