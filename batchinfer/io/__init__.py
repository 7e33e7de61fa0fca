"""I/O at the edges: listing and reading shards, writing output files, the manifest commit."""
