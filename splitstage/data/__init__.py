"""Data sets: rows, images, buckets, the data index and its memos."""
