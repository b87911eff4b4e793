"""Sharded checkpoints: every rank writes its own pieces; they load into any world size or stage.

``format.py`` the directory layout and how a path is recognised; ``pieces.py`` the engine seen per
parameter (what each rank holds and writes); ``merge.py`` the ranks' reports merged into one
metadata (tensor-parallel parts, pipeline stages, tied names); ``io.py`` where a checkpoint goes (a
local path or any fsspec URL) and the check that every rank sees it; ``save.py`` the atomic parallel
save (a transaction: prepare, write, commit, publish; ``commit.py`` the last two, ``agreement.py``
every rank's outcome exchanged, ``files.py`` its file operations, ``lightning_dict.py`` what
Lightning's own dict holds); ``store.py`` its commit protocol on object stores (no rename:
``metadata.json`` last); ``reader.py`` any range of any tensor-parallel part of a saved tensor;
``load.py`` resharding loads (and plain Lightning checkpoints); ``consolidate.py`` one plain state dict without a process group;
``rng.py`` random states; ``fabric_state.py`` Fabric's ``state`` dict in the same format.

Why not ``torch.distributed.checkpoint`` (DCP), which also reshards on load: a ZeRO slice cuts
parameters at arbitrary element offsets, and DCP describes a rank's piece of a tensor through
``DTensor`` placements (even ``torch.chunk`` splits) or the deprecated ``ShardedTensor``; its
offline conversion ``format_utils.dcp_to_torch_save`` loads the whole state dict into memory, while
consolidation here must stream parameter by parameter; and the atomic rename of a complete
directory, weights-only loading of Lightning's own state and per-rank random states would be ours
to add anyway. The format here is as small: one ``torch.save`` file per rank with a 1-D piece of
each parameter, and a JSON file saying where each piece starts.
"""

from lightning_zero.checkpoint.consolidate import consolidate, load_from_checkpoint, to_lightning_checkpoint
from lightning_zero.checkpoint.format import is_sharded_checkpoint, read_metadata

__all__ = ["consolidate", "is_sharded_checkpoint", "load_from_checkpoint", "read_metadata", "to_lightning_checkpoint"]
