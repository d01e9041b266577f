"""Postgres: tables (models), engine/session factory, repositories."""
