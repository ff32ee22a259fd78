"""Import-only placeholder for torchvision in the engine test environment.

SGLang 0.5.23's mem_cache imports sglang.srt.configs, which imports torchvision at module level
for a multimodal model config (InternVL image transforms). This project never installs
torchvision (its wheels pin a CUDA torch), and no path the engine tests run calls it, so
tests/engines/conftest.py puts this placeholder on sys.path when no torchvision is installed.
Anything used from it raises."""
