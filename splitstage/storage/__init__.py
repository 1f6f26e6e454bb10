"""Storage: URLs, options, credentials and fsspec I/O for the cache, data and outputs."""
