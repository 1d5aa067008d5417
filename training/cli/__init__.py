"""The tools of ``python -m training`` (training/__main__.py): ``generate`` (generate.py) and
``export`` (export.py, writing through export_target.py). Nothing in the training loop imports
them."""
