"""On paper: Llama-2-7B and -70B trained under FSDP2 on 64 GPUs, dense vs 90% compressed.

    python3 benchmarks/fsdp_at_scale.py                  # the markdown tables of docs/distributed.md
    python3 benchmarks/fsdp_at_scale.py --gpus 128 --tokens 16384 --json out.json

Everything follows from the shapes, the settings below and the formulas (no measurement):

- Parameters: per decoder layer ``q, o: h^2``, ``k, v: h * kv`` (``kv = kv_heads * h /
  heads``), ``gate, up, down: h * i``, 2 norms of ``h``; embeddings and LM head ``V * h`` each;
  the final norm ``h``. The layers' Linear weights are the prunable ones (embeddings and LM
  head denied, as in the examples); compressed at sparsity ``s`` with 128x128 blocks a
  weight keeps ``round((1 - s) * blocks)`` blocks of ``128 * 128`` values.
- Communication per GPU per step, FSDP2 as benchmarks/e2e_distributed.py runs it (each
  decoder layer one unit, the rest the root; parameters gathered in bf16, gradients
  reduce-scattered in fp32): all-gather ``(2 P_layers + P_root) * 2 B``, reduce-scatter
  ``P * 4 B``, of which each GPU sends and receives ``(N - 1) / N``. HSDP (shards inside a
  node of ``G`` GPUs, replicas across the ``M = N / G`` nodes) moves the same inside the node
  (over NVLink, with ``N`` read as ``G``) and across nodes only the all-reduce of each GPU's
  gradient shard: ``2 * (P / G) * 4 B * (M - 1) / M``. Time at ``--inter-gbs`` (one 400 Gb/s
  NIC per GPU: 50 GB/s) for what crosses nodes; beside it the dense step's matmul time,
  ``6 P T`` FLOPs for ``T`` tokens at ``--tflops``, the compute that could hide it.
- Memory per GPU: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, each
  ``4 P / shards`` bytes; two decoder layers gathered in bf16 (the one computing and the one
  prefetched); activations of ``--tokens`` tokens per GPU in bf16: per token and layer
  ``(18 h + 4 kv + 8 i)`` bytes (norm inputs kept in fp32, the q/k/v/o and MLP inputs and
  outputs; FlashAttention keeps no score matrix), or with activation checkpointing the layer
  inputs (``2 h`` bytes per token and layer) plus one layer's activations recomputed; the
  logits ``V`` per token in bf16 and fp32 (the loss upcasts) and their gradient. Compressed
  layers keep the dense layers' activations (the inputs and outputs are the same tensors).
- Checkpoint: fp32 parameters and AdamW's two moments, ``12 P`` bytes, plus the block masks
  (1 byte per block) of the compressed layers.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from _common import at_least

BLOCK = 128
GB = 1e9


@dataclass(frozen=True)
class LlamaShape:
    """A Llama's shapes: hidden ``h``, MLP ``i``, attention and KV heads, layers, vocabulary."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int

    @property
    def kv(self) -> int:
        """Rows of the k and v projections: ``kv_heads * head_dim``."""
        return self.kv_heads * self.hidden // self.heads

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of one decoder layer's Linear weights: q, k, v, o, gate, up, down."""
        h, i, kv = self.hidden, self.intermediate, self.kv
        return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]


