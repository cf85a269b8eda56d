"""jaxkv: KV-cached decoding for decoder-only transformers in JAX."""

from jaxkv.cache import KVCache
from jaxkv.checkpoint import load, save
from jaxkv.config import PRESETS, Config, RopeScaling
from jaxkv.generate import Generation, decode, decode_step, generate, generate_pmap, prefill
from jaxkv.memory import kv_cache_bytes
from jaxkv.model import Decoder, Model, logits
from jaxkv.sampling import Sampler

__all__ = ["Config", "Decoder", "Generation", "KVCache", "Model", "PRESETS", "RopeScaling", "Sampler", "decode",
           "decode_step", "generate", "generate_pmap", "kv_cache_bytes", "load", "logits", "prefill", "save"]
