"""The Qwen3-MoE model family (``model.arch: qwen3_moe``): its row (family.py, torch-free), its model
(model.py, with the router, dispatch and experts of moe.py), its Hugging Face config and weight
adapter, its parallel plan, counts and the sampler's copy."""
