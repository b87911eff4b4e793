"""The 3D layout of the ranks: data x tensor x pipeline, and the process groups built from it once.

Ranks are ordered as Megatron-LM orders them: tensor-parallel rank fastest, then data-parallel,
then pipeline. Global rank ``g`` therefore sits at::

    tp = g % T,   dp = (g // T) % D,   pp = g // (T * D)

so the T ranks of a tensor-parallel group are neighbours (on a GPU machine: the same node, where
its two all-reduces per layer are cheapest), and ZeRO's data-parallel group strides over them.

The groups come from :func:`torch.distributed.device_mesh.init_device_mesh` with the mesh
``(pp, dp, tp)``: a row-major mesh of ``arange(world)`` has exactly the order above, the call is
made on every rank with the groups created in the same order (the collective requirement of
``new_group``), and it works on CPU/gloo in torch 2.13 (checked: ``init_device_mesh("cpu", ...)``
over a gloo default group). The mesh itself is kept in :class:`ProcessGroups` so that PyTorch
building blocks that take a ``DeviceMesh`` (``torch.distributed.pipelining``,
``torch.distributed.checkpoint``) can be handed the same groups. There are no module-level group
globals: the record is built by the strategy and passed down explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

MESH_DIMS = ("pp", "dp", "tp")
"""Names of the mesh dimensions, slowest first."""


@dataclass(frozen=True, kw_only=True)
class Coordinates:
    """Where one global rank sits in the layout: its rank inside each of its three groups."""

    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class ParallelLayout:
    """How many ranks each kind of parallelism uses; ``data * tensor * pipeline`` is the world.

    Args:
        data: data-parallel size D, the ranks ZeRO shards over.
        tensor: tensor-parallel size T (Megatron column/row splits of each layer).
        pipeline: pipeline-parallel size P (stages of consecutive layers). Whether P exceeds the
            number of layers is checked by the pipeline code, which knows the model.
    """

    data: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout.{name} is {value!r}; it must be an integer of at least 1")

    @classmethod
    def for_world(cls, world_size: int, tensor: int = 1, pipeline: int = 1) -> ParallelLayout:
        """The layout whose data-parallel size is what ``tensor * pipeline`` leaves of ``world_size``.

        Raises:
            ValueError: naming the numbers when ``tensor * pipeline`` does not divide the world.
        """
        for name, value in (("tensor", tensor), ("pipeline", pipeline)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}_parallel_size is {value!r}; it must be an integer of at least 1")
        if world_size % (tensor * pipeline):
            raise ValueError(
                f"tp({tensor}) * pp({pipeline}) = {tensor * pipeline} does not divide world_size({world_size}); "
                f"choose sizes whose product divides the number of processes (devices x nodes)"
            )
        layout = cls(world_size // (tensor * pipeline), tensor, pipeline)
        layout.check_world(world_size)
        return layout

    @property
    def world_size(self) -> int:
        """``data * tensor * pipeline``."""
        return self.data * self.tensor * self.pipeline

    def check_world(self, world_size: int) -> None:
        """Raise ``ValueError`` naming the numbers unless this layout covers exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp({self.data}) * tp({self.tensor}) * pp({self.pipeline}) != world_size({world_size}); "
                f"the three sizes must multiply to the number of processes"
            )

    def coordinates(self, global_rank: int) -> Coordinates:
        """Group ranks of ``global_rank`` (tensor fastest, then data, then pipeline). No communication."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global rank {global_rank} is outside this layout's world_size({self.world_size})")
        return Coordinates(
            tp=global_rank % self.tensor,
            dp=(global_rank // self.tensor) % self.data,
            pp=global_rank // (self.tensor * self.data),
        )

    def group_ranks(self, dim: str, global_rank: int) -> list[int]:
        """Global ranks of the ``dim`` ("dp", "tp" or "pp") group that ``global_rank`` belongs to."""
        c = self.coordinates(global_rank)
        if dim == "tp":
            return [c.pp * self.data * self.tensor + c.dp * self.tensor + t for t in range(self.tensor)]
        if dim == "dp":
            return [c.pp * self.data * self.tensor + d * self.tensor + c.tp for d in range(self.data)]
        if dim == "pp":
            return [p * self.data * self.tensor + c.dp * self.tensor + c.tp for p in range(self.pipeline)]
        raise ValueError(f"unknown layout dimension {dim!r}; use one of {MESH_DIMS}")


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """The process groups of one rank under a :class:`ParallelLayout`, built by :func:`build_groups`.

    ``dp``/``tp``/``pp`` are this rank's groups (plain ``ProcessGroup`` objects, passed explicitly to
    :mod:`lightning_zero.comm`); ``coords`` its rank in each; ``mesh`` the ``DeviceMesh`` they came from.
    """

    layout: ParallelLayout
    coords: Coordinates
    dp: Any
    tp: Any
    pp: Any
    mesh: Any


def build_groups(layout: ParallelLayout, device_type: str = "cpu") -> ProcessGroups:
    """Create the data-, tensor- and pipeline-parallel groups of ``layout``. Call on all ranks, once.

    The default process group must exist and have ``layout.world_size`` ranks.

    Raises:
        ValueError: when the world does not match the layout.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialized default process group (the strategy creates it)")
    layout.check_world(dist.get_world_size())
    mesh = init_device_mesh(device_type, (layout.pipeline, layout.data, layout.tensor), mesh_dim_names=MESH_DIMS)
    coords = layout.coordinates(dist.get_rank())
    groups = ProcessGroups(
        layout=layout,
        coords=coords,
        dp=mesh["dp"].get_group(),
        tp=mesh["tp"].get_group(),
        pp=mesh["pp"].get_group(),
        mesh=mesh,
    )
    # The mesh must agree with the arithmetic that the sampler and the tests rely on.
    for dim in MESH_DIMS:
        got = dist.get_process_group_ranks(getattr(groups, dim))
        assert got == layout.group_ranks(dim, dist.get_rank()), (dim, got)
    return groups
