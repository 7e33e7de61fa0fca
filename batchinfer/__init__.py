"""batchinfer: audited, versioned batch inference on Apache Beam.

A job scores one partition of Parquet shards exactly once per row under one version triple
(model, feature schema, preprocessing code), quarantines bad rows with reasons, and commits
the partition with a manifest written last. See docs/contract.md.
"""
__version__ = "0.1.0"
