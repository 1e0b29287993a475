"""Decoder layer shapes the benchmarks share (Llama-style: ``LlamaConfig``'s hidden and
intermediate sizes, attention heads and KV heads), so that a model named in two benchmarks is
one model. Pure data: importing it costs nothing."""

from __future__ import annotations

DECODER_SHAPES: dict[str, dict[str, int]] = {
    # Llama-3-8B's layers
    "llama-3-8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8),
    # Qwen2-1.5B's layers
    "qwen2-1.5b": dict(hidden=1536, intermediate=8960, heads=12, kv_heads=2),
    # time_to_quality.py's base model (e2e_step.py's decoder-2048)
    "hidden-2048": dict(hidden=2048, intermediate=5632, heads=16, kv_heads=16),
    "tiny": dict(hidden=128, intermediate=256, heads=4, kv_heads=2),
}
