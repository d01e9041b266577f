"""Ingest: raw Kafka records → trajectory rows or dead letters (decode, the msgspec fast path)
and the repository that writes them."""
