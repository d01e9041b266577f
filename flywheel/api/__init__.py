"""The HTTP process: the app factory, auth, the trajectory gateway, review and rollback
routes, serving of the `production` alias, status, `/metrics`, the dashboard and the server
entry point (`python -m flywheel.api.server`)."""
