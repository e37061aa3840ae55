"""Where a gradient lives: a DTensor shard (and whether another rank of a group holds the same one),
Megatron's ``main_grad`` in a shared contiguous buffer, a view into such a buffer. The collection
(:mod:`.collect`) asks these before measuring a gradient."""

from __future__ import annotations

from itertools import product
from operator import attrgetter, gt

import torch

from .fused import _PLAIN, local_tensor


def is_shard(g: torch.Tensor) -> bool:
    """Whether ``g`` is a DTensor of which this rank holds a part only (FSDP2's sharded gradients)."""
    local = local_tensor(g)
    return local is not g and local.numel() != g.numel()


def shard_held_before(mesh, placements, ranks: tuple) -> bool:
    """Whether a rank before this one in ``ranks`` (``dp_group``'s, in group order) holds the same local
    tensor of a DTensor ``g`` on ``mesh`` with ``placements``: one whose coordinates on the mesh
    dimensions ``g`` is not replicated over are this rank's (it differs along replicated dimensions only: HSDP's replicas). Where ``g``'s mesh is a
    named slice of a larger one (``mesh["tp"]``), the group's ranks outside the slice are placed in that
    root mesh, and one on the same slice coordinates holds the same shard (``dp_group`` names ranks that
    hold replicas of the model); where it cannot be placed there (a flattened dimension), only ranks of
    ``g``'s own mesh are compared."""
    import torch.distributed as dist

    dims = [d for d, pl in enumerate(placements) if not pl.is_replicate()]  # _StridedShard is no is_shard()
    grid = mesh.mesh
    try:
        root = mesh._get_root_mesh()  # torch's own (DDP's 2-D path uses it); not public
    except AttributeError:
        root = mesh
    names, root_names = mesh.mesh_dim_names, getattr(root, "mesh_dim_names", None)
    if root is not mesh and names and root_names and all(names[d] in root_names for d in dims):
        grid, dims = root.mesh, [root_names.index(names[d]) for d in dims]
    coords = dict(zip(grid.flatten().tolist(), product(*map(range, grid.shape)), strict=True))
    me = dist.get_rank()
    mine = coords.get(me)
    if mine is None:
        return False
    for q in ranks:
        if q == me:
            return False
        c = coords.get(q)
        if c is not None and all(c[d] == mine[d] for d in dims):
            return True
    return False


def main_grad_now(p: torch.Tensor, mg: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """``(tensor, added, measure_now)`` for this micro step's unreduced ``main_grad`` of ``p``, from its
    post-accumulate-grad hook. Megatron's DDP adds ``.grad`` into ``main_grad`` (a view into its
    gradient buffer) in a later hook, which may start the bucket's reduction at once; so in a shared
    buffer ``main_grad + added`` (``added``: ``.grad``) is measured now (:meth:`GradBatch._rows_of_sum`),
    ``main_grad`` alone where fused accumulation added it already (``grad_added_to_main_grad``) or
    ``.grad`` does not fit. A ``main_grad`` kept elsewhere is looked up when the batch is measured
    (None: after every hook of this backward has run)."""
    if not in_shared_buffer(mg):
        return None, None, False
    g = p.grad
    if (g is None or g is mg or getattr(p, "grad_added_to_main_grad", False) or g.shape != mg.shape
            or g.layout is not torch.strided or g.device != mg.device):
        return mg, None, True
    return mg, g, True


_STORAGE = torch.Tensor.untyped_storage
_STORAGE_NBYTES = torch.UntypedStorage.nbytes
_NBYTES = attrgetter("nbytes")


def any_in_shared_buffer(grads: list) -> bool:
    """``any(map(in_shared_buffer, grads))``, without a Python call per tensor where all are plain
    tensors (it runs after every backward pass)."""
    if set(map(type, grads)).issubset(_PLAIN):
        try:
            return any(map(gt, map(_STORAGE_NBYTES, map(_STORAGE, grads)), map(_NBYTES, grads)))
        except (RuntimeError, NotImplementedError, TypeError):  # sparse and other storage-less layouts
            pass
    return any(map(in_shared_buffer, grads))


def in_shared_buffer(g: torch.Tensor | None) -> bool:
    """Whether ``g`` is a view into a larger buffer (DDP's ``gradient_as_bucket_view`` buckets, Megatron's
    contiguous grad buffer): its owner may scale or all-reduce it in place as soon as this hook returns
    (DDP divides a bucket view by the world size right after it), so it is measured now, not batched.
    A tensor without storage of its own (sparse) is not."""
    if g is None:
        return False
    if type(g) not in _PLAIN:
        g = local_tensor(g)
    try:
        return g.untyped_storage().nbytes() > g.nbytes
    except (RuntimeError, NotImplementedError, TypeError):  # sparse and other storage-less layouts
        return False


def sharded_over(param, ranks: list[int]) -> bool:
    """Whether ``param`` is a DTensor sharded over the mesh dimension of these ranks (torch's tensor
    parallelism, ``parallelize_module``): each of them holds a shard of its own, no duplicate. Also the
    local tensor DDP puts in a DTensor's place under 2-D DDP + TP (``DistributedDataParallel(...,
    device_mesh=mesh["dp"])``: a plain Parameter with the DTensor's spec in ``_st_info``)."""
    import torch.distributed as dist

    mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
    if mesh is None:
        spec = getattr(param, "_st_info", None)  # torch's DTensorSpec
        mesh, placements = getattr(spec, "mesh", None), getattr(spec, "placements", None)
    if mesh is None or placements is None:
        return False
    return any(pl.is_shard() and dist.get_process_group_ranks(mesh.get_group(dim)) == ranks
               for dim, pl in enumerate(placements))
