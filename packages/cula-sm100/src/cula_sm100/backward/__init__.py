"""cula_sm100.backward: no kernels yet; serves no op (see its issue)."""

OPS: tuple[str, ...] = ()


def unsupported_reason(call) -> str | None:
    return f"sm100 does not implement {call.op}"


def kernel(op: str):
    raise NotImplementedError(f"sm100 has no kernel for {op}")
