"""The local stack of `flywheel up` / `down`: the supervisor (`supervisor.Stack`), what it
watches (`processes`), healing (`heal`), the outbox's republishing (`recovery`), the drain
at `down` (`drain`), `down`/`detach` (`control`), the services it launches (`launch`,
by module name), and the bundled broker, Postgres and vLLM server it runs."""
