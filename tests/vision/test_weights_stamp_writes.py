"""Weight writes that no version counter sees still drop cached features: through
``param.data``, and into a DTensor parameter's local shard (how NeMo-RL copies a reference
model's weights in place under FSDP2). The DTensor case runs in a child process, since it needs
a process group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from mmpack.vision.feature_cache import weights_stamp


def test_a_write_through_data_changes_the_stamp() -> None:
    model = torch.nn.Linear(64, 64)
    before = weights_stamp(model)
    version = model.weight._version
    with torch.no_grad():
        model.weight.data[3, 5] += 1e-4  # no version counter moves
    assert model.weight._version == version
    assert weights_stamp(model) != before
    assert weights_stamp(model) == weights_stamp(model)


def test_an_orthogonal_update_changes_the_stamp() -> None:
    """An update that keeps every L2 norm (a rotation of the weights) still moves the stamp."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 4.0]]))
    before = weights_stamp(model)
    with torch.no_grad():
        model.weight.data.copy_(torch.tensor([[5.0, 0.0]]))  # same L2 norm, same version
    assert weights_stamp(model) != before


CHILD = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from mmpack.vision.feature_cache import weights_stamp

    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Module()
    model.register_parameter(
        "w", torch.nn.Parameter(distribute_tensor(torch.randn(8), mesh, [Shard(0)]))
    )
    before = weights_stamp(model)
    versions = (model.w._version, model.w._local_tensor._version)
    with torch.no_grad():
        for _, value in model.state_dict().items():
            value.to_local().copy_(torch.ones(8))  # NeMo-RL's reference swap
    assert (model.w._version, model.w._local_tensor._version) == versions, "a counter moved"
    assert weights_stamp(model) != before, "the stamp missed the write"
    dist.destroy_process_group()
    print("ok")
    """
)


def test_a_write_into_a_dtensor_shard_changes_the_stamp() -> None:
    port = str(29500 + (hash(sys.argv[0]) % 400))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, port], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
