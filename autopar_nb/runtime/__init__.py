"""What an exported script runs: one technique per module, standard library and torch only.

``deathsig`` (a worker ending with its torchrun), ``mesh`` (process group, DeviceMesh), ``tp``
(parallelize_module, styles as data), ``ac`` (checkpoint wrappers), ``fsdp`` (fully_shard), ``ddp``
(DDP), ``pp`` (torch.distributed.pipelining), ``amp`` (autocast, grad scalers), ``batchnorm``
(SyncBatchNorm), ``init`` (initial weights equal to single-process), ``data`` (batches, default
loss), ``optim`` (optimizer, LR schedule, clipping), ``guard`` (skipping steps with bad numerics),
``units`` (sizes and times as printed), ``checkpoint`` (DCP with manifests), ``metrics`` (the
process group around ``main`` and the launcher's metrics stream), ``train`` (the loop).

These modules are copied into every exported script's runtime module, or into the one-file script
(:mod:`autopar_nb.export.kit` takes each function's source verbatim), so they never import
``autopar_nb``, hold only imports, functions, classes and constants, and each name means one thing
across them. ``verify`` and ``launch`` run the exported files themselves.
"""
