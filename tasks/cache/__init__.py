"""The stage-1 cache: storage, shard format, store, reader, fingerprints."""
