"""The generation engine, family-agnostic: it runs any model that implements ``GenerationModel``.

- ``protocol``: ``GenerationModel`` (what the engine asks of a model) and ``GenerationSpec``.
- ``kv_cache``: the preallocated, position-indexed key/value cache (``KVCache``).
- ``sampler``: ``Sampler``, ``SamplingParams``, ``SampleKey``, ``Sample``: batched, keyed sampling.
- ``scheduler``: continuous refill of the sampler's rows, multi-turn episodes' rows.
- ``nucleus``: the sampling rule's kernels (top-p's cut and the draw, torch and Triton).
- ``row_copy``: one-kernel copies of cache rows (CUDA).
- ``slot_write``: one-kernel writes of a forward's keys and values into their cache slots (CUDA, eager).
- ``prompts``: prompts files, context length, keyed samples per prompt, output records.

The numerics it runs under are the model's ``Numerics`` (models/numerics.py), the object the
training forward runs under. Nothing here imports a model family; each module is imported by
its own path (this package imports none of them).
"""
