"""The Qwen2.5-VL model family (``model.arch: qwen2_5_vl``): a vision tower whose merged patch
features replace the image placeholders of a Qwen2 language model with 3-D M-RoPE.

family.py holds the torch-free row and its ``model.qwen2_5_vl`` settings; the model is model.py
(the language model reuses models/qwen's blocks), vision.py the tower, positions.py the M-RoPE
positions, weights.py and hf_config.py the Hugging Face layout.
"""
