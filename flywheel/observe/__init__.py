"""Read models of the running pipeline, for whoever shows it: `status` holds the figures of
`flywheel status`, `GET /v1/status`, `/metrics` and the demo, so the CLI and the demo
read them without the HTTP package."""
