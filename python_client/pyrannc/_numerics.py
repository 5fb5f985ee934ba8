"""The client's PyTorch numeric switches, sent with a job so that the daemon's CUDA devices
compute as this PyTorch would (daemon/runtime/numerics.h): TF32 in matmuls
(torch.set_float32_matmul_precision, torch.backends.cuda.matmul.allow_tf32) and in cuDNN
convolutions (torch.backends.cudnn.allow_tf32, True by default), cuDNN's deterministic and
benchmark modes, and torch.use_deterministic_algorithms. Read when the job is created (its first
forward); later changes do not reach it.
"""

import torch

from pyrannc.proto.rannc.v1 import training_pb2 as pb


def _cudnn_allow_tf32() -> bool:
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        # PyTorch >= 2.9 refuses the legacy getter once the fp32_precision API has been used.
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "high" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "highest"


def client_numerics() -> pb.NumericSettings:
    return pb.NumericSettings(
        float32_matmul_precision=_matmul_precision(),
        cudnn_allow_tf32=_cudnn_allow_tf32(),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
