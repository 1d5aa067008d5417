"""Images for vision-language models: decoding and preprocessing (``images``) and the embedded
photographs ``python -m data prepare`` copies (``photographs``).

numpy and Pillow only (no torch), so the pipeline's worker processes can decode images.
"""
