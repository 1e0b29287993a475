"""Which models fail under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), one
fresh process per case, with dense controls beside them (GPU only).

    python3 benchmarks/reduce_overhead_probe.py            # every case, a short report each
    python3 benchmarks/reduce_overhead_probe.py semi_twin  # one case

Cases: a layer (``linear``, ``masked_mul`` = ``F.linear(x, W * M)``, ``semi`` 2:4, ``block``)
trained 4 steps compiled; ``semi_twin`` adds an eager twin's forward and backward between
the compiled ones (as tests/test_gpu.py does); ``block_then_semi`` runs both in one
process; ``trainer_*``: a small HF BERT QA through ``pl.Trainer`` (tests/tiny_hf.py's
``TinyHF``), dense or compressed.
"""
import copy
import subprocess
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn

CASES = ["linear", "masked_mul", "semi", "semi_twin", "block", "block_then_semi", "trainer_dense",
         "trainer_block", "trainer_2:4"]


class MaskedMul(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.register_buffer("mask", torch.rand_like(lin.weight) > 0.5)

    def forward(self, x):
        return F.linear(x.reshape(-1, 256), self.weight * self.mask, self.bias).view(*x.shape[:-1], 128)


def layer_case(name):
    if name == "block_then_semi":
        layer_case("block")
        return layer_case("semi")
    from sparse_training import BlockSparseLinear, SemiStructuredLinear
    torch.manual_seed(0)
    if name == "block":
        layer = nn.Sequential(BlockSparseLinear.from_dense(nn.Linear(200, 136), (64, 64), density=0.5), nn.GELU()).cuda()
        shape = (2, 64, 200)
    else:
        lin = nn.Linear(256, 128)
        layer = {"linear": lambda: lin, "masked_mul": lambda: MaskedMul(lin)}.get(name, lambda: SemiStructuredLinear.from_dense(lin))().cuda()
        shape = (96, 256)
    eager = layer if name == "semi_twin" else None
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, mode="reduce-overhead")
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(*shape, device="cuda")
        print(f"  step {step}: forward", flush=True)
        with torch.autocast("cuda", torch.bfloat16):
            want = eager(x) if eager is not None else None
            got = compiled(x).clone()
        print(f"  step {step}: backward", flush=True)
        if want is not None:
            want.float().sum().backward()
        got.float().sum().backward()
        for p in twin.parameters():
            assert p.grad is not None
            p.grad = None
    print("  OK")


def trainer_case(name):
    sys.path.insert(0, "tests")
    import test_gpu as T
    from tiny_hf import TinyHF, hf_loader

    from sparse_training import SparsityCallback
    torch._dynamo.reset()
    model = TinyHF("reduce-overhead")
    settings = {"trainer_block": dict(pattern="block:64x64", sparsity=0.9),
                "trainer_2:4": dict(pattern="2:4")}.get(name)
    cbs = [] if settings is None else [SparsityCallback(**settings, compress=True,
                                                        deny=["embeddings", "qa_outputs"])]
    trainer = T.gpu_trainer(cbs)
    trainer.fit(model, hf_loader())
    print("  losses", [round(v, 3) for v in model.losses])
    print("  OK")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        name = sys.argv[1]
        if name not in CASES:
            sys.exit(f"reduce_overhead_probe: unknown case {name!r}; cases: {list(CASES)}")
        try:
            (trainer_case if name.startswith("trainer") else layer_case)(name)
        except Exception as e:
            print("  FAIL", type(e).__name__, str(e)[:300])
            print("\n".join(traceback.format_exc().splitlines()[-40:]))
        sys.exit(0)
    for name in CASES:
        print(f"== {name}", flush=True)
        try:
            p = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                               timeout=150)
        except subprocess.TimeoutExpired as e:
            print("  HUNG (killed after 150 s)", (e.stdout or b"")[-1500:], flush=True)
            continue
        print(p.stdout[-4000:], p.stderr[-600:] if "FAIL" in p.stdout or p.returncode else "",
              flush=True)
