"""Two autotuned kernels made of the stand-ins in ``fake_triton``: a plain ``triton.autotune`` one and one wrapped
the way exllamav3's vendored fla kernels are (heuristics over a per-device-kind autotuner). Tests reload this
module for a fresh set, as a new process would have."""

from tests.engine.exl3.fake_triton import (
    FakeAutotuner,
    FakeConfig,
    FakeDeviceAutotune,
    FakeHeuristics,
    FakeJIT,
)

SCALE_CONFIGS = [FakeConfig({"BLOCK": b}, num_warps=w) for b in (32, 64) for w in (2, 4)]




def _norm_configs(kind):
    # like fla's: the candidates depend on the device kind
    stages = [2, 3] if kind[1] >= 9 else [1]
    return [FakeConfig({"BT": bt}, num_warps=w, num_stages=s) for bt in (16, 32) for w in (1, 2) for s in stages]


# each name is bound to its wrapper, as the decorators bind it
def scale_kernel(x, N, BLOCK):
    pass


scale_kernel = FakeAutotuner(FakeJIT(scale_kernel), SCALE_CONFIGS, key=["N"])


def norm_kernel(x, y, D, NB, IS_VARLEN, BT):
    pass


norm_kernel = FakeHeuristics(FakeDeviceAutotune(FakeJIT(norm_kernel), {"configs": _norm_configs, "key": ["D", "NB"]}),
                             {"IS_VARLEN": lambda args: False})
