"""Optimizers that torch does not ship (Lion, schedule-free AdamW) and Muon with AdamW groups.

``training.optimizers.build`` chooses among them by ``train.optimizer`` and builds their groups. Each
keeps its state as tensors in ``optimizer.state[param]`` and its settings in standard
``param_groups``, so checkpoints save and reshard it like AdamW's. ``local_shards``: the
elementwise ones (and AdamW) step on the local tensors of FSDP/TP shards.
"""
