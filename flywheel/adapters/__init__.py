"""Adapter versions, the product's central noun: the immutable artifacts (local directory or S3),
their lifecycle (trained → evaluated → promoted / rejected / rolled back, as events and
projections), and the resolver that fetches and verifies a version for sampling."""
