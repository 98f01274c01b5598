"""The model both sides of the KV crash test build (same seed, same fingerprint)."""

from durablekv.llm.model import TinyTransformer

BLOCK_SIZE = 4


def make_model() -> TinyTransformer:
    return TinyTransformer(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           head_dim=4, seed=11)
