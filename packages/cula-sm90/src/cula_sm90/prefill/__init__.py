"""cula_sm90.prefill: no kernels yet; serves no op (see its issue)."""

OPS: tuple[str, ...] = ()


def unsupported_reason(call) -> str | None:
    return f"sm90 does not implement {call.op}"


def kernel(op: str):
    raise NotImplementedError(f"sm90 has no kernel for {op}")
