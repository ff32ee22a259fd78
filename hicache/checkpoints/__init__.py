"""Hugging Face-format checkpoints: config.json read into the engine's fields (``hf_config``, no
torch) and the safetensors loader with its weights signature (``hf``). Above the engine's compute
core: it builds engine models; the engine imports nothing from here."""