MODELS = {
    "7B": LlamaShape("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000),
    "70B": LlamaShape("Llama-2-70B", 8192, 28672, 64, 8, 80, 32000),
}


def kept_values(out: int, inp: int, sparsity: float) -> tuple[int, int]:
    """(values, blocks) a compressed ``out x inp`` weight stores at ``sparsity``; the dense
    weight's (numel, 0) at sparsity 0."""
    if sparsity == 0:
        return out * inp, 0
    blocks = -(-out // BLOCK) * -(-inp // BLOCK)
    return max(1, round((1 - sparsity) * blocks)) * BLOCK * BLOCK, blocks


def parameters(model: LlamaShape, sparsity: float) -> dict[str, int]:
    """Trained parameters in the decoder layers and in the root (embeddings, final norm,
    LM head), and the block masks' bytes, at ``sparsity`` (0: dense)."""
    weights = [kept_values(out, inp, sparsity) for out, inp in model.linear_shapes()]
    layer = sum(v for v, _ in weights) + 2 * model.hidden
    return {"layers": model.layers * layer,
            "root": 2 * model.vocab * model.hidden + model.hidden,
            "mask_bytes": model.layers * sum(b for _, b in weights)}


def activation_bytes(model: LlamaShape, tokens: int, checkpointing: bool) -> float:
    """Activations kept for the backward of ``tokens`` tokens (module doc)."""
    h, kv, i = model.hidden, model.kv, model.intermediate
    per_layer = (18 * h + 4 * kv + 8 * i) * tokens
    logits = model.vocab * tokens * (2 + 4 + 4)  # bf16 logits, fp32 upcast, fp32 gradient
    if checkpointing:
        return model.layers * 2 * h * tokens + per_layer + logits
    return model.layers * per_layer + logits


def estimate(model: LlamaShape, sparsity: float, gpus: int, gpus_per_node: int, tokens: int,
             checkpointing: bool, inter_gbs: float, tflops: float) -> dict:
    """One row: communication, memory per GPU and checkpoint size (module doc), and the
    dense model's matmul time at ``tflops`` for scale."""
    p, dense = parameters(model, sparsity), parameters(model, 0)
    total = p["layers"] + p["root"]
    layer = p["layers"] // model.layers
    fsdp_gather = (2 * p["layers"] + p["root"]) * 2 * (gpus - 1) / gpus
    fsdp_scatter = total * 4 * (gpus - 1) / gpus
    nodes = gpus // gpus_per_node
    hsdp_inter = 2 * total / gpus_per_node * 4 * (nodes - 1) / nodes
    gathered = 2 * layer * 2  # two layers in bf16
    activations = activation_bytes(model, tokens, checkpointing)

    def memory(shards: int) -> float:
        return (16 * total / shards + gathered + activations + p["mask_bytes"]) / GB

    return {
        "model": model.name, "sparsity": sparsity, "gpus": gpus, "tokens_per_gpu": tokens,
        "activation_checkpointing": checkpointing,
        "parameters_b": total / 1e9, "prunable_kept_b": p["layers"] / 1e9,
        "fsdp_all_gather_gb": fsdp_gather / GB, "fsdp_reduce_scatter_gb": fsdp_scatter / GB,
        "fsdp_inter_node_s": (fsdp_gather + fsdp_scatter) / GB / inter_gbs,
        "dense_compute_s": 6 * (dense["layers"] + dense["root"]) * tokens / (tflops * 1e12),
        "hsdp_inter_node_gb": hsdp_inter / GB, "hsdp_inter_node_s": hsdp_inter / GB / inter_gbs,
        "states_fsdp_gb": 16 * total / gpus / GB, "activations_gb": activations / GB,
        "memory_fsdp_gb": memory(gpus), "memory_hsdp_gb": memory(gpus_per_node),
        "checkpoint_gb": (12 * total + p["mask_bytes"]) / GB,
    }


def tables(rows: list[dict]) -> str:
    """The rows as two markdown tables: traffic, then memory and checkpoint."""
    def name(r: dict) -> str:
        sparsity = r["sparsity"]
        return f"{r['model']} " + (f"{sparsity:.0%} compressed" if sparsity else "dense")

    traffic = ["| model | parameters (B) | FSDP all-gather GB | FSDP reduce-scatter GB | "
               "FSDP inter-node s | HSDP inter-node GB | HSDP inter-node s | dense matmuls s |",
               "|---|---|---|---|---|---|---|---|"]
    memory = ["| model | activation checkpointing | states (FSDP) GB | activations GB | "
              "memory per GPU, FSDP GB | memory per GPU, HSDP GB | checkpoint GB |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["activation_checkpointing"]:
            traffic.append(
                f"| {name(r)} | {r['parameters_b']:.2f} | {r['fsdp_all_gather_gb']:.1f} | "
                f"{r['fsdp_reduce_scatter_gb']:.1f} | {r['fsdp_inter_node_s']:.2f} | "
                f"{r['hsdp_inter_node_gb']:.2f} | {r['hsdp_inter_node_s']:.3f} | "
                f"{r['dense_compute_s']:.2f} |")
        memory.append(
            f"| {name(r)} | {'yes' if r['activation_checkpointing'] else 'no'} | "
            f"{r['states_fsdp_gb']:.1f} | {r['activations_gb']:.1f} | {r['memory_fsdp_gb']:.1f} "
            f"| {r['memory_hsdp_gb']:.1f} | {r['checkpoint_gb']:.1f} |")
    return "\n".join(traffic) + "\n\n" + "\n".join(memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=at_least(1), default=64)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4 * 2048, help="tokens per GPU per step")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--inter-gbs", type=float, default=50.0,
                        help="GB/s per GPU between nodes (400 Gb/s InfiniBand per GPU)")
    parser.add_argument("--tflops", type=float, default=400.0,
                        help="bf16 TFLOP/s a GPU sustains on the dense matmuls (H100: 40%% "
                             "of its 989 peak)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.gpus % args.gpus_per_node:
        raise SystemExit(f"--gpus {args.gpus} is not a multiple of --gpus-per-node "
                         f"{args.gpus_per_node}")
    rows = [estimate(model, sparsity, args.gpus, args.gpus_per_node, args.tokens, checkpointing,
                     args.inter_gbs, args.tflops)
            for model in MODELS.values() for checkpointing in (False, True)
            for sparsity in (0.0, args.sparsity)]
    print(f"{args.gpus} GPUs ({args.gpus // args.gpus_per_node} nodes x {args.gpus_per_node}), "
          f"{args.tokens} tokens per GPU per step, bf16 gathers, fp32 gradient reduction, "
          f"AdamW; per GPU per step; {args.inter_gbs:g} GB/s per GPU between nodes\n")
    print(tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "models": {k: asdict(m) for k, m in MODELS.items()},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
