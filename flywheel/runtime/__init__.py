"""Production plumbing every service uses: consuming with retries and dead letters (`consume`),
the process entry points (`entrypoint`), Kafka admin and lag (`kafka`), endpoints and the
run file (`endpoints`), logging (`logs`)."""
