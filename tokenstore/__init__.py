"""The token store: the one contract between the data plane (writer) and the trainer (reader).

Layout of a store directory (local path or ``gs://``)::

    shards/<name>/tokens    zarr3 array, uint32, flat token ids of the shard's documents
    shards/<name>/offsets   zarr3 array, int64, num_docs + 1 document start offsets (0 first)
    ledger.json             written last: the store exists only once this file does

Shards are written independently (one per Beam worker bundle); ``finalize`` then writes the
ledger with the shard order, counts, vocabulary size, EOS id and tokenizer hash. Readers see a
single flat token array across shards and can read any window without loading the store.
"""

from tokenstore.store import (
    LEDGER_NAME,
    Ledger,
    ShardLedger,
    ShardWriter,
    TokenStore,
    TokenStoreError,
    finalize,
    write_shard,
)

__all__ = [
    "LEDGER_NAME",
    "Ledger",
    "ShardLedger",
    "ShardWriter",
    "TokenStore",
    "TokenStoreError",
    "finalize",
    "write_shard",
]
