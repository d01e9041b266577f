"""Local runtime: the bundled broker, a local Postgres, the `up`/`down` supervisor."""
