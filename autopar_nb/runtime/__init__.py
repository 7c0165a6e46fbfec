"""Apply a Plan with PyTorch's own parallel APIs: one technique per module.

``mesh`` (DeviceMesh), ``tp`` (parallelize_module), ``ac`` (checkpoint wrappers), ``fsdp`` (fully_shard),
``ddp`` (DDP, ZeRO-1), ``pp`` (torch.distributed.pipelining), ``amp`` (autocast, grad scalers), ``batchnorm``
(SyncBatchNorm), ``init`` (initial weights equal to single-process), ``apply`` (:func:`apply_plan`, the order),
``train`` (a step: data, forward/backward or schedule, optimizer).
"""

from .ac import apply_ac
from .apply import ParallelModel, apply_plan
from .batchnorm import apply_sync_batchnorm
from .ddp import apply_ddp, zero1_optimizer
from .fsdp import apply_fsdp
from .init import materialize
from .mesh import build_mesh, device_type
from .pp import build_schedule, split_model
from .tp import apply_tp, tp_styles

__all__ = [
    "ParallelModel", "apply_ac", "apply_ddp", "apply_fsdp", "apply_plan", "apply_sync_batchnorm", "apply_tp",
    "build_mesh", "build_schedule", "device_type", "materialize", "split_model", "tp_styles", "zero1_optimizer",
]
