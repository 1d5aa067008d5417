"""The Qwen3-VL model family (``model.arch: qwen3_vl``): a vision tower with learned, interpolated
position embeddings whose merged patch features replace the image placeholders of a Qwen3 language
model with interleaved 3-D M-RoPE, and whose DeepStack features of chosen vision blocks are added to
the first language blocks' outputs at the image positions.

family.py holds the torch-free row and its ``model.qwen3_vl`` settings; the model is model.py (a
Qwen2.5-VL model, models/qwen_vl/, with Qwen3's language blocks, another tower and DeepStack),
vision.py the tower, weights.py and hf_config.py the Hugging Face layout.
"""
