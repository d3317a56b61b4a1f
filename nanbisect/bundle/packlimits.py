"""The limits a pack is held to, written and read: its schema, how many members and how many
uncompressed bytes an archive may hold (`default_max_bytes`), the chunk it is streamed in.
Shared by `nanbisect.bundle.pack`, `nanbisect.bundle.packproof` and `nanbisect.bundle.untar`.
"""
from __future__ import annotations

PACK_SCHEMA = "nanbisect.pack/1"      # pack.json, the first member of every pack
MAX_MEMBERS = 100_000           # a full pack of a 1,000-rank bundle holds ~6,000
MAX_META_BYTES = 1 << 20        # one pax / GNU long-name header (tarfile reads it whole)
MAX_NAME_PARTS = 32
FLOOR_BYTES = 64 << 20          # what any archive may expand to
RATIO = 50                      # ... or this many times its own size,
CEILING_BYTES = 4 << 30         # ... but not past this, unless the archive itself is bigger:
BIG_RATIO = 2                   # then this many times its size (tensors barely compress)
XZ_MEMLIMIT = 256 << 20         # xz -9 needs 65 MiB to decompress
ENV_MAX_BYTES = "NANBISECT_UNPACK_MAX_BYTES"
_CHUNK = 1 << 20


def default_max_bytes(archive_bytes: int) -> int:
    """How many bytes an archive of ``archive_bytes`` may expand to by default.

    At least 64 MiB; else 50x the archive (reports, repro inputs and tensors compress far less),
    at most 4 GiB, unless the archive is over 2 GiB (a ``--full`` pack of a big model), then 2x
    its size. A 1 MiB gzip of 1 GiB of zeros stops after 64 MiB.

    >>> [default_max_bytes(n) >> 20 for n in (1 << 20, 10 << 20, 5 << 30)]
    [64, 500, 10240]
    """
    return max(FLOOR_BYTES, min(RATIO * archive_bytes, CEILING_BYTES), BIG_RATIO * archive_bytes)
