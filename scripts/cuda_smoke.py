"""Device smoke check: driver, ABI, host-registration query, one staged round trip (prints facts)."""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

from kvflow.backends.cuda import driver as drv
from kvflow.backends.probe import probe_cuda


def main() -> None:
    import numpy as np
    import torch

    print(probe_cuda())
    torch.cuda.init()  # type: ignore[no-untyped-call]
    ctx = drv.Context(0)
    print("driver", ctx.driver_version, "abis", drv.choose_abi(ctx.driver_version))
    print("priority range", drv.check(cu.cuCtxGetStreamPriorityRange(), "range"))
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    pinned: Any = cu.cuMemHostGetFlags(ptr)
    print("unregistered: cuMemHostGetFlags", pinned[0])
    drv.check(cu.cuMemHostRegister(ptr, 1 << 20, 0), "register")
    print("registered: cuMemHostGetFlags", cu.cuMemHostGetFlags(ptr)[0])
    drv.check(cu.cuMemHostUnregister(ptr), "unregister")
    print("after unregister: cuMemHostGetFlags", cu.cuMemHostGetFlags(ptr)[0])


if __name__ == "__main__":
    main()
