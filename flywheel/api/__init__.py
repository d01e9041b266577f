"""The HTTP process: the trajectory and feedback intake (gateway, feedback routes, intake,
OTLP traces), the operator routes (review, rollback, status), `/metrics`, the dashboard, and
the server entry point (`python -m flywheel.api.server`) that mounts them with the OpenAI
routes of `flywheel.serving` on the shell of `flywheel.web`."""
